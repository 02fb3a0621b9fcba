"""compile_model: a float model in, a deployable int8 library out; compile_checkpoint: a QAT
checkpoint in, the same library out with the learned ranges instead of calibration.

    quantize_module (quantize.py) --> LiftConstantsToParams --> tuning database (tuning/apply.py)
      --> ScheduleInt8Kernels(target) --> tvm.compile --> model.so + model.params.npz + model.json
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import torch
import torchvision
import tvm

from . import cuda_check, registry
from . import verify as verify_mod
from . import interrupts, model_check
from .artifact import ARTIFACT_VERSION, save_artifact, unverified_path
from .config import QuantConfig
from .errors import InputError
from .fileio import check_output_file
from .frontend import ExportedGraphs, as_frontend
from .graph import static_shape
from .progress import as_phases
from .quantize import dump_ir, quantize_module
from .ranges import GivenRanges, LearnedRanges, RangeSource
from .target import TargetInfo, make_target
from .training.checkpoint import DIGITS_CLASSES, load_float_model
from .transform import LiftConstantsToParams, ScheduleInt8Kernels
from .tuning.apply import apply_tuning_database, measured_chooser
from .tuning.database import database_target, load_database


@dataclass(frozen=True)
class BuildOptions:
    """How to build (the scheme is :class:`QuantConfig`, the ranges a range source).

    Attributes:
        target: ``llvm`` or ``cuda``; arch: the CUDA arch (``sm_90``; default sm_90).
        batch, image_size: the static input shape (batch, 3, image_size, image_size); no
            image_size: 224, or a checkpoint's training size (:func:`compile_checkpoint`).
        tuning_log: a MetaSchedule database folder to take tuned schedules from.
        ignore_stale: records of an older template leave their kernels on the default schedule
            (a warning) instead of refusing the build.
        cuda_graph: (cuda) let Relax capture the kernel launches after the input into a CUDA
            graph (RewriteCUDAGraph), replayed on later calls: less launch overhead at batch 1.
        expose_activations: the library also returns every int8 activation (for debugging).
        debug_dump: a folder to write the IR into after each phase (01_imported.py ...).
        kernels: ``{layer: implementation}`` to prefer over the registry's order (e.g.
            ``{"features.0": "conv2d.nchw4c.dp4a"}``); ignored where it does not apply.
        families: prefer these kernel families, in order (e.g. ``("dp4a",)`` to leave the tensor
            cores out); a layer none of them runs gets the registry's choice.
        verify: run the built library on a few calibration images and compare its logits with
            the float model's (``tvm_qconv/verify.py``); under ``verify_floor_db`` the report
            names the first layer whose int8 activations diverge.
        accuracy_target_db: where the verified logits SQNR is under this (e.g. 30), the report
            also names the layers that lose the most (``verify.losses``: a second build at batch
            1 that returns every int8 activation); None: only under the floor.
        require_int8: refuse a skip list that leaves no layer in int8 (``deploy.py build``);
            from Python, ``QuantConfig(skip=("*",))`` builds the float model on purpose.
    """

    target: str = "llvm"
    arch: str | None = None
    batch: int = 1
    image_size: int | None = None
    tuning_log: str | None = None
    ignore_stale: bool = False
    cuda_graph: bool = False
    expose_activations: bool = False
    debug_dump: str | None = None
    kernels: dict = field(default_factory=dict)
    families: tuple[str, ...] | None = None
    verify: bool = True
    verify_floor_db: float = verify_mod.FLOOR_DB
    accuracy_target_db: float | None = None
    require_int8: bool = False

    def __post_init__(self):
        if self.batch < 1 or (self.image_size is not None and self.image_size < 8):
            raise InputError(f"batch must be >= 1 and image size >= 8, got batch {self.batch}, "
                             f"size {self.image_size}")
        families = sorted({impl.family for impl in registry.IMPLEMENTATIONS})
        unknown = [f for f in self.families or () if f not in families]
        if unknown:
            raise InputError(f"unknown kernel famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: "
                             f"choose from {', '.join(families)}")
        if self.accuracy_target_db is not None and not self.accuracy_target_db >= 0:
            raise InputError(f"accuracy_target_db is a logits SQNR in dB (>= 0, or None: off), got "
                             f"{self.accuracy_target_db}")
        names = sorted(impl.name for impl in registry.IMPLEMENTATIONS)
        unknown = sorted({k for k in self.kernels.values() if k not in names})
        if unknown:
            raise InputError(f"unknown kernel implementation {', '.join(unknown)}: choose from {', '.join(names)}")
        if self.tuning_log:
            tuned_for = database_target(self.tuning_log)
            if tuned_for != self.target:
                raise InputError(f"tuning log {self.tuning_log} holds {tuned_for} schedules; a {self.target} build "
                                 f"cannot use it: build with --target {tuned_for}, or tune for {self.target} "
                                 f"(tune.py --target {self.target}), or leave --tuning-log out")

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        size = self.image_size or 224
        return (self.batch, 3, size, size)

    @property
    def uses_cuda_graph(self) -> bool:
        """CUDA graphs exist for CUDA builds only (``cuda_graph`` is ignored on llvm)."""
        return self.cuda_graph and self.target == "cuda"


@dataclass
class BuildResult:
    lib_path: str
    report: dict
    meta: dict = field(default_factory=dict)


def compile_model(model: str | torch.nn.Module, out_path: str, *, options: BuildOptions = BuildOptions(),
                  config: QuantConfig = QuantConfig(), ranges: RangeSource | None = None, name: str | None = None,
                  progress=True, extra_meta: dict | None = None) -> BuildResult:
    """Build a deployable int8 library.

    A library that fails its verification (logits SQNR against the float model under
    ``options.verify_floor_db``) does not replace what is at ``out_path``: it is written beside it
    as ``<stem>.unverified.so`` (and its params / json), ``artifact.accept_unverified`` moves it
    into place, and ``BuildResult.lib_path`` says where it went.

    Args:
        model: a torchvision classifier name (``vgg16``, random init; see
            :func:`tvm_qconv.frontend.load_model` for weights and ``.onnx`` files), a float
            ``torch.nn.Module``, or any :class:`tvm_qconv.frontend.Frontend` (an ``OnnxModel``).
            Its ``forward`` may return a tuple / list / dict: the library computes its first
            tensor, and the report says so.
        out_path: the ``.so`` to write; ``<stem>.params.npz`` and ``<stem>.json`` go beside it.
        options: target, shape, tuning database, debugging (:class:`BuildOptions`).
        config: the quantization scheme.
        ranges: where the activation ranges come from (``tvm_qconv.ranges``: ``Calibrate``,
            ``GivenRanges``, ``LearnedRanges``); default: calibrate on scikit-image's photos.
        name: the model's name in the artifact (default: ``model`` if a name, else its class).
        progress: print each phase as it starts (bool, or a ``progress.Phases`` to share).
        extra_meta: entries added to (and overriding) the artifact's ``<stem>.json``.

    Raises:
        InputError: an output path that cannot be written, a model that cannot take the input
            shape or whose activations would not fit in memory, before any long work.

    Example:
        >>> compile_model("vgg16", "vgg16.so", options=BuildOptions(target="cuda", arch="sm_90"))
    """
    phases = as_phases(progress)
    check_output_file(out_path, "library")
    tgt = make_target(options.target, options.arch)
    name = name or (model if isinstance(model, str) else None)
    model = as_frontend(model, name)
    name = name or model.name
    probe = model.probe(options.input_shape, name)
    model_check.check_memory(probe, options.input_shape, name,
                             host_batch=None if options.target == "llvm" else verify_mod.IMAGES)
    with model.first_output(probe):
        exported = model.export(options.input_shape)   # the one torch.export (or ONNX import) of this build
        q, ex, params, applied, tuned = _compile(model, tgt, options, config, ranges, phases, exported)
        report = dict(q.report, schedules=applied, tuned=tuned)
        if tgt.kind.name == "cuda":
            report["cuda_source"] = _check_cuda_source(ex, tgt, phases)
        note = model.report_note(probe)
        if note:
            report["output"] = note
        if options.verify:
            with phases("verify", "run the library against the float model"):
                report["verify"] = _verify(exported, tgt, options, config, q, ex, params)
    meta = dict(version=ARTIFACT_VERSION, tvm_version=tvm.__version__, model=name, input_shape=list(options.input_shape),
                target=str(tgt.kind.name), arch=str(tgt.attrs["arch"]) if "arch" in tgt.attrs else None,
                config=config.to_dict(), amax=q.amax, param_names=[n for n, _ in params],
                report=report, built=time.strftime("%Y-%m-%d %H:%M:%S"), categories=_categories(name),
                cuda_graph=options.uses_cuda_graph, options=asdict(options), float_weights=model.digest(),
                output_shape=output_shape(q.mod))
    meta.update(extra_meta or {})
    if report.get("verify", {}).get("status") == "failed":
        out_path = unverified_path(out_path)
    with phases("save", out_path):
        meta["build_seconds"] = _seconds(phases)
        save_artifact(ex, params, meta, out_path)
    return BuildResult(out_path, report, meta)


def output_shape(mod: tvm.IRModule) -> list[int] | None:
    """The static shape of what ``main`` returns (its first tensor where it returns several), as
    the library's record keeps it: ``[N, classes]`` for a classifier; what ``run`` and ``eval``
    read to tell a classifier from a feature map.  None where a dimension is not static."""
    ty = mod["main"].body.body.ty
    while isinstance(ty, tvm.relax.TupleType):
        ty = ty.fields[0]
    shape = static_shape(ty)
    return list(shape) if shape is not None else None


def _seconds(phases) -> dict:
    """Each phase's seconds, and ``total`` (up to the save)."""
    return dict(phases.seconds, total=round(phases.elapsed, 2))


def _compile(model, tgt, options: BuildOptions, config: QuantConfig, ranges, progress,
             exported: ExportedGraphs | None = None):
    """quantize -> lift params -> tuning database -> default schedules -> tvm.compile
    (``exported``: the model's export, to reuse).

    Returns:
        (QuantizedModule, executable, params, schedules applied, tuned kernels).
    """
    phases = as_phases(progress)
    db = load_database(options.tuning_log, options.ignore_stale) if options.tuning_log else None
    chooser = measured_chooser(db, tgt) if db is not None else None
    if options.families:
        chooser = _family_chooser(options.families, chooser)
    q = quantize_module(model, options.input_shape, TargetInfo.from_target(tgt), config=config, ranges=ranges,
                        choices=options.kernels, chooser=chooser, expose_activations=options.expose_activations,
                        debug_dump=options.debug_dump, progress=phases, require_int8=options.require_int8,
                        exported=exported)
    with phases("schedule", "lift weights, apply schedules" + (" from the tuning log" if db is not None else "")):
        lift = LiftConstantsToParams()
        qmod = lift(q.mod)
        dump_ir(options.debug_dump, "04_params_lifted", qmod)
        tuned = {}
        if options.tuning_log:
            qmod, tuned = apply_tuning_database(qmod, options.tuning_log, tgt, db, ignore_stale=options.ignore_stale)
        sched = ScheduleInt8Kernels(tgt)
        qmod = sched(qmod)
        dump_ir(options.debug_dump, "05_scheduled", qmod)
    # The compile options of the kernel implementations in the module (e.g. the tensor-core
    # family's TIR pipeline and asynchronous copies).
    impls = {registry.of_func(f) for f in qmod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)} - {None}
    compile_options = registry.compile_options(impls)
    config = {"relax.backend.use_cuda_graph": options.uses_cuda_graph, **compile_options["config"]}
    arch = f" {tgt.attrs['arch']}" if "arch" in tgt.attrs else ""
    with phases("compile", f"tvm.compile for {tgt.kind.name}{arch}"), tgt, \
            tvm.transform.PassContext(opt_level=3, config=config, instruments=interrupts.pass_instruments()):
        ex = tvm.compile(qmod, target=tgt, tir_pipeline=compile_options["tir_pipeline"])
    return q, ex, lift.params, sched.applied, tuned


def _check_cuda_source(ex, tgt, phases) -> dict:
    """nvcc on the CUDA source of a build this TVM could not compile itself (``cuda_check``): a
    kernel nvcc rejects fails the build here, not the load on the user's GPU."""
    arch = str(tgt.attrs["arch"])
    if cuda_check.tvm_compiles_cuda() or shutil.which("nvcc") is None:
        return cuda_check.check(ex, arch)
    with phases("nvcc", f"compile the CUDA source for {arch} (this TVM has no CUDA runtime to compile it)"):
        return cuda_check.check(ex, arch)


def _family_chooser(families, fallback):
    """Prefer the first of ``families`` that can run a layer; else ask ``fallback``."""
    def choose(op, wl, candidates):
        for family in families:
            for impl in candidates:
                if impl.family == family:
                    return impl.name
        return fallback(op, wl, candidates) if fallback else None
    return choose


def _verify(exported: ExportedGraphs, tgt, options: BuildOptions, config: QuantConfig, q, ex, params) -> dict:
    """Compare the compiled logits with the float model's (``exported.frontend``) on calibration
    images; under the floor
    find the first layer that diverges, and under the floor or the accuracy target rank the
    layers by what each loses (``tvm_qconv/verify.py``)."""
    if q.images is None:
        return dict(status="skipped", reason="the ranges were not calibrated: no images to check on")
    reason = verify_mod.cannot_run(tgt)
    if reason:
        return dict(status="skipped", reason=reason)
    held_out = q.held_out is not None  # (Calibrate holds out none, or at least HELD_OUT_MIN)
    images = q.held_out if held_out else q.images[:verify_mod.IMAGES]
    model = exported.frontend
    sqnr, ref = verify_mod.logits_sqnr(ex, params, tgt, options.batch, model, images)
    result = dict(status="ok" if sqnr >= options.verify_floor_db else "failed", logits_sqnr_db=round(sqnr, 2),
                  images=len(images), held_out=held_out, floor_db=options.verify_floor_db)
    if verify_mod.input_blind(ref):
        return dict(result, status="cannot judge",
                    reason=f"the float model gives the same logits for all {len(images)} images (its output does not "
                           "depend on the input, as in a random init whose activations die out): agreeing with it "
                           "proves nothing; build it with trained weights (--weights) to verify it")
    target = options.accuracy_target_db
    if target is not None:
        result["target_db"] = target
    # each int8 layer's kernel in the unfused plan (a table or an add in a conv's epilogue has its own)
    kernels = {lp.layer.name: lp.impl.name for lp in q.plan.layers if lp.int8 and lp.impl is not None}
    if kernels and (sqnr < options.verify_floor_db or (target is not None and sqnr < target)):
        # A twin at batch 1 that returns every int8 activation, from the same ranges and with the
        # same kernel per layer (a tuning database's chooser could pick others at batch 1).
        t0 = time.time()
        # the kernels pinned, no database (one tuned at another batch matches nothing at batch
        # 1, and says so): integer results do not depend on the schedule
        debug = dataclasses.replace(options, batch=1, expose_activations=True, debug_dump=None, verify=False,
                                    tuning_log=None, kernels={**kernels, **options.kernels})
        # (GPTQ's rounded weights are the quantized model's: taken as they are, on their grid)
        # (the build's export, at batch 1: the rounded model's with GPTQ)
        dq, dex, dparams, *_ = _compile(q.model, tgt, debug, dataclasses.replace(config, weight_rounding="nearest"),
                                        GivenRanges(q.amax), progress=False, exported=q.exported)
        # against the float model's own activations (with GPTQ, dq.graph is the rounded model's)
        reference = exported.at(1).graph
        layers = verify_mod.layer_sqnr(dex, dparams, tgt, dq.report["exposed"], reference, images)
        result["layers"] = layers
        result["losses"] = verify_mod.losses(layers, dq.report["exposed"])
        result["per_layer_s"] = round(time.time() - t0, 1)
        result["first_bad_layer"] = next((ly["layer"] for ly in layers if ly["sqnr_db"] < options.verify_floor_db),
                                         None)
    return result


def compile_checkpoint(checkpoint: str, out_path: str, *, options: BuildOptions | None = None,
                       config: QuantConfig = QuantConfig(), progress=True) -> BuildResult:
    """Build the int8 library of a QAT checkpoint (``train.py --qat --out CKPT``), no calibration.

    Rebuilds the float architecture the checkpoint was trained with (its ``config``: model and
    image size), loads its weights, and takes every activation range from its learned ``amax``
    (:class:`tvm_qconv.ranges.LearnedRanges`).  The weights are quantized as in training (per
    output channel, ``max|w[o]| / 127`` in float32, round to nearest even), so the int8 weights
    are the ones QAT trained.  The artifact's json records the checkpoint, its training config
    and accuracies, and the digits split, for :func:`tvm_qconv.evaluate.evaluate_library`.

    Args:
        checkpoint: the file ``train.py --qat`` wrote.
        options: as :func:`compile_model`; ``image_size`` must be the size it was trained at
            (default: that size).
        config: as :func:`compile_model` (its calibration fields are unused).

    Raises:
        InputError: not a train.py checkpoint, trained without ``--qat``, lacking a range the
            compiled graph needs, or another image size.

    Example:
        >>> compile_checkpoint("ckpt.pt", "build/small_vgg.so")
    """
    model, ckpt, train_config = load_float_model(checkpoint, require_qat=True)
    size = train_config.image_size
    options = options or BuildOptions()
    if options.image_size is None:
        options = dataclasses.replace(options, image_size=size)
    if options.image_size != size:
        raise InputError(f"image size {options.image_size}: {checkpoint} was trained at {size}x{size}, and its "
                         "learned ranges (and the classifier's width) hold at that size only; build at its size")
    extra = dict(categories=[str(d) for d in range(DIGITS_CLASSES)],
                 dataset=dict(name="digits", seed=train_config.seed, image_size=train_config.image_size),
                 checkpoint=dict(path=os.path.abspath(checkpoint), train_config=ckpt["config"],
                                 accuracy=ckpt.get("accuracy", {})))
    return compile_model(model, out_path, options=options, config=config, name=train_config.model,
                         ranges=LearnedRanges(ckpt["amax"], checkpoint), progress=progress, extra_meta=extra)


def _categories(model_name: str) -> list | None:
    """ImageNet class names from torchvision's weight metadata (shipped in the package, no download)."""
    try:
        return list(torchvision.models.get_model_weights(model_name).DEFAULT.meta["categories"])
    except Exception:  # models without torchvision weights: print class indices
        return None
