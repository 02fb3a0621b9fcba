"""The numbers of the scheme: an activation's scale, a fused activation as an int8 clamp, the
mean error int8 weights add (bias correction), a grouped conv's weight as a dense one."""
from __future__ import annotations

import numpy as np

from ..schedules.requantize import QMIN

# Keeps amax / 127 a normal float32.  Not a range limit: int8 is scale-invariant, so a tensor whose
# values are all ~1e-9 (deep random-init networks) is quantized as well as one of ~1.  (It was
# 1e-6, which left such tensors a few int8 levels and made MobileNet's logits noise.)
AMAX_FLOOR = 1e-30


def activation_scale(amax: float, unsigned: bool = False) -> float:
    """The int8 scale of an activation of range ``amax``: ``amax / 127`` (symmetric), or
    ``amax / 255`` for an unsigned tensor (``zero_points.py``), floored at ``AMAX_FLOOR``; a dead
    (all-zero or NaN) tensor gets 1/127, as any positive scale holds it.

    Rounded to float32: the scale a Q/DQ ONNX file, TensorRT or the QAT layers (torch float32) hold,
    so that an exported file carries the library's scale exactly and a library built from that
    file is the same library (``onnx_qdq.py``: a file's ``127 * s`` divided by 127 gives ``s``
    back, exactly)."""
    amax = float(amax)
    if not (np.isfinite(amax) and amax > 0):
        amax = 1.0
    return float(np.float32(max(amax, AMAX_FLOOR) / (255.0 if unsigned else 127.0)))


def int8_clamp(ly, s_y: float, zero: int = 0) -> tuple[str, int, int]:
    """The activation of ``ly`` as an int8 clamp at output scale ``s_y`` and zero point ``zero``:
    (name, lo, hi).

    ``clip(x, lo, hi)`` then quantizing is ``clamp(round(x / s), round(lo / s), round(hi / s))``
    (rounding is monotonic), so ReLU6 costs nothing in the epilogue; a bound beyond the int8
    range is the range's end.  A clamp equal to ReLU's or to none is named so, and its kernel
    is then the one ReLU / no-activation layers share (one tuning task, not two).  An unsigned
    output (``zero`` -128) stores ``round(x / s) - 128``: ReLU is the clamp [-128, 127].
    """
    if not ly.relu:
        return "none", QMIN, 127
    lo, hi = ly.clip or (0.0, float("inf"))
    least = QMIN if zero == 0 else -128
    q_lo = least if not np.isfinite(lo) else int(np.clip(np.round(lo / s_y) + zero, least, 127))
    q_hi = 127 if not np.isfinite(hi) else int(np.clip(np.round(hi / s_y) + zero, least, 127))
    name = {(0, 127): "relu", (QMIN, 127): "none"}.get((q_lo, q_hi), "clip")
    return name, q_lo, q_hi


# The most a conv's float bias may take of its int32 accumulator, ``|bias| / (s_x * s_w)``: the
# rest of 2**31 holds the products (|acc| < 2**30: the kernels' limit on K) and the zero points'
# terms, and a bias within 2**30 keeps CUDA's 32-bit requantize usable (requantize.I32_MAX_BIAS).
BIAS_ACC_LIMIT = 2 ** 29


def bias_weight_scales(bias: np.ndarray, s_x: float, s_w: np.ndarray) -> np.ndarray:
    """The per-output-channel scales a conv's weights are quantized at so that its int32 bias holds
    ``bias``: ``s_w``, or ``|bias| / (s_x * BIAS_ACC_LIMIT)`` where that is larger (float32).

    The kernel adds the bias to its accumulator, at scale ``s_x * s_w``.  An input whose values
    have faded to ~1e-9 of the bias (a deep random-init network's: LR-ASPP's classifier reads
    ~1e-9 and adds a bias of ~0.05) puts it at ~1e12 steps: int32 saturates it, and the multiplier
    ``s_x * s_w / s_y`` (~1e-11) rounds to 0, so the layer wrote zeros where the float output is its
    bias.  A coarser weight step keeps both, and costs little: a weight is off by at most half a
    step, so the products by at most ``K * 127 * s_x * s_w' / 2 = K * 127 / 2**30`` of |bias| (K
    taps; 0.07 of an output step at K = 4608 and a bias of 127 steps), while the products
    themselves are under ``K * 127**2 / 2**29`` of it.  (TFLite's converter raises the weight
    scale for the same reason: ``AdjustWeightsForBiasScale``.)
    """
    need = np.abs(np.asarray(bias, np.float64)) / (float(s_x) * BIAS_ACC_LIMIT)
    return np.maximum(np.asarray(s_w, np.float32), need.astype(np.float32))


def weight_error_mean(weight: np.ndarray, qw: np.ndarray, s_w: np.ndarray, mean: np.ndarray,
                      groups: int = 1) -> np.ndarray:
    """``E[(W_q - W) x]`` per output channel: the mean error int8 weights add to a conv's (4-D
    ``weight``, ``[O, C / groups, kh, kw]``) or a linear layer's (``[O, K]``) output, for an input
    whose per-channel mean is ``mean`` (``[C]``; padding's zeros are not counted).  Subtracted
    from the bias, it is bias correction (``QuantConfig.bias_correction``).  Computed in float64,
    a block of output channels at a time: VGG16's first linear layer whole would be 0.8 GB of
    float64 per temporary (each row's sums are the same either way)."""
    o, cg = weight.shape[:2]
    group_mean = np.asarray(mean, np.float64).reshape(groups, cg)
    scales = np.asarray(s_w, np.float64).reshape((-1,) + (1,) * (weight.ndim - 1))
    out = np.empty(o)
    step = max(1, (1 << 20) // max(1, weight[0].size))     # ~1M elements a block
    for a in range(0, o, step):
        b = min(o, a + step)
        err = qw[a:b].astype(np.float64) * scales[a:b] - weight[a:b].astype(np.float64)
        per_input = err.reshape(b - a, cg, -1).sum(axis=2)   # [rows, C / groups]
        out[a:b] = (per_input * group_mean[np.arange(a, b) // (o // groups)]).sum(axis=1)
    return out


def block_diagonal(weight: np.ndarray, groups: int) -> np.ndarray:
    """A grouped conv's [O, I/G, KH, KW] weight as the equivalent groups=1 weight [O, I, KH, KW]
    (zeros off the diagonal blocks: the same sums, G times the multiply-adds)."""
    o, cg, kh, kw = weight.shape
    og = o // groups
    dense = np.zeros((o, cg * groups, kh, kw), weight.dtype)
    for g in range(groups):
        dense[g * og:(g + 1) * og, g * cg:(g + 1) * cg] = weight[g * og:(g + 1) * og]
    return dense


def activation_suffix(activation: str, act_min: int, act_max: int) -> str:
    """The build report's name of a fused int8 clamp: ``+relu``, nothing, or ``+clip[lo,hi]``."""
    return {"relu": "+relu", "none": ""}.get(activation, f"+clip[{act_min},{act_max}]")
