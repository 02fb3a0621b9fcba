"""int8 max and average pools in any activation layout: the NCHW4c family's and the NHWC32
(tensor-core) family's, so that a network stays in whichever layout its convs use (VGG's and
ResNet's max-pools, Inception's 3x3 average pools in its branches, DenseNet's transitions).

The kernels compute on the logical ``(n, c, y, x)`` index through the layout's index maps, as
the concat does (``concat_int8.py``); padded channels pool zeros to zeros (to whatever the
zero points make of them in an average pool of an unsigned tensor: no reader uses them).

- Max-pool: max commutes with the (monotonic) quantizer, so pooling int8 values at an unchanged
  scale is exact; padding reads as -128, the int8 minimum.
- Average pool: every window divides by the full ``kh * kw`` (PyTorch's ``count_include_pad=True``,
  or no padding); the int32 window sum is requantized to the output's scale by
  ``mult * 2**-shift`` (= ``s_in / (kh * kw * s_out)``), integer-only.

Memory-bound.  On CUDA each thread computes one output from its window (``schedule_pool``):
dlight's reduction rules gave a 3x3 window a block-wide cross-thread reduction, and Inception-V3's
branch average pools took 53 of its 60 ms at batch 64 on an H100 (``benchmarks/kernel_profile.py``).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from .kernel import Layout
from .requantize import QMIN, requantize_ref, requantize_tir


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


def _window(layout: Layout, shape, pool, stride, padding, dilation, ceil_mode, name, combine, pad_value: int,
            dtype: str):
    """X (packed ``shape``) and the pooled tensor in ``layout``: ``combine`` (te.max / te.sum) of
    each window in ``dtype``, positions outside the input reading ``pad_value``."""
    n, c, h, w = layout.logical_shape(shape)
    (kh, kw), (sh, sw), (dh, dw) = pool, stride, dilation
    pt, pl = padding[0], padding[1]
    oh, ow = pool_out_size(h, w, pool, stride, padding, dilation, ceil_mode)
    x = te.placeholder(shape, "int8", name="X")
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")

    def body(*index):
        b, cc, y, xx = layout.to_logical(index)
        iy, ix = y * sh + ry * dh - pt, xx * sw + rx * dw - pl
        ok = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        read = x[layout.to_packed(b, cc, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0))]
        return combine(tirx.if_then_else(ok, read.astype(dtype), tirx.const(pad_value, dtype)), axis=[ry, rx])

    return x, te.compute(layout.packed_shape((n, c, oh, ow)), body, name=name)


def max_pool2d_int8(layout: Layout, shape, pool, stride, padding, dilation=(1, 1), ceil_mode=False) -> tirx.PrimFunc:
    """Kernel: int8 max-pool of a tensor of packed ``shape`` in ``layout``."""
    x, out = _window(layout, shape, pool, stride, padding, dilation, ceil_mode, "max_pool", te.max, -128, "int8")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": f"max_pool2d_{layout.name.lower()}_int8"})


def avg_pool2d_int8(layout: Layout, shape, pool, stride, padding, mult: int, shift: int,
                    in_zero: int = 0, out_zero: int = 0) -> tirx.PrimFunc:
    """Kernel: int8 average pool (``count_include_pad=True``) of packed ``shape`` in ``layout``,
    requantized by (``mult``, ``shift``).  Zero points (0, or -128 for an unsigned tensor): the
    padding reads ``in_zero`` (a real zero), the window sum less ``kh * kw * in_zero`` is
    requantized, and ``out_zero`` is added after the rounding, before the clamp."""
    x, total = _window(layout, shape, pool, stride, padding, (1, 1), False, "window_sum", te.sum, in_zero, "int32")
    lo = QMIN if out_zero == 0 else -128
    if in_zero == 0 and out_zero == 0:
        def body(*i):
            return requantize_tir(total(*i), tirx.const(mult, "int32"), tirx.const(shift, "int32"), lo, 127)
    else:
        def body(*i):
            acc = total(*i).astype("int64") - tirx.const(pool[0] * pool[1] * in_zero, "int64")
            return requantize_tir(acc, tirx.const(mult, "int32"), tirx.const(shift, "int32"), lo, 127,
                                  zero=out_zero)
    out = te.compute(total.shape, body, name="avg_requant")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": f"avg_pool2d_{layout.name.lower()}_int8"})


def _windows_ref(x: np.ndarray, pool, stride, padding, dilation, ceil_mode, pad_value):
    """NCHW ``x`` -> (every window position's [N, C, OH, OW] slice, in turn)."""
    n, c, h, w = x.shape
    oh, ow = pool_out_size(h, w, pool, stride, padding, dilation, ceil_mode)
    pt, pl = padding[0], padding[1]
    big = np.full((n, c, h + pt + padding[2] + pool[0] * dilation[0] + stride[0],
                   w + pl + padding[3] + pool[1] * dilation[1] + stride[1]), pad_value, x.dtype)
    big[:, :, pt:pt + h, pl:pl + w] = x
    for y in range(pool[0]):
        for xx in range(pool[1]):
            yield big[:, :, y * dilation[0]: y * dilation[0] + (oh - 1) * stride[0] + 1: stride[0],
                      xx * dilation[1]: xx * dilation[1] + (ow - 1) * stride[1] + 1: stride[1]]


def max_pool2d_int8_ref(layout: Layout, x: np.ndarray, pool, stride, padding, dilation=(1, 1),
                        ceil_mode=False) -> np.ndarray:
    """NumPy twin of :func:`max_pool2d_int8` (packed in, packed out)."""
    logical = layout.unpack(x, layout.logical_shape(x.shape)[1])
    return layout.pack(np.maximum.reduce(list(_windows_ref(logical, pool, stride, padding, dilation, ceil_mode, -128))))


def avg_pool2d_int8_ref(layout: Layout, x: np.ndarray, pool, stride, padding, mult: int, shift: int,
                        in_zero: int = 0, out_zero: int = 0) -> np.ndarray:
    """NumPy twin of :func:`avg_pool2d_int8` (packed in, packed out)."""
    logical = layout.unpack(x, layout.logical_shape(x.shape)[1]).astype(np.int64)
    total = sum(_windows_ref(logical, pool, stride, padding, (1, 1), False, in_zero)) - pool[0] * pool[1] * in_zero
    out = requantize_ref(total, np.int64(mult), np.int64(shift), QMIN if out_zero == 0 else -128, 127,
                         zero=out_zero)
    return layout.pack(out.astype(np.int8))


THREADS = 256  # outputs per thread block (one per thread)


# A pool whose window is the whole map and holds at least this many pixels is scheduled as a reduction.
GLOBAL_MIN_PIXELS = 256


def schedule_pool(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """CUDA: one thread per output element, the window summed (or maxed) in a register, the
    average's requantize in the same thread; consecutive threads take consecutive elements of
    the packed layout (its innermost axis is channels in both layouts), so loads coalesce.
    None elsewhere (llvm runs the compute definition as it is)."""
    if target.kind.name != "cuda":
        return None
    sch = tvm.s_tir.Schedule(func)
    is_max = str(func.attrs["tvm_qconv.kernel"]).startswith("max_pool")
    window = sch.get_sblock("max_pool" if is_max else "window_sum")
    loops = sch.get_loops(window)
    bx, tx = sch.split(sch.fuse(*loops[:-2]), [None, THREADS])  # the last two: the window
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if is_max:  # accumulate in a register, one store
        sch.reverse_compute_at(sch.cache_write(window, 0, "local"), tx)
    else:       # the window sum in a register, requantized by the same thread
        sch.reverse_compute_at(sch.get_sblock("avg_requant"), tx)
        sch.set_scope(window, 0, "local")
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
