"""The int8 max-pool of the NHWC32 layout, so that a network of tensor-core convs (VGG's pools)
stays in one layout between them; the residual add (``schedules/add_int8.py``) and the concat
(``schedules/concat_int8.py``) are layout-generic.  Same arithmetic as the NCHW4c max-pool
(``nchw4c/pool.py``); memory-bound, dlight on CUDA."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..nchw4c.pool import max_pool2d_nchw4c_int8_ref, pool_out_size


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

