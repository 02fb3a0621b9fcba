"""int8 per-channel affine in NCHW4c: an inference BatchNorm that no conv absorbs (DenseNet's
pre-activation BN -> ReLU -> conv), with its ReLU / clip.  Integer-only like every epilogue:

    y = a[c] * x + b[c]          (a = gamma / sqrt(var + eps), b = beta - mean * a)
    q_y = clamp((q_x * mult[c] + bias[c] + 2**(shift[c] - 1)) >> shift[c], lo, hi)

with ``mult[c] * 2**-shift[c] = a[c] * s_x / s_y`` (signed: a BatchNorm's gamma may be negative)
and ``bias[c] = round(b[c] / s_y * 2**shift[c])`` in int64.  Memory-bound; dlight on CUDA.
"""
from __future__ import annotations

import numpy as np
from tvm import te

from ..requantize import requantize_ref, requantize_tir
from .conv2d import pack_channels

KERNEL_NAME = "affine_nchw4c_int8"


def affine_nchw4c_int8(shape: tuple[int, ...], act_min: int = -128, act_max: int = 127):
    """Kernel: int8 NCHW4c X, Mult/Shift int32 [C/4, 4], Bias int64 [C/4, 4] -> int8 NCHW4c."""
    x = te.placeholder(shape, "int8", name="X")
    cc = shape[1]
    mult = te.placeholder((cc, 4), "int32", name="Mult")
    shift = te.placeholder((cc, 4), "int32", name="Shift")
    bias = te.placeholder((cc, 4), "int64", name="Bias")

    def body(n, c, y, w, ci):  # the conv epilogue's arithmetic, the bias added at the product's scale
        return requantize_tir(x[n, c, y, w, ci], mult[c, ci], shift[c, ci], act_min, act_max, offset=bias[c, ci])

    out = te.compute(shape, body, name="affine")
    return te.create_prim_func([x, mult, shift, bias, out]).with_attr({"tvm_qconv.kernel": KERNEL_NAME})


def affine_nchw4c_int8_ref(x, mult, shift, bias, act_min=-128, act_max=127) -> np.ndarray:
    """NumPy twin of :func:`affine_nchw4c_int8` (per-channel vectors packed [C/4, 4])."""
    per_channel = (slice(None), None, None, slice(None))  # [C/4, 4] -> [C/4, 1, 1, 4]
    return requantize_ref(x, mult[per_channel], shift[per_channel], act_min, act_max, offset=bias[per_channel])


def pack_affine(mult, shift, bias) -> list[np.ndarray]:
    """The kernel's per-channel arguments packed [C/4, 4] (padded channels: 0, shift 1, 0)."""
    return [pack_channels(mult), pack_channels(shift, fill=1), pack_channels(bias)]
