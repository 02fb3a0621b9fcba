"""compile_model: torchvision model in, calibrated int8 NCHW4c library out; compile_checkpoint:
a QAT checkpoint in, the same library out with the learned ranges instead of calibration.

    torch model --torch.export--> Relax (float) --fold BN / constants--> analysis
      --calibrate (float, real images) | learned QAT ranges--> QuantizeInt8 --> LiftConstantsToParams
      --> ScheduleInt8Kernels(target) --> tvm.compile --> model.so + model.params.npz + model.json
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import tvm

from .calibrate import calibrate
from .config import QuantConfig
from .data import load_calibration_images
from .errors import InputError
from .frontend import export_to_relax, load_model, simplify
from .graph import Graph, analyze
from .transform import LiftConstantsToParams, QuantizeInt8, ScheduleInt8Kernels

ARTIFACT_VERSION = 1


def make_target(target: str, arch: str | None = None) -> tvm.target.Target:
    """``llvm`` or ``cuda`` (+ arch such as ``sm_90``) as a TVM target with the attributes
    MetaSchedule's CUDA rules need."""
    if target == "llvm":
        # Without mcpu LLVM emits baseline x86-64 (SSE2: no 32-bit vector multiply), ~4x slower int8
        # convs; the library is then tuned to this machine's CPU, like gcc -march=native.
        return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1,
                                  "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    if target == "cuda":
        arch = arch or "sm_90"
        if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
            raise InputError(f"--arch {arch!r} is not a CUDA arch such as sm_90 or sm_80")
        return tvm.target.Target({"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                                  "max_shared_memory_per_block": 49152, "thread_warp_size": 32}, host="llvm")
    raise InputError(f"unknown target {target!r}: choose llvm or cuda")


@dataclass
class BuildResult:
    lib_path: str
    report: dict
    meta: dict = field(default_factory=dict)


def _dump(debug_dump: str | None, step: str, mod) -> None:
    """Write the IR after a numbered phase (``--debug-dump DIR``): a wrong fusion or layout is
    found by reading files, not by guessing."""
    if debug_dump:
        os.makedirs(debug_dump, exist_ok=True)
        with open(os.path.join(debug_dump, f"{step}.py"), "w") as f:
            f.write(mod.script(show_meta=False))


# Ops between two int8 layers that commute with per-tensor quantization at one scale: a max-pool
# keeps its int8 input's scale, and a reshape of a dequantized tensor requantized at the same
# scale gives back the same integers.  The QAT input quantizer after them is the tensor's scale.
_SCALE_PRESERVING = ("relax.nn.max_pool2d", "relax.reshape")


def map_learned_ranges(graph: Graph, learned: dict[str, float], source: str = "the checkpoint") -> tuple[dict, dict]:
    """The range of every calibration point of ``graph``, taken from QAT's learned ranges.

    QAT quantizes a tensor where it is *consumed*: layer ``L``'s input quantizer uses the learned
    ``L.in0``; a layer's recorded output range ``L.out`` scales nothing.  The compiled model
    instead requantizes each int8 layer's output in its epilogue, at the scale of the point
    ``L.out``.  For the two to compute the same integers, a point takes the ``.in0`` range of the
    layer that consumes it, following max-pools and reshapes (``_SCALE_PRESERVING``); a point
    no int8 layer consumes keeps its own name (``L.out`` of the last conv before a float op).

    Args:
        graph: the analysis of the float model at the build shape.
        learned: ``{f"{layer}.in0" | f"{layer}.out": amax}``, a QAT checkpoint's ``amax``.
        source: names the ranges' origin in error messages.

    Returns:
        ``(amax, used)``: ``{point: amax}`` for every point of ``graph``, and ``{point: the
        checkpoint key it came from}`` (recorded in the build report).

    Raises:
        InputError: a point has no learned range, or a range is not a positive finite number.
    """
    producer = {b.var: b.value for b in graph.bindings}
    used = {point: point for point in graph.points.values()}
    for ly in graph.layers:
        if ly.kind not in ("conv2d", "dense"):
            continue
        x = ly.inputs[0]
        while getattr(getattr(producer.get(x), "op", None), "name", None) in _SCALE_PRESERVING:
            x = producer[x].args[0]
        if x in graph.points:
            used[graph.points[x]] = f"{ly.name}.in0"
    missing = sorted({key for key in used.values() if key not in learned})
    if missing:
        raise InputError(f"{source} has no learned range for {missing} (the compiled graph quantizes these "
                         f"tensors; it has {len(learned)} ranges, e.g. {sorted(learned)[:4]}): it was not trained for this "
                         "model; retrain with "
                         "`python train.py --qat --out CKPT`, which records every conv and linear layer's ranges")
    bad = sorted(key for key in set(used.values()) if not (np.isfinite(learned[key]) and learned[key] > 0))
    if bad:
        raise InputError(f"{source} has a learned range of 0 or NaN for {bad}: those layers never saw data in "
                         "training (0 = not observed); train for at least one epoch with --qat")
    return {point: float(learned[key]) for point, key in used.items()}, used


def quantize_module(model, input_shape, config: QuantConfig, calib_images=None, amax: dict | None = None,
                    progress: bool = True, expose_activations: bool = False, debug_dump: str | None = None,
                    *, learned_ranges: dict | None = None, ranges_source: str = "the checkpoint"):
    """The int8 Relax module of ``model`` (weights still inline) and its report.

    Ranges come from ``amax`` when given (by point name, e.g. a previous calibration), else from
    ``learned_ranges`` (a QAT checkpoint's ranges by layer, mapped onto the points by
    :func:`map_learned_ranges`), else from calibrating on ``calib_images`` at batch 1.  The
    report's ``ranges`` entry says which.
    """
    mod, names = export_to_relax(model, input_shape)
    _dump(debug_dump, "01_imported", mod)
    mod = simplify(mod)
    _dump(debug_dump, "02_simplified", mod)
    if amax is not None:
        ranges = dict(source="given")
    elif learned_ranges is not None:
        amax, used = map_learned_ranges(analyze(mod["main"], names), learned_ranges, ranges_source)
        ranges = dict(source="checkpoint", checkpoint=ranges_source, calibrated=False, points=used)
    else:
        cal_mod, cal_names = export_to_relax(model, (1, *input_shape[1:]))
        graph = analyze(simplify(cal_mod)["main"], cal_names)
        amax = calibrate(graph, calib_images, config, progress=progress)
        ranges = dict(source="calibration", calibration=config.calibration,
                      images=int(min(len(calib_images), config.num_calib_images)))
        if config.calibration == "percentile":
            ranges["percentile"] = config.percentile
    qpass = QuantizeInt8(amax, config, names, expose_activations)
    qmod = qpass(mod)
    _dump(debug_dump, "03_quantized", qmod)
    return qmod, dict(qpass.report, ranges=ranges), amax, names


def compile_model(model_name: str, out_path: str, *, target: str = "llvm", arch: str | None = None,
                  batch: int = 1, image_size: int = 224, weights: str | None = None, num_classes: int | None = None,
                  config: QuantConfig = QuantConfig(), calib_dir: str | None = None, model=None,
                  calib_images=None, amax: dict | None = None, tuning_log: str | None = None,
                  progress: bool = True, expose_activations: bool = False,
                  debug_dump: str | None = None, cuda_graph: bool = False,
                  learned_ranges: dict | None = None, ranges_source: str = "the checkpoint",
                  extra_meta: dict | None = None) -> BuildResult:
    """Build a deployable int8 library.

    Args:
        model_name: torchvision name (``vgg16``); ``model`` overrides the torch module itself.
        out_path: the ``.so`` to write; ``<stem>.params.npz`` and ``<stem>.json`` go beside it.
        target / arch: ``llvm`` or ``cuda`` with e.g. ``sm_90``.
        batch, image_size: the static input shape (batch, 3, image_size, image_size).
        weights: None, a checkpoint path or a torchvision weight name (see ``load_model``).
        calib_dir: folder of JPEG/PNG calibration images (default: scikit-image's photos).
        calib_images: preprocessed float32 [N, 3, H, W] images instead of ``calib_dir``.
        amax: ranges by point name (``features.0.out``) instead of calibration.
        learned_ranges: a QAT checkpoint's ranges by layer (``features.0.in0``) instead of
            calibration, mapped onto the points by :func:`map_learned_ranges`;
            ``ranges_source`` names them in errors and in the report (see :func:`compile_checkpoint`).
        tuning_log: a MetaSchedule database folder to take tuned conv schedules from.
        expose_activations: the library also returns every int8 activation (for debugging).
        debug_dump: a folder to write the IR into after each phase (01_imported.py ...).
        cuda_graph: (cuda) let Relax capture the kernel launches after the input into a CUDA
            graph (RewriteCUDAGraph), replayed on later calls: less launch overhead at batch 1.
        extra_meta: entries added to (and overriding) the artifact's ``<stem>.json``.
    Example:
        >>> compile_model("vgg16", "vgg16.so", target="cuda", arch="sm_90", batch=1)
    """
    if batch < 1 or image_size < 8:
        raise InputError(f"batch must be >= 1 and image size >= 8, got batch {batch}, size {image_size}")
    tgt = make_target(target, arch)
    t0 = time.time()
    model = model if model is not None else load_model(model_name, weights, num_classes)
    shape = (batch, 3, image_size, image_size)
    images = calib_images
    if amax is None and learned_ranges is None and images is None:
        images = load_calibration_images(calib_dir, image_size, limit=config.num_calib_images)
    qmod, report, amax, names = quantize_module(model, shape, config, images, amax, progress, expose_activations,
                                                debug_dump, learned_ranges=learned_ranges,
                                                ranges_source=ranges_source)
    lift = LiftConstantsToParams()
    qmod = lift(qmod)
    _dump(debug_dump, "04_params_lifted", qmod)
    tuned = {}
    if tuning_log:
        from .tuning import apply_tuning_database
        qmod, tuned = apply_tuning_database(qmod, tuning_log, tgt)
    sched = ScheduleInt8Kernels(tgt)
    qmod = sched(qmod)
    _dump(debug_dump, "05_scheduled", qmod)
    t1 = time.time()
    graph_cfg = {"relax.backend.use_cuda_graph": bool(cuda_graph and target == "cuda")}
    with tgt, tvm.transform.PassContext(opt_level=3, config=graph_cfg):
        ex = tvm.compile(qmod, target=tgt)
    t2 = time.time()
    report = dict(report, schedules=sched.applied, tuned=tuned)
    meta = dict(version=ARTIFACT_VERSION, model=model_name, input_shape=list(shape), target=str(tgt.kind.name),
                arch=arch if target == "cuda" else None, config=config.to_dict(), amax=amax,
                param_names=[n for n, _ in lift.params], num_outputs=1, report=report,
                build_seconds=dict(quantize=round(t1 - t0, 2), compile=round(t2 - t1, 2)),
                built=time.strftime("%Y-%m-%d %H:%M:%S"), categories=_categories(model_name),
                cuda_graph=graph_cfg["relax.backend.use_cuda_graph"])
    meta.update(extra_meta or {})
    save_artifact(ex, lift.params, meta, out_path)
    return BuildResult(out_path, report, meta)


def compile_checkpoint(checkpoint: str, out_path: str, *, target: str = "llvm", arch: str | None = None,
                       batch: int = 1, image_size: int | None = None, config: QuantConfig = QuantConfig(),
                       tuning_log: str | None = None,
                       progress: bool = True, expose_activations: bool = False, debug_dump: str | None = None,
                       cuda_graph: bool = False) -> BuildResult:
    """Build the int8 library of a QAT checkpoint (``train.py --qat --out CKPT``), no calibration.

    Rebuilds the float architecture the checkpoint was trained with (its ``config``: model and
    image size), loads its weights, and takes every activation range from its learned ``amax``
    (:func:`map_learned_ranges`).  The weights are quantized as in training (per output channel,
    ``max|w[o]| / 127`` in float32, round to nearest even), so the int8 weights are the ones QAT
    trained.  The artifact's json records the checkpoint, its training config and accuracies,
    and the digits split, for :func:`tvm_qconv.train.evaluate_library`.

    Args:
        checkpoint: the file ``train.py --qat`` wrote.
        image_size: None (the size it was trained at) or that same size: the learned ranges and
            the classifier's width hold at that size only.
        out_path, target, arch, batch, config, tuning_log, progress, expose_activations,
        debug_dump, cuda_graph: as :func:`compile_model` (the calibration fields of ``config``
            are unused: nothing is calibrated).

    Raises:
        InputError: not a train.py checkpoint, trained without ``--qat``, lacking a range the
            compiled graph needs, or another ``image_size``.

    Example:
        >>> compile_checkpoint("ckpt.pt", "build/small_vgg.so", target="llvm")
    """
    from .train import DIGITS_CLASSES, load_float_model

    model, ckpt, train_config = load_float_model(checkpoint, require_qat=True)
    size = train_config.image_size
    if image_size not in (None, size):
        raise InputError(f"image size {image_size}: {checkpoint} was trained at {size}x{size}, and its learned "
                         "ranges (and the classifier's width) hold at that size only; build at its size")
    extra = dict(categories=[str(d) for d in range(DIGITS_CLASSES)],
                 dataset=dict(name="digits", seed=train_config.seed, image_size=train_config.image_size),
                 checkpoint=dict(path=os.path.abspath(checkpoint), train_config=ckpt["config"],
                                 accuracy=ckpt.get("accuracy", {})))
    return compile_model(train_config.model, out_path, target=target, arch=arch, batch=batch,
                         image_size=size, config=config, model=model, tuning_log=tuning_log,
                         progress=progress, expose_activations=expose_activations, debug_dump=debug_dump,
                         cuda_graph=cuda_graph, learned_ranges=ckpt["amax"], ranges_source=checkpoint,
                         extra_meta=extra)


def _categories(model_name: str) -> list | None:
    """ImageNet class names from torchvision's weight metadata (shipped in the package, no download)."""
    try:
        import torchvision
        return list(torchvision.models.get_model_weights(model_name).DEFAULT.meta["categories"])
    except Exception:  # models without torchvision weights: print class indices
        return None


def cuda_source(ex) -> str:
    """The CUDA C of a ``tvm.compile`` result (its module tree varies: walk it for the cuda module)."""
    mods = [ex.mod if hasattr(ex, "mod") else ex]
    while mods:
        mod = mods.pop()
        if mod.kind == "cuda":
            return mod.inspect_source()
        mods.extend(mod.imports)
    raise ValueError("the build holds no CUDA module")


def artifact_paths(lib_path: str) -> tuple[str, str]:
    stem = lib_path[:-3] if lib_path.endswith(".so") else lib_path
    return stem + ".params.npz", stem + ".json"


def save_artifact(ex, params, meta, lib_path: str) -> None:
    """Write the three files atomically (temp file + rename): an interrupted build never leaves a
    half-written library or params file behind, and an earlier build at the same path survives."""
    params_path, meta_path = artifact_paths(lib_path)
    folder = os.path.dirname(os.path.abspath(lib_path))
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder, prefix=".tvm_qconv-")
    try:
        ex.export_library(os.path.join(tmp, "lib.so"))
        np.savez(os.path.join(tmp, "params.npz"), **{n: a for n, a in params})
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        for src, dst in (("params.npz", params_path), ("meta.json", meta_path), ("lib.so", lib_path)):
            os.replace(os.path.join(tmp, src), dst)
    finally:
        for name in os.listdir(tmp):
            os.remove(os.path.join(tmp, name))
        os.rmdir(tmp)
