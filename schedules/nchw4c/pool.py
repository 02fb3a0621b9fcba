"""int8 max-pool in NCHW4c: max commutes with the (monotonic) quantizer, so pooling int8 values
at an unchanged scale is exact; padding reads as -128, the int8 minimum."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..requantize import requantize_ref, requantize_tir


def max_pool2d_nchw4c_int8(shape, pool, stride, padding, dilation=(1, 1), ceil_mode=False) -> tirx.PrimFunc:
    n, cc, h, w, _ = shape
    (kh, kw), (sh, sw), (dh, dw) = pool, stride, dilation
    pt, pl, pb, pr = padding
    oh, ow = pool_out_size(h, w, pool, stride, padding, dilation, ceil_mode)
    x = te.placeholder(shape, "int8", name="X")
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")

    def val(b, c, y, xx, ci):
        iy, ix = y * sh + ry * dh - pt, xx * sw + rx * dw - pl
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        return tirx.if_then_else(ok, x[b, c, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0), ci],
                                 tirx.const(-128, "int8"))

    out = te.compute((n, cc, oh, ow, 4), lambda b, c, y, xx, ci: te.max(val(b, c, y, xx, ci), axis=[ry, rx]),
                     name="max_pool")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "max_pool2d_nchw4c_int8"})


def pool_out_size(h, w, pool, stride, padding, dilation=(1, 1), ceil_mode=False):
    """(OH, OW) of a pool, by PyTorch's rule (``pooling_output_shape``): with ``ceil_mode`` the
    last window may run past the padded input, but must start inside the input or its leading
    padding, else it is dropped (size 5, kernel 2, stride 2, pad 1: 3 windows, not 4)."""
    def one(size, k, s, p0, p1, d):
        span = size + p0 + p1 - ((k - 1) * d + 1)
        if not ceil_mode:
            return span // s + 1
        out = -(-span // s) + 1
        return out - 1 if (out - 1) * s >= size + p0 else out
    return (one(h, pool[0], stride[0], padding[0], padding[2], dilation[0]),
            one(w, pool[1], stride[1], padding[1], padding[3], dilation[1]))


def max_pool2d_nchw4c_int8_ref(x: np.ndarray, pool, stride, padding, dilation=(1, 1), ceil_mode=False) -> np.ndarray:
    n, cc, h, w, _ = x.shape
    oh, ow = pool_out_size(h, w, pool, stride, padding, dilation, ceil_mode)
    pt, pl = padding[0], padding[1]
    big = np.full((n, cc, h + pt + padding[2] + pool[0] * dilation[0] + stride[0],
                   w + pl + padding[3] + pool[1] * dilation[1] + stride[1], 4), -128, np.int8)
    big[:, :, pt:pt + h, pl:pl + w] = x
    out = np.full((n, cc, oh, ow, 4), -128, np.int8)
    for y in range(pool[0]):
        for xx in range(pool[1]):
            win = big[:, :, y * dilation[0]: y * dilation[0] + (oh - 1) * stride[0] + 1: stride[0],
                      xx * dilation[1]: xx * dilation[1] + (ow - 1) * stride[1] + 1: stride[1]]
            out = np.maximum(out, win)
    return out


def avg_pool2d_nchw4c_int8(shape, pool, stride, padding, mult: int, shift: int) -> tirx.PrimFunc:
    """int8 average pool (every window divides by the full ``kh * kw``: PyTorch's
    ``count_include_pad=True``, or no padding), requantized to the output's scale: the window
    sum times ``mult * 2**-shift`` (= ``s_in / (kh * kw * s_out)``), integer-only."""
    n, cc, h, w, _ = shape
    (kh, kw), (sh, sw) = pool, stride
    pt, pl, pb, pr = padding
    oh, ow = pool_out_size(h, w, pool, stride, padding)
    x = te.placeholder(shape, "int8", name="X")
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")

    def val(b, c, y, xx, ci):
        iy, ix = y * sh + ry - pt, xx * sw + rx - pl
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        read = x[b, c, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0), ci]
        return tirx.if_then_else(ok, read.astype("int32"), tirx.const(0, "int32"))

    total = te.compute((n, cc, oh, ow, 4), lambda b, c, y, xx, ci: te.sum(val(b, c, y, xx, ci), axis=[ry, rx]),
                       name="window_sum")
    out = te.compute(total.shape, lambda *i: requantize_tir(total(*i), tirx.const(mult, "int32"),
                                                            tirx.const(shift, "int32"), -128, 127),
                     name="avg_requant")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "avg_pool2d_nchw4c_int8"})


def avg_pool2d_nchw4c_int8_ref(x: np.ndarray, pool, stride, padding, mult: int, shift: int) -> np.ndarray:
    n, cc, h, w, _ = x.shape
    oh, ow = pool_out_size(h, w, pool, stride, padding)
    pt, pl, pb, pr = padding
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pt, pb + stride[0]), (pl, pr + stride[1]), (0, 0)))
    total = np.zeros((n, cc, oh, ow, 4), np.int64)
    for y in range(pool[0]):
        for xx in range(pool[1]):
            total += xp[:, :, y: y + (oh - 1) * stride[0] + 1: stride[0], xx: xx + (ow - 1) * stride[1] + 1: stride[1]]
    return requantize_ref(total, np.int64(mult), np.int64(shift), -128, 127)
