"""The int8 max-pool and channel concatenation of the NHWC32 layout, so that a network of
tensor-core convs (VGG's pools, Inception's and SqueezeNet's branches) stays in one layout
between them; the residual add is elementwise (``schedules/add_int8.py``).  Same arithmetic as
the NCHW4c max-pool (``nchw4c/pool.py``) and concat (``nchw4c/concat.py``); memory-bound,
dlight on CUDA."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..nchw4c.pool import max_pool2d_nchw4c_int8_ref, pool_out_size
from ..requantize import requantize_ref, requantize_tir
from .layout import ceil32, pack_nhwc32, unpack_nhwc32


def max_pool2d_nhwc_int8(shape, pool, stride, padding, dilation=(1, 1), ceil_mode=False) -> tirx.PrimFunc:
    """int8 max-pool of an NHWC tensor of packed ``shape``; padding reads as -128."""
    n, h, w, c = shape
    (kh, kw), (sh, sw), (dh, dw) = pool, stride, dilation
    pt, pl = padding[0], padding[1]
    oh, ow = pool_out_size(h, w, pool, stride, padding, dilation, ceil_mode)
    x = te.placeholder(shape, "int8", name="X")
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")

    def val(b, y, xx, cc):
        iy, ix = y * sh + ry * dh - pt, xx * sw + rx * dw - pl
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        return tirx.if_then_else(ok, x[b, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0), cc],
                                 tirx.const(-128, "int8"))

    out = te.compute((n, oh, ow, c), lambda b, y, xx, cc: te.max(val(b, y, xx, cc), axis=[ry, rx]), name="max_pool")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "max_pool2d_nhwc_int8"})


def max_pool2d_nhwc_int8_ref(x: np.ndarray, pool, stride, padding, dilation=(1, 1), ceil_mode=False):
    # NHWC [n, h, w, c] is NCHW4c [n, 1, h, w, 4]-shaped per group of 4 channels: reuse that reference
    n, h, w, c = x.shape
    as_nchw4c = x.reshape(n, h, w, c // 4, 4).transpose(0, 3, 1, 2, 4)
    out = max_pool2d_nchw4c_int8_ref(as_nchw4c, pool, stride, padding, dilation, ceil_mode)
    return np.ascontiguousarray(out.transpose(0, 2, 3, 1, 4).reshape(n, out.shape[2], out.shape[3], c))


def concat_nhwc32_int8(shape: tuple[int, int, int], channels: list[int], mults: list[int],
                       shifts: list[int]) -> tirx.PrimFunc:
    """Kernel: inputs int8 NHWC32 (N, H, W, ceil32(c_i)) -> output (N, H, W, ceil32(sum c_i)),
    each input requantized from its scale to the output's (``mults``, ``shifts``); any channel
    counts (a branch of 48 channels ends mid-group: the kernel reads by logical channel).

    Args:
        shape: (N, H, W).
        channels: the real channel count of each input.
    """
    n, h, w = shape
    ins = [te.placeholder((n, h, w, ceil32(c)), "int8", name=f"X{i}") for i, c in enumerate(channels)]
    offsets = np.cumsum([0] + list(channels)).tolist()

    def body(b, y, x, c):
        value = tirx.const(0, "int8")
        for i in reversed(range(len(ins))):
            local = tirx.max(tirx.min(c - offsets[i], channels[i] - 1), 0)
            v = requantize_tir(ins[i][b, y, x, local].astype("int64"), tirx.const(mults[i], "int32"),
                               tirx.const(shifts[i], "int32"), -128, 127)
            value = tirx.if_then_else(c < offsets[i + 1], v, value)
        return tirx.if_then_else(c < offsets[-1], value, tirx.const(0, "int8"))  # padded channels: 0

    out = te.compute((n, h, w, ceil32(offsets[-1])), body, name="concat")
    return te.create_prim_func([*ins, out]).with_attr({"tvm_qconv.kernel": "concat_nhwc32_int8"})


def concat_nhwc32_int8_ref(xs: list[np.ndarray], channels: list[int], mults, shifts) -> np.ndarray:
    """NumPy twin of :func:`concat_nhwc32_int8`."""
    parts = [requantize_ref(unpack_nhwc32(x, c).astype(np.int64), np.int64(m), np.int64(s), -128, 127)
             for x, c, m, s in zip(xs, channels, mults, shifts)]
    return pack_nhwc32(np.concatenate(parts, axis=1))
