"""compile_model: a float model in, a deployable int8 library out; compile_checkpoint: a QAT
checkpoint in, the same library out with the learned ranges instead of calibration.

    the build pipeline (pipeline.py: prepare .. compile, verify) --> model.so + model.params.npz + model.json
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torchvision
import tvm

from . import pipeline, registry
from . import verify as verify_mod
from .runtime.artifact import ARTIFACT_VERSION, save_artifact, unverified_path
from .config import QuantConfig
from .errors import InputError
from .fileio import check_output_file
from .graph import static_shape
from .pipeline import BuildState
from .progress import as_phases
from .config import AccuracyTarget
from .mixed_precision import Judge, judge_images, reach
from .ranges.equalize import EqualizedGraphs
from .ranges.sources import HELD_OUT, Calibrate, GivenRanges, LearnedRanges, RangeSource
from .target import TargetInfo, make_target
from .training.checkpoint import DIGITS_CLASSES, load_float_model
from .tuning.database import database_target


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
        debug_dump: a folder to write the IR into after each step of the pipeline (``NN_<step>.py``:
            02_export.py ... 12_schedule.py; ``pipeline.STEPS``).
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
        mixed_precision: ``"30"`` (dB) or ``"top1:99"`` (%): keep the fewest conv / linear layers
            in float until the library reaches this on images held out from calibration (logits
            SQNR against the float model, or top-1 agreement with it on ``accuracy_data``;
            ``mixed_precision.py``); None: every layer that can is int8.  A target not reached
            builds the closest library, and the report's ``mixed_precision.reached`` says so.
        accuracy_data, accuracy_labels: the image folder (and its labels file, as ``eval --data``
            reads them) the target is measured on; default: the calibration's held-out images.
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
    mixed_precision: str | None = None
    accuracy_data: str | None = None
    accuracy_labels: str | None = None
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
        # what `deploy.py build` refuses, refused here too: options a build would ignore in silence
        if self.accuracy_target_db is not None and not self.verify:
            raise InputError("accuracy_target_db measures the verification that verify=False turns off; drop one")
        if self.mixed_precision is not None:
            goal = AccuracyTarget.parse(self.mixed_precision)
            if not self.verify:
                raise InputError("an accuracy target is measured on the built library: it needs the verification "
                                 "(drop --no-verify)")
            if goal.metric == "top1_agreement" and self.accuracy_data is None:
                raise InputError(f"--accuracy-target {self.mixed_precision} is top-1 agreement on a labelled folder: "
                                 "give it with --data DIR")
        if self.accuracy_labels is not None and self.accuracy_data is None:
            raise InputError("--labels names the labels of --data DIR: give the folder too")
        cuda_only = [name for name, v in (("arch", self.arch), ("cuda_graph", self.cuda_graph)) if v]
        if self.target != "cuda" and cuda_only:
            raise InputError(f"{' and '.join(cuda_only)} {'are' if len(cuda_only) > 1 else 'is'} for target='cuda'; "
                             f"this build is for {self.target!r}: leave {'them' if len(cuda_only) > 1 else 'it'} out")
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
        """CUDA graphs exist for CUDA builds only (``cuda_graph`` is refused on llvm)."""
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

    def state(**changes) -> BuildState:
        return dataclasses.replace(BuildState(
            model, options.input_shape, TargetInfo.from_target(tgt), config=config, ranges=ranges, target=tgt,
            name=name, choices=options.kernels, families=options.families, tuning_log=options.tuning_log,
            ignore_stale=options.ignore_stale, cuda_graph=options.uses_cuda_graph,
            expose_activations=options.expose_activations, debug_dump=options.debug_dump,
            require_int8=options.require_int8, check_input=True, verify=options.verify,
            verify_floor_db=options.verify_floor_db, accuracy_target_db=options.accuracy_target_db, phases=phases),
            **changes)

    if options.mixed_precision is not None and options.accuracy_data is None and \
            (ranges is None or isinstance(ranges, Calibrate)):
        # the target is measured on images calibration did not see: hold some out of the source
        ranges = dataclasses.replace(ranges or Calibrate(), hold_out=HELD_OUT)
    s = pipeline.run(state())
    scheme = s.config
    if options.mixed_precision is not None:
        s = _reach(s, options, state)
    name, report, params = s.name, s.report, s.params
    meta = dict(version=ARTIFACT_VERSION, tvm_version=tvm.__version__, model=name, input_shape=list(options.input_shape),
                target=str(tgt.kind.name), arch=str(tgt.attrs["arch"]) if "arch" in tgt.attrs else None,
                config=dataclasses.replace(scheme, skip=s.config.skip).to_dict(), amax=s.amax,
                param_names=[n for n, _ in params],
                report=report, built=time.strftime("%Y-%m-%d %H:%M:%S"), categories=_categories(name),
                cuda_graph=options.uses_cuda_graph, options=asdict(options),
                float_weights=s.float_exported.frontend.digest(), output_shape=output_shape(s.mod))
    meta.update(extra_meta or {})
    if report.get("verify", {}).get("status") == "failed":
        out_path = unverified_path(out_path)
    with phases("save", out_path):
        meta["build_seconds"] = _seconds(phases)
        save_artifact(s.executable, params, meta, out_path)
    return BuildResult(out_path, report, meta)


def _reach(s: BuildState, options: BuildOptions, state) -> BuildState:
    """The build of ``s``'s model that reaches ``options.mixed_precision`` with the fewest layers
    kept float (``mixed_precision.reach``), its report's ``mixed_precision`` entry added."""
    goal = AccuracyTarget.parse(options.mixed_precision)
    reason = verify_mod.cannot_run(s.target)
    if reason:
        raise InputError(f"--accuracy-target measures the library on this machine, and {reason}: build on the GPU "
                         "it runs on, or for --target llvm")
    if s.context.images is None:
        raise InputError(f"--accuracy-target chooses the layers to keep on the calibration images; these ranges come "
                         f"from {s.ranges_report.get('source')}: calibrate (drop --checkpoint / given ranges)")
    images, where = judge_images(s, options.accuracy_data, options.accuracy_labels)
    judge = Judge(s.float_exported.frontend, images, where)
    factors = s.context.equalization or None
    base = s.exported.base if isinstance(s.exported, EqualizedGraphs) else s.exported

    def rebuild(skip, reasons):
        # the same ranges, export and weights (GPTQ's, rounded once: taken as they are on their grid)
        config = dataclasses.replace(s.config, skip=tuple(dict.fromkeys((*s.config.skip, *skip))),
                                     weight_rounding="nearest")
        return pipeline.run(state(model=s.model, config=config, exported=base, float_reasons=reasons,
                                  ranges=GivenRanges(s.amax, s.context.channel_means, factors),
                                  accuracy_target_db=None, require_int8=False))

    with s.phases("accuracy target", f"{goal.describe()} on {len(images)} images of {where}"):
        best, entry = reach(s, goal, judge, rebuild, progress=s.phases.say)
    best.report = dict(best.report, mixed_precision=entry)
    return best


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
