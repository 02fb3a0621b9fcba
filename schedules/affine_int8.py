"""int8 per-channel affine in any activation layout: an inference BatchNorm that no conv absorbs
(DenseNet's pre-activation BN -> ReLU -> conv, on the output of a concat in whichever layout
the dense block runs), with its ReLU / clip.  Integer-only like every epilogue:

    y = a[c] * x + b[c]          (a = gamma / sqrt(var + eps), b = beta - mean * a)
    q_y = clamp((q_x * mult[c] + bias[c] + 2**(shift[c] - 1)) >> shift[c], lo, hi)

with ``mult[c] * 2**-shift[c] = a[c] * s_x / s_y`` (signed: a BatchNorm's gamma may be negative)
and ``bias[c] = round(b[c] / s_y * 2**shift[c])`` in int64 (``requantize.affine_params``).  The
per-channel vectors are flat, over the layout's padded channels, indexed by the logical channel
(the layout's index map).  Memory-bound; on CUDA the vectorized elementwise schedule (``elementwise_int8.py``).
"""
from __future__ import annotations

import numpy as np
from tvm import te

from .kernel import Layout
from .requantize import QMIN, requantize_ref, requantize_tir


def affine_int8(layout: Layout, shape: tuple[int, ...], act_min: int = QMIN, act_max: int = 127, out_zero: int = 0):
    """Kernel: int8 X of packed ``shape`` in ``layout``, Mult/Shift int32 [C_p], Bias int64 [C_p]
    (C_p: the padded channel count) -> int8 in ``layout``; ``out_zero``: the output's zero point
    (an input's folds into Bias: ``requantize.affine_params``)."""
    channels = layout.logical_shape(shape)[1]
    x = te.placeholder(shape, "int8", name="X")
    mult = te.placeholder((channels,), "int32", name="Mult")
    shift = te.placeholder((channels,), "int32", name="Shift")
    bias = te.placeholder((channels,), "int64", name="Bias")

    def body(*index):  # the conv epilogue's arithmetic, the bias added at the product's scale
        c = layout.to_logical(index)[1]
        return requantize_tir(x[index], mult[c], shift[c], act_min, act_max, offset=bias[c], zero=out_zero)

    out = te.compute(shape, body, name="affine")
    return te.create_prim_func([x, mult, shift, bias, out]).with_attr(
        {"tvm_qconv.kernel": f"affine_{layout.name.lower()}_int8"})


def affine_int8_ref(layout: Layout, x, mult, shift, bias, act_min=QMIN, act_max=127, out_zero: int = 0) -> np.ndarray:
    """NumPy twin of :func:`affine_int8` (packed in, packed out)."""
    logical = layout.unpack(x, layout.logical_shape(x.shape)[1])
    per_channel = (slice(None), None, None)  # [C_p] -> [C_p, 1, 1]
    y = requantize_ref(logical, mult[per_channel], shift[per_channel], act_min, act_max, offset=bias[per_channel],
                       zero=out_zero)
    return layout.pack(y.astype(np.int8))


def pack_affine(layout: Layout, shape: tuple[int, ...], mult, shift, bias) -> list[np.ndarray]:
    """The kernel's per-channel arguments over the padded channels of packed ``shape`` (padded
    channels: multiplier 0, shift 1, bias 0, so they stay 0)."""
    channels = layout.logical_shape(shape)[1]

    def pad(v, fill, dtype):
        out = np.full(channels, fill, dtype)
        out[:len(v)] = v
        return out
    return [pad(mult, 0, np.int32), pad(shift, 1, np.int32), pad(bias, 0, np.int64)]
