"""int8 per-channel affine in NCHW4c: an inference BatchNorm that no conv absorbs (DenseNet's
pre-activation BN -> ReLU -> conv), with its ReLU / clip.  Integer-only like every epilogue:

    y = a[c] * x + b[c]          (a = gamma / sqrt(var + eps), b = beta - mean * a)
    q_y = clamp((q_x * mult[c] + bias[c] + 2**(shift[c] - 1)) >> shift[c], lo, hi)

with ``mult[c] * 2**-shift[c] = a[c] * s_x / s_y`` (signed: a BatchNorm's gamma may be negative)
and ``bias[c] = round(b[c] / s_y * 2**shift[c])`` in int64.  Memory-bound; dlight on CUDA.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .conv2d import pack_channels

KERNEL_NAME = "affine_nchw4c_int8"


def affine_nchw4c_int8(shape: tuple[int, ...], act_min: int = -128, act_max: int = 127):
    """Kernel: int8 NCHW4c X, Mult/Shift int32 [C/4, 4], Bias int64 [C/4, 4] -> int8 NCHW4c."""
    x = te.placeholder(shape, "int8", name="X")
    cc = shape[1]
    mult = te.placeholder((cc, 4), "int32", name="Mult")
    shift = te.placeholder((cc, 4), "int32", name="Shift")
    bias = te.placeholder((cc, 4), "int64", name="Bias")

    def body(n, c, y, w, ci):
        s = shift[c, ci].astype("int64")
        v = x[n, c, y, w, ci].astype("int64") * mult[c, ci].astype("int64") + bias[c, ci]
        v = tirx.shift_right(v + tirx.shift_left(tirx.const(1, "int64"), s - 1), s)
        return tirx.max(tirx.min(v, tirx.const(act_max, "int64")), tirx.const(act_min, "int64")).astype("int8")

    out = te.compute(shape, body, name="affine")
    return te.create_prim_func([x, mult, shift, bias, out]).with_attr({"tvm_qconv.kernel": KERNEL_NAME})


def affine_nchw4c_int8_ref(x, mult, shift, bias, act_min=-128, act_max=127) -> np.ndarray:
    """NumPy twin of :func:`affine_nchw4c_int8` (per-channel vectors packed [C/4, 4])."""
    s = shift.astype(np.int64)[None, :, None, None, :]
    v = x.astype(np.int64) * mult.astype(np.int64)[None, :, None, None, :] + bias[None, :, None, None, :]
    return np.clip((v + (np.int64(1) << (s - 1))) >> s, act_min, act_max).astype(np.int8)


def pack_affine(mult, shift, bias) -> list[np.ndarray]:
    """The kernel's per-channel arguments packed [C/4, 4] (padded channels: 0, shift 1, 0)."""
    return [pack_channels(mult), pack_channels(shift, fill=1), pack_channels(bias)]
