"""The quantization scheme: a frozen, validated, versioned dataclass stored in every artifact."""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import asdict, dataclass, field

from .errors import InputError

# 2: the activation layout left the scheme; it is the chosen kernel's (tvm_qconv/registry.py).
CONFIG_VERSION = 2
OBSERVERS = ("max", "percentile", "entropy", "mse")
DEFAULT_PERCENTILE = 99.99   # of |x|: the percentile observer's cut unless QuantConfig.percentile says otherwise
# "search": per tensor, the observer whose range gives the logits closest to float (ranges/search.py)
CALIBRATIONS = (*OBSERVERS, "search")
# How int8 weights are rounded: to nearest, or by GPTQ on the calibration images (ranges/weight_rounding.py)
WEIGHT_ROUNDINGS = ("nearest", "gptq")
# Calibration images each method needs (fewer: refused, naming the number) and should have (fewer:
# a warning).  An observer sees every pixel of every image, and one image already has ~10^5 values
# per tensor, but a few photos show few of the inputs a deployed model meets: its ranges and means
# are then those of those photos.  Methods that fit something to the images need more: ``search``
# chooses each tensor's range by the logits on them (fewer than 4 and it fits their noise), GPTQ
# solves each layer's least squares on their activations (its late layers see 7 x 7 = 49 rows per
# image against up to ~1,000 columns: under 4 images the problem is mostly its damping).  Not
# measured per count yet: the floors are where the method stops being what it says.
CALIBRATION_IMAGES = {"max": (1, 8), "percentile": (1, 8), "entropy": (1, 8), "mse": (1, 8),
                      "search": (4, 12), "gptq": (4, 12)}


# What `deploy.py build` calls accurate enough: logits SQNR against the float model.  Under it,
# the build report names the layers that lose the most (BuildOptions.accuracy_target_db).
ACCURACY_TARGET_DB = 30.0


@dataclass(frozen=True)
class QuantConfig:
    """How a float model becomes int8.

    Attributes:
        calibration: activation range observer: ``max``, ``percentile``, ``entropy`` (KL) or
            ``mse`` (least squared error of the int8 tensor); or ``search``: per tensor, the
            one of those four whose range gives logits closest to the float model's
            (``ranges/search.py``; slower: ~2 forwards of the calibration images per tensor).
        percentile: the percentile of |x| used when ``calibration == "percentile"``.
        weight: weight granularity; only ``per_channel`` (symmetric, per output channel).
        activation: activation granularity; only ``per_tensor`` (symmetric, or unsigned where
            ``unsigned_activations`` allows).
        skip: layers kept in float: torch module paths (``classifier.6``) or shell-style
            patterns (``classifier.*``; ``*`` keeps every layer in float).
        quantize_dense: run linear layers in int8 (else every linear layer stays float).
        num_calib_images: at most this many calibration images are used.
        bias_correction: subtract from each conv / linear layer's bias the mean error its int8
            weights add to its output, ``(W_q - W) E[x]`` with ``E[x]`` the input's per-channel
            mean on the calibration images (Nagel et al., "Data-Free Quantization", 2019;
            needs calibration, not given or learned ranges).  None (the default): on where the
            build calibrates and rounds weights to nearest (GPTQ already corrects the mean).
        unsigned_activations: store a never-negative int8 tensor (after a ReLU / ReLU6) as
            0..255 at scale ``amax / 255``, zero point -128, where every layer reading it can
            take that (``zero_points.py``): half the rounding step there.  Off: every tensor is
            symmetric (``amax / 127``), as QAT's fake quantizers train for.  None (the default):
            on where the build calibrates; off for ranges given, learned in QAT or read from a
            Q/DQ file (what those were made with).
        equalization: before int8, widen the narrow channels of an activation that one conv writes
            and one conv reads (multiplying the writer's weight rows and bias, dividing the
            reader's weight columns: the float model is unchanged) so that one per-tensor scale
            fits them all (``ranges/equalize.py``; needs calibration).  Off by default: on the
            trained ReLU6 networks measured (MobileNet-V2, EfficientNet-Lite0) it lost 0.3-0.5 dB
            held out, as a ReLU6 lets a channel widen only where its input's bound proves the clip
            is never reached (``docs/performance.md``, "Which scheme").
        weight_rounding: ``nearest``, or ``gptq``: each int8 conv / linear layer's weights
            rounded column by column so that its output on the calibration images moves least
            (``ranges/weight_rounding.py``; the same per-channel grid; needs calibration images).

    The two defaults of None are the scheme measured best on trained networks held out from
    calibration (issue 58; ``docs/performance.md``, "Which scheme"); :meth:`resolved` turns them
    into what a build does, recorded in its json.
    """

    calibration: str = "percentile"
    percentile: float = DEFAULT_PERCENTILE
    weight: str = "per_channel"
    activation: str = "per_tensor"
    skip: tuple[str, ...] = field(default_factory=tuple)
    quantize_dense: bool = True
    num_calib_images: int = 32
    bias_correction: bool | None = None         # None: on where calibrated, rounding to nearest
    unsigned_activations: bool | None = None    # None: on where calibrated
    weight_rounding: str = "nearest"
    equalization: bool = False
    version: int = CONFIG_VERSION

    def __post_init__(self):
        object.__setattr__(self, "skip", tuple(self.skip))
        checks = [
            (self.calibration in CALIBRATIONS, f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}"),
            (50.0 < self.percentile <= 100.0, f"percentile must be in (50, 100], got {self.percentile}"),
            # the CLI's --percentile without --calibration percentile, in the API's terms ("search" tries
            # the percentile observer among the others, at this cut)
            (self.percentile == DEFAULT_PERCENTILE or self.calibration in ("percentile", "search"),
             f"percentile={self.percentile} sets the percentile observer's cut, and calibration="
             f"{self.calibration!r} does not use it: leave percentile out, or set calibration='percentile'"),
            (self.weight == "per_channel", f"weight granularity must be 'per_channel', got {self.weight!r}"),
            (self.activation == "per_tensor", f"activation granularity must be 'per_tensor', got {self.activation!r}"),
            (self.num_calib_images >= 1, f"num_calib_images must be >= 1, got {self.num_calib_images}"),
            (self.unsigned_activations in (None, True, False),
             f"unsigned_activations must be True, False or None (where calibrated), got {self.unsigned_activations!r}"),
            (self.bias_correction in (None, True, False),
             f"bias_correction must be True, False or None (where calibrated), got {self.bias_correction!r}"),
            (self.weight_rounding in WEIGHT_ROUNDINGS,
             f"weight_rounding must be one of {WEIGHT_ROUNDINGS}, got {self.weight_rounding!r}"),
            (self.equalization in (True, False), f"equalization must be True or False, got {self.equalization!r}"),
            (not (self.equalization and self.weight_rounding == "gptq"),
             "equalization and weight_rounding='gptq' cannot be combined yet: GPTQ rounds the model's own weights, "
             "which equalization would rescale off their grid; choose one"),
            (not (self.bias_correction and self.weight_rounding == "gptq"),
             "bias_correction and weight_rounding='gptq' are alternatives: GPTQ already minimizes the layer's whole "
             "output error on the calibration images, mean included; choose one"),
            (self.version == CONFIG_VERSION, f"config version {self.version} is not {CONFIG_VERSION}: rebuild"),
            (all(isinstance(p, str) and p for p in self.skip), f"skip entries must be non-empty strings, got {self.skip}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"QuantConfig: {msg}")

    def resolved(self, calibrated: bool) -> "QuantConfig":
        """This scheme with its defaults decided: unsigned activations and bias correction on where
        the build calibrates (``calibrated``; bias correction only with nearest rounding), off where
        the ranges were given, learned or read from a file.  A value set by the caller stays."""
        return dataclasses.replace(
            self,
            unsigned_activations=calibrated if self.unsigned_activations is None else self.unsigned_activations,
            bias_correction=(calibrated and self.weight_rounding == "nearest") if self.bias_correction is None
            else self.bias_correction)

    def calibration_images(self) -> tuple[int, int, str]:
        """``(needed, recommended, by what)``: the calibration images this scheme needs at least and
        should have (:data:`CALIBRATION_IMAGES`), the most demanding of its observer and its rounding."""
        methods = [self.calibration] + (["gptq"] if self.weight_rounding == "gptq" else [])
        need = max(methods, key=lambda m: CALIBRATION_IMAGES[m])
        needed, recommended = CALIBRATION_IMAGES[need]
        return needed, recommended, ("GPTQ weight rounding" if need == "gptq" else f"calibration={need!r}")

    def skips(self, layer: str) -> bool:
        """Whether ``layer`` (a torch module path) is kept in float by ``skip``."""
        return any(fnmatch.fnmatchcase(layer, pattern) for pattern in self.skip)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        d = dict(d)
        if d.get("version") == 1:  # version 1 had a fixed layout field, always NCHW4c
            d.pop("layout", None)
            d["version"] = CONFIG_VERSION
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"QuantConfig: unknown keys {sorted(unknown)}")
        return cls(**d)


# Named presets: the keys are deploy.py's --scheme choices.
PRESETS = {
    "int8": QuantConfig(),
    "int8-max": QuantConfig(calibration="max"),
    "int8-entropy": QuantConfig(calibration="entropy"),
    "int8-mse": QuantConfig(calibration="mse"),
    "int8-search": QuantConfig(calibration="search"),
    "int8-float-head": QuantConfig(quantize_dense=False),
}


@dataclass(frozen=True)
class AccuracyTarget:
    """``--accuracy-target``: ``30`` (logits SQNR against the float model, dB, on images held out
    from calibration) or ``top1:99`` (top-1 agreement with the float model, %, on a labelled
    folder: ``--data``)."""

    metric: str      # "sqnr_db" | "top1_agreement"
    value: float

    @classmethod
    def parse(cls, text: str) -> "AccuracyTarget":
        text = str(text).strip()
        try:
            if text.lower().startswith("top1:"):
                value = float(text[5:])
                if not 0 < value <= 100:
                    raise ValueError
                return cls("top1_agreement", value)
            value = float(text)
            if not value > 0 or not math.isfinite(value):
                raise ValueError
            return cls("sqnr_db", value)
        except ValueError:
            raise InputError(f"--accuracy-target {text!r}: give a logits SQNR in dB (e.g. 30) or top1:PCT (e.g. "
                             "top1:99, agreement with the float model on --data)") from None

    def describe(self) -> str:
        return f"{self.value:g} dB logits SQNR" if self.metric == "sqnr_db" else f"top-1 agreement {self.value:g} %"

    def reached(self, score: dict) -> bool:
        return score[self.metric] >= self.value
