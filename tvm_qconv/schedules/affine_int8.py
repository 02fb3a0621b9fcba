"""int8 per-channel affine in any activation layout: an inference BatchNorm that no conv absorbs
(DenseNet's pre-activation BN -> ReLU -> conv, on the output of a concat in whichever layout
the dense block runs), with its ReLU / clip.  Integer-only like every epilogue, in 32 bits:

    y = a[c] * x + b[c]          (a = gamma / sqrt(var + eps), b = beta - mean * a)
    q_y = clamp(((q_x * mult[c] + bias[c] + 2**(shift[c] - 1)) >> shift[c]) + z_y, lo, hi)

with ``mult[c] * 2**-shift[c] = a[c] * s_x / s_y`` (signed: a BatchNorm's gamma may be negative; 15
bits) and ``bias[c] = round(b[c] / s_y * 2**shift[c])`` less the input's zero point times ``mult``,
every term of the sum fitting int32 (``requantize.affine_params`` says why).  Why 32 bits: with the
conv epilogue's 64-bit form (a 31-bit multiplier, a 64-bit bias) DenseNet-121's affines ran at
0.30 TB/s on an H100, 4.36 of its 9.04 ms at batch 64 (``docs/performance.md``): a 64-bit multiply,
add and variable shift per byte.  The per-channel vectors are flat, over the layout's padded
channels, indexed by the logical channel (the layout's index map).  Memory-bound; on CUDA the
vectorized elementwise schedule (``elementwise_int8.py``).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout
from .requantize import QMIN


def affine_int8(layout: Layout, shape: tuple[int, ...], act_min: int = QMIN, act_max: int = 127, out_zero: int = 0,
                inputs: tuple[int, ...] = ()):
    """Kernel: int8 X of packed ``shape`` in ``layout``, Mult/Shift/Bias int32 [C_p] (C_p: the padded
    channel count) -> int8 in ``layout``; ``out_zero``: the output's zero point (an input's folds
    into Bias: ``requantize.affine_params``).

    ``inputs``: the real channel counts of several int8 tensors X0, X1, ... whose concatenation the
    affine normalizes (DenseNet's BatchNorm of a concat that nothing else reads): each output channel
    reads its input's byte where it lies (the per-channel parameters hold each input's own scale and
    zero point), so the concatenation is never written."""
    channels = layout.logical_shape(shape)[1]
    n, _, h, w = layout.logical_shape(shape)
    if inputs:
        xs = [te.placeholder(layout.packed_shape((n, c, h, w)), "int8", name=f"X{i}") for i, c in enumerate(inputs)]
        offsets = np.cumsum([0, *inputs]).tolist()
    else:
        xs = [te.placeholder(shape, "int8", name="X")]
    mult = te.placeholder((channels,), "int32", name="Mult")
    shift = te.placeholder((channels,), "int32", name="Shift")
    bias = te.placeholder((channels,), "int32", name="Bias")

    def read(index):
        if not inputs:
            return xs[0][index].astype("int32")
        b, c, y, x = layout.to_logical(index)
        value = tirx.const(0, "int32")
        for i in reversed(range(len(xs))):
            local = tirx.max(tirx.min(c - offsets[i], inputs[i] - 1), 0)
            value = tirx.if_then_else(c < offsets[i + 1], xs[i][layout.to_packed(b, local, y, x)].astype("int32"),
                                      value)
        return value

    def body(*index):
        c = layout.to_logical(index)[1]
        s = shift[c]
        v = read(index) * mult[c] + bias[c] + tirx.shift_left(tirx.const(1, "int32"), s - 1)
        v = tirx.shift_right(v, s) + tirx.const(out_zero, "int32")
        return tirx.max(tirx.min(v, tirx.const(act_max, "int32")), tirx.const(act_min, "int32")).astype("int8")

    out = te.compute(shape, body, name="affine")
    return te.create_prim_func([*xs, mult, shift, bias, out]).with_attr(
        {"tvm_qconv.kernel": f"affine_{layout.name.lower()}_int8"})


def affine_int8_ref(layout: Layout, xs, mult, shift, bias, act_min=QMIN, act_max=127, out_zero: int = 0,
                    inputs: tuple[int, ...] = ()) -> np.ndarray:
    """NumPy twin of :func:`affine_int8` (packed in, packed out), in int64 (the kernel's int32 never
    overflows); ``xs``: one packed array, or one per entry of ``inputs``."""
    if inputs:
        logical = np.concatenate([layout.unpack(x, c) for x, c in zip(xs, inputs)], axis=1).astype(np.int64)
        padded = layout.logical_shape(layout.packed_shape(logical.shape))[1]
        logical = np.pad(logical, ((0, 0), (0, padded - logical.shape[1]), (0, 0), (0, 0)))
    else:
        logical = layout.unpack(xs, layout.logical_shape(xs.shape)[1]).astype(np.int64)
    per_channel = (slice(None), None, None)  # [C_p] -> [C_p, 1, 1]
    s = shift.astype(np.int64)[per_channel]
    v = logical * mult.astype(np.int64)[per_channel] + bias.astype(np.int64)[per_channel] + (np.int64(1) << (s - 1))
    y = (v >> s) + out_zero
    return layout.pack(np.clip(y, act_min, act_max).astype(np.int8))


def pack_affine(layout: Layout, shape: tuple[int, ...], mult, shift, bias) -> list[np.ndarray]:
    """The kernel's per-channel arguments over the padded channels of packed ``shape`` (padded
    channels: multiplier 0, shift 1, bias 0, so they stay 0)."""
    channels = layout.logical_shape(shape)[1]

    def pad(v, fill, dtype):
        out = np.full(channels, fill, dtype)
        out[:len(v)] = v
        return out
    return [pad(mult, 0, np.int32), pad(shift, 1, np.int32), pad(bias, 0, np.int32)]
