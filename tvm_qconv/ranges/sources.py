"""Range sources: where the int8 scale of every activation comes from.

A build takes exactly one of them (``compile_model(..., ranges=...)``), and the report records
which one it was:

- :class:`Calibrate`: run the float model over real images and observe each tensor
  (``QuantConfig.calibration`` picks the observer, or ``search`` picks one per tensor:
  ``range_search.py``); the default.
- :class:`GivenRanges`: ranges by point name (``features.0.out``), e.g. a previous build's.
- :class:`LearnedRanges`: a QAT checkpoint's learned ranges by layer (``features.0.in0``),
  mapped onto the points the compiled graph quantizes (:func:`map_learned_ranges`).

Each has ``resolve(ctx) -> (amax by point, report entry)``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tvm import relax

from . import search as range_search
from ..quantization.zero_points import planned_unsigned_names
from .calibrate import calibrate_candidates
from ..config import OBSERVERS, QuantConfig
from ..data import load_calibration_images
from ..errors import InputError
from ..graph import Graph

HELD_OUT = 4  # calibration-source images set aside for the build's verification, where there are more
HELD_OUT_MIN = 2  # fewer spare images than this: the verification runs on calibration images


@dataclass
class RangeContext:
    """What a range source may use: the float graph at the build shape, and a way to get it at
    batch 1 (calibration runs one image at a time whatever the build's batch)."""

    graph: Graph
    input_shape: tuple[int, int, int, int]
    config: QuantConfig
    graph_at_batch1: Callable[[], Graph]
    progress: bool = True
    images: np.ndarray | None = None  # set by a source that calibrated: the images it used
    channel_means: dict | None = None  # set by calibration: {point: mean per channel} (bias correction)
    channel_amax: dict | None = None   # set by calibration: {point: max |x| per channel} (equalization)
    equalization: dict | None = None   # the factors of equalized pairs (ranges/equalize.py): given, or the build's
    held_out: np.ndarray | None = None  # set by calibration: images of the source it did not use


@dataclass(frozen=True)
class Calibrate:
    """Calibrate on real images: ``images`` (float32 [N, 3, H, W], preprocessed), else the
    image files of ``calib_dir`` (``data.IMAGE_SUFFIXES``; an unreadable one is left out, named
    in a warning and in the report's ``skipped``), else scikit-image's bundled photos.

    The first ``QuantConfig.num_calib_images`` calibrate; up to :data:`HELD_OUT` more, where the
    source has them, are held out for the build's verification (``RangeContext.held_out``); with
    ``hold_out``, at least that many are, fewer calibrating where the source is short (an accuracy
    target is measured on them: ``BuildOptions.mixed_precision``)."""

    images: np.ndarray | None = field(default=None, compare=False)
    calib_dir: str | None = None
    hold_out: int = 0   # hold out at least this many of the source's images (fewer calibrate) where it can
    count_check: bool = True    # False: the ranges only have to exist (the tuner's: kernels depend on shapes only)

    def resolve(self, ctx: RangeContext) -> tuple[dict, dict]:
        cfg = ctx.config
        images = self.images
        skipped: list = []
        if images is None:  # up to HELD_OUT more than calibration takes, to verify on
            images = load_calibration_images(self.calib_dir, ctx.input_shape[2], limit=cfg.num_calib_images + HELD_OUT,
                                             skipped=skipped)
        if len(images) == 0 or np.asarray(images).ndim != 4:
            raise InputError(f"calibration needs images of shape [N, 3, H, W] with N >= 1, got shape "
                             f"{tuple(np.shape(images))}: pass real, preprocessed images (or a folder)")
        available = len(images)
        count = cfg.num_calib_images
        if self.hold_out and available - count < self.hold_out:     # (an accuracy target is measured on them)
            count = max(1, available - self.hold_out)
        images, held_out = images[:count], images[count:][:max(HELD_OUT, self.hold_out)]
        where = self.calib_dir or ("the caller's array" if self.images is not None else "scikit-image's photos")
        too_few = check_count(len(images), cfg, where) if self.count_check else None
        if len(held_out) < HELD_OUT_MIN:  # one image cannot tell a model that ignores its input
            held_out = held_out[:0]
        graph = ctx.graph_at_batch1()
        report = dict(source="calibration", calibration=cfg.calibration, images=len(images), available=available,
                      up_to=cfg.num_calib_images, held_out=len(held_out), images_from=where)
        if too_few:
            report["too_few"] = too_few
        if skipped:
            report["skipped"] = [dict(file=f, why=why) for f, why in skipped]
        methods = OBSERVERS if cfg.calibration == "search" else (cfg.calibration,)
        candidates, ctx.channel_means, ctx.channel_amax = calibrate_candidates(graph, images, cfg, methods,
                                                                                progress=ctx.progress)
        if cfg.calibration == "search":
            unsigned = planned_unsigned_names(graph, cfg)  # rounded as the build will
            amax, report["search"] = range_search.search(graph, images, candidates, progress=ctx.progress,
                                                         unsigned=unsigned)
        else:
            amax = {n: c[cfg.calibration] for n, c in candidates.items()}
        ctx.images = images
        ctx.held_out = held_out if len(held_out) else None
        if cfg.calibration in ("percentile", "search"):
            report["percentile"] = cfg.percentile
        return amax, report


def check_count(count: int, config: QuantConfig, where: str) -> str | None:
    """Refuse fewer calibration images than the scheme needs; say so (a warning, and the returned
    line for the report) where there are fewer than it should have (``QuantConfig.calibration_images``).

    Raises:
        InputError: naming the count, the number needed and what needs it.
    """
    needed, recommended, by = config.calibration_images()
    if count < needed:
        raise InputError(f"{by} needs at least {needed} calibration images, {where} gave {count}: add images "
                         f"(--calib-dir with {recommended} or more), raise --num-calib, or choose a simpler method")
    if count >= recommended:
        return None
    line = (f"calibrating on {count} images of {where}: {by} should have {recommended} or more (its ranges are "
            "those of these few photos); give more with --calib-dir or --num-calib")
    warnings.warn(line, stacklevel=3)
    return line


@dataclass(frozen=True)
class GivenRanges:
    """Ranges by point name (``{"features.0.out": amax, ...}``), used as they are; with
    ``channel_means`` (a calibration's :attr:`RangeContext.channel_means`), bias correction can
    use them too (the verification's twin of a build with bias correction); with
    ``equalization`` (a calibration's :attr:`RangeContext.equalization`), the ranges are those of
    the graph equalized with these factors, which the build applies as they are."""

    amax: dict
    channel_means: dict | None = None
    equalization: dict | None = None

    def resolve(self, ctx: RangeContext) -> tuple[dict, dict]:
        if self.channel_means is not None:
            ctx.channel_means = self.channel_means
        if self.equalization is not None:
            ctx.equalization = self.equalization
        return dict(self.amax), dict(source="given")


@dataclass(frozen=True)
class LearnedRanges:
    """A QAT checkpoint's ranges by layer (``{"features.0.in0": amax, ...}``); ``source``
    names them in errors and in the report."""

    learned: dict
    source: str = "the checkpoint"

    def resolve(self, ctx: RangeContext) -> tuple[dict, dict]:
        amax, used = map_learned_ranges(ctx.graph, self.learned, self.source)
        return amax, dict(source="checkpoint", checkpoint=self.source, calibrated=False, points=used)


RangeSource = Calibrate | GivenRanges | LearnedRanges


def calibrates(source) -> bool:
    """Whether ``source`` calibrates on images (:class:`Calibrate`, or a wrapper of one with
    ``inner``): where ``QuantConfig``'s default scheme turns unsigned activations and bias
    correction on (``QuantConfig.resolved``)."""
    return isinstance(getattr(source, "inner", source), Calibrate)


def describe(source, config: QuantConfig) -> str:
    """What a range source will do, in a few words (the build's progress line)."""
    source = getattr(source, "inner", source)  # a wrapper (onnx_export's check-first source)
    if isinstance(source, Calibrate):
        how = config.calibration + (f" {config.percentile}" if config.calibration in ("percentile", "search") else "")
        where = source.calib_dir or ("the given images" if source.images is not None else "scikit-image's photos")
        return f"calibrate ({how}) on up to {config.num_calib_images} images of {where}"
    if isinstance(source, LearnedRanges):
        return f"learned in QAT, from {source.source}"
    if hasattr(source, "describe"):     # onnx_qdq.FileScales
        return source.describe()
    return "given by the caller"


# Ops between two int8 layers that commute with per-tensor quantization at one scale: a max-pool
# keeps its int8 input's scale, a reshape or a permute of a dequantized tensor requantized at the
# same scale gives back the same integers, and so does a channel split's piece (graph.py's
# channel gathers keep their input's scale).  The QAT input quantizer after them is the tensor's scale.
_SCALE_PRESERVING = ("relax.nn.max_pool2d", "relax.reshape", "relax.permute_dims")


def _scale_source(x, producer: dict):
    """The tensor whose scale ``x`` is quantized at: back through ``_SCALE_PRESERVING`` ops and
    split pieces (``TupleGetItem`` of a ``split``)."""
    while True:
        value = producer.get(x)
        if isinstance(value, relax.TupleGetItem) and \
                getattr(getattr(producer.get(value.tuple_value), "op", None), "name", None) == "relax.split":
            x = producer[value.tuple_value].args[0]
        elif getattr(getattr(value, "op", None), "name", None) in _SCALE_PRESERVING:
            x = value.args[0]
        else:
            return x


def map_learned_ranges(graph: Graph, learned: dict[str, float], source: str = "the checkpoint") -> tuple[dict, dict]:
    """The range of every calibration point of ``graph``, taken from QAT's learned ranges.

    QAT quantizes a tensor where it is *consumed*: layer ``L``'s input quantizer uses the learned
    ``L.in0``; a layer's recorded output range ``L.out`` scales nothing.  The compiled model
    instead requantizes each int8 layer's output in its epilogue, at the scale of the point
    ``L.out``.  For the two to compute the same integers, a point takes the ``.in0`` range of the
    layer that consumes it, following max-pools, reshapes, permutes and split pieces
    (:func:`_scale_source`); a point
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
    producer = graph.value
    used = {point: point for point in graph.points.values()}
    for ly in graph.layers:
        if ly.kind not in ("conv2d", "dense"):
            continue
        x = _scale_source(ly.inputs[0], producer)
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
