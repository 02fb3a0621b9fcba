"""int8 channel concatenation in NCHW4c (Inception, DenseNet, GoogLeNet, SqueezeNet branches):
each input is requantized from its own scale to the output's (integer-only, as every epilogue)
and placed at its channel offset.  Any channel counts: a branch whose channels are not a
multiple of 4 (ShuffleNet's 58) starts mid-word, so the kernel reads by logical channel.
Memory-bound; dlight schedules it on CUDA."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..requantize import requantize_ref, requantize_tir
from .layout import ceil4, pack_nchw4c, unpack_nchw4c

KERNEL_NAME = "concat_nchw4c_int8"


def concat_nchw4c_int8(shape: tuple[int, int, int], channels: list[int], mults: list[int],
                       shifts: list[int]) -> tirx.PrimFunc:
    """Kernel: inputs int8 NCHW4c (N, ceil4(c_i)/4, H, W, 4) -> output (N, ceil4(sum c_i)/4, H, W, 4).

    Args:
        shape: (N, H, W).
        channels: the real channel count of each input.
        mults, shifts: each input's fixed-point multiplier to the output scale.
    """
    n, h, w = shape
    ins = [te.placeholder((n, ceil4(c) // 4, h, w, 4), "int8", name=f"X{i}") for i, c in enumerate(channels)]
    offsets = np.cumsum([0] + list(channels)).tolist()

    def body(b, ob, y, x, oi):
        c = ob * 4 + oi
        value = tirx.const(0, "int8")  # padded channels of the last word
        for i in reversed(range(len(ins))):
            local = tirx.max(tirx.min(c - offsets[i], channels[i] - 1), 0)
            v = requantize_tir(ins[i][b, local // 4, y, x, local % 4].astype("int64"),
                               tirx.const(mults[i], "int32"), tirx.const(shifts[i], "int32"), -128, 127)
            value = tirx.if_then_else(c < offsets[i + 1], v, value)
        return tirx.if_then_else(c < offsets[-1], value, tirx.const(0, "int8"))

    out = te.compute((n, ceil4(offsets[-1]) // 4, h, w, 4), body, name="concat")
    return te.create_prim_func([*ins, out]).with_attr({"tvm_qconv.kernel": KERNEL_NAME})


def concat_nchw4c_int8_ref(xs: list[np.ndarray], channels: list[int], mults, shifts) -> np.ndarray:
    """NumPy twin of :func:`concat_nchw4c_int8`."""
    parts = [requantize_ref(unpack_nchw4c(x, c).astype(np.int64), np.int64(m), np.int64(s), -128, 127)
             for x, c, m, s in zip(xs, channels, mults, shifts)]
    return pack_nchw4c(np.concatenate(parts, axis=1))
