"""Depthwise int8 conv in NHWC32, the tensor-core family's layout (MobileNet, EfficientNet,
ShuffleNet, ConvNeXt on sm_80+): the same kernel as ``schedules/nchw4c/depthwise.py`` with the
channels innermost, so a depthwise conv between two tensor-core convs reads and writes their
layout instead of paying a relayout in and one out (ShuffleNet-V2 at 224 px on sm_90a: 38 of its
40 layout conversions were those, 2026-11-26).

Each output channel reads one input channel (``o // k`` for a channel multiplier ``k``), so the
kernel is memory-bound: kh * kw multiply-adds per output byte.  Same fused epilogue as every conv:
int32 accumulate, + bias, fixed-point requantize, clamp to [act_min, act_max] (ReLU6 included).

Layouts: data ``[n, h, w, ceil32(c)]``; weight ``[kh, kw, ceil32(o)]`` (one filter tap of 4
consecutive output channels is one int8x4 word); bias / mult / shift ``[ceil32(o)]``, padded so the
padded output channels are exactly 0 (``conv2d.pack_channels``).

Read top to bottom: the compute definition, the NumPy reference, the weight packing, the CUDA
schedule.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import te, tirx

from .. import epilogue_table
from ..requantize import requantize_ref, requantize_tir
from ..kernel import written_kernel
from ..nchw4c.depthwise import bind_threads_and_store, depthwise_acc_nhwc, schedule_word_per_thread
from ..workload import ConvWorkload
from ..layer_norm_int8 import layer_norm_int8_ref, layer_norm_stages
from .layout import LAYOUT, ceil32

KERNEL_NAME = "depthwise_nhwc32_int8"
LANES = 4      # channels per thread: one int8x4 word


def depthwise_nhwc32_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Compute definition: blocks ``pad``, ``conv`` (int32 reduction over ry, rx), ``requant``."""
    assert wl.is_depthwise, wl
    k = wl.out_channels // wl.in_channels
    cip, cop = ceil32(wl.in_channels), ceil32(wl.out_channels)
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    h, w = wl.height, wl.width
    A = te.placeholder((wl.batch, h, w, cip), "int8", name="A")
    W = te.placeholder((kh, kw, cop), "int8", name="W")
    pad = te.compute(
        (wl.batch, h + pt + pb, w + pl + pr, cip),
        lambda n, y, x, c: tirx.if_then_else(
            tirx.all(y >= pt, y < h + pt, x >= pl, x < w + pl), A[n, y - pt, x - pl, c],
            tirx.const(wl.in_zero, "int8")),  # a padded tap is a real zero: the zero point
        name="pad")
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")

    def source(o):  # the input channel output channel o reads (a padded o reads a padded or real one)
        return o if k == 1 else tirx.min(o // k, cip - 1)

    conv = te.compute(
        (wl.batch, wl.out_height, wl.out_width, cop),
        lambda n, y, x, o: te.sum(
            pad[n, y * sh + ry * dh, x * sw + rx * dw, source(o)].astype("int32") * W[ry, rx, o].astype("int32"),
            axis=[ry, rx]),
        name="conv")
    return with_epilogue(A, W, conv, wl, KERNEL_NAME)


def with_epilogue(A, W, conv, wl: ConvWorkload, kernel_name: str) -> tirx.PrimFunc:
    """The PrimFunc ``(A, W, Bias, Mult, Shift, Out)`` of an NHWC32 conv whose int32 sums are
    ``conv`` ``[n, oh, ow, O_p]``: the fused epilogue (+ bias, fixed-point requantize, clamp, and
    ``wl.table``'s lookup with a ``Table`` before ``Out``: ``epilogue_table.py``) in block
    ``requant``; the depthwise and the grouped kernels' shared tail."""
    cop = int(conv.shape[-1])
    bias = te.placeholder((cop,), "int32", name="Bias")
    mult = te.placeholder((cop,), "int32", name="Mult")
    shift = te.placeholder((cop,), "int32", name="Shift")
    table = epilogue_table.te_table(wl)
    out = te.compute(
        conv.shape,
        lambda n, y, x, o: epilogue_table.finish(
            requantize_tir(conv[n, y, x, o].astype("int64") + bias[o].astype("int64"), mult[o], shift[o],
                           wl.act_min, wl.act_max), o, table, wl.out_channels),
        name="requant")
    extra = [table] if table is not None else []
    if wl.norm:   # the LayerNorm of the conv's int8 output (depthwise_layer_norm.py): its G, B, E before Out
        out, norm_params = layer_norm_stages(out, LAYOUT, wl.out_channels, wl.norm[0])
        extra = list(norm_params)
    return te.create_prim_func([A, W, bias, mult, shift, *extra, out]).with_attr(
        {"tvm_qconv.kernel": kernel_name, "tvm_qconv.workload": str(wl.to_dict())})


def depthwise_nhwc32_int8_ref(wl: ConvWorkload, a, w, bias, mult, shift, *norm) -> np.ndarray:
    """NumPy int64 reference of :func:`depthwise_nhwc32_int8` (same layouts; ``norm``: the
    LayerNorm's G, B, E where ``wl.norm``)."""
    acc = depthwise_acc_nhwc(wl, a, w)
    out = requantize_ref(acc + bias.astype(np.int64), mult, shift, wl.act_min, wl.act_max)
    return layer_norm_int8_ref(LAYOUT, out, *norm, wl.out_channels, wl.norm[0]) if wl.norm else out


def pack_depthwise(w: np.ndarray) -> np.ndarray:
    """[O, 1, KH, KW] -> [KH, KW, ceil32(O)], output channels zero-padded."""
    o, _, kh, kw = w.shape
    wp = np.zeros((kh, kw, ceil32(o)), w.dtype)
    wp[..., :o] = w[:, 0].transpose(1, 2, 0)
    return wp


# Output pixels of one row per thread (the largest divisor of the output width up to this):
# their taps share input words and filter words in registers.
ROW_TILE = 8
THREADS = 128
# ... as long as the grid keeps this many threads (4 blocks of 128 on each of an H100's 132 SMs): at
# batch 1 a 56 x 56 x 96 map has 75,264 output words, and 8 pixels a thread left 73 blocks for 132
# SMs (ConvNeXt-T at batch 1 went 0.53 -> 0.65 ms on an H100, 2026-11-27).
MIN_THREADS = 1 << 16


def row_tile(wl: ConvWorkload) -> int:
    """Pixels per thread: the largest divisor of the output width up to :data:`ROW_TILE` that
    leaves at least :data:`MIN_THREADS` threads (1 where none does)."""
    words = wl.batch * wl.out_height * wl.out_width * ceil32(wl.out_channels) // LANES
    return max(d for d in range(1, ROW_TILE + 1) if wl.out_width % d == 0 and (d == 1 or words // d >= MIN_THREADS))


def schedule_cuda(func: tirx.PrimFunc, target, written: Callable | None = None) -> tirx.PrimFunc:
    """One thread per output word (4 channels) of ``R`` consecutive pixels of a row (:func:`row_tile`:
    8 at batch 64, 1 where the grid would be too small for the GPU),
    consecutive threads on consecutive words of a pixel (coalesced loads and stores).  Per filter
    row the thread loads the ``(R - 1) * stride + (kw - 1) * dilation + 1`` input words the R
    pixels read into registers once, and each filter word once for all R pixels: a 7 x 7 filter
    over 8 pixels takes 14 input and 7 filter loads per filter row, where one pixel per thread
    (the NCHW4c kernel's :func:`schedule_word_per_thread`) took 7 and 7 for each pixel.

    Why: ConvNeXt-T's 7 x 7 depthwise convs took 2.46 of its 4.63 ms of kernels at batch 64 on an
    H100 with one pixel per thread (2.7 T multiply-adds/s: bound by loads and byte unpacking, not
    by memory), ``docs/history.md``.  A channel multiplier above 1 keeps the one-pixel schedule.

    ``written``: the written-out kernel to run instead where it takes the layer
    (``depthwise_dp4a.depthwise_dp4a_kernel``: a channel multiplier of 1, no dilation, every
    depthwise conv of the zoo; the same work per thread, with each channel's taps packed four to a
    word for ``__dp4a``), or None: the schedule alone.  The implementation passes it
    (``impls.Conv2dDepthwise``): that kernel builds on this module's row tile, so this module
    cannot import it.  A conv with a LayerNorm in its epilogue (``wl.norm``) runs
    ``depthwise_layer_norm.py``'s kernel, which the implementation picks before this."""
    wl = ConvWorkload.of(func)
    assert not wl.norm, "a LayerNorm epilogue is depthwise_layer_norm.py's kernel (impls.Conv2dDepthwise.schedule)"
    kernel = written(wl) if written else None
    if kernel is not None:
        return written_kernel(func, kernel)
    sch = tvm.s_tir.Schedule(func)
    conv, pad, requant = (sch.get_sblock(b) for b in ("conv", "pad", "requant"))
    n, y, x, o, ry, rx = sch.get_loops(conv)
    ob, oi = sch.split(o, [None, LANES])
    if wl.out_channels != wl.in_channels:
        schedule_word_per_thread(sch, (n, y, x, ob), ry, rx, oi, wl)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    xo, xi = sch.split(x, [None, row_tile(wl)])
    sch.reorder(n, y, xo, ob, ry, rx, xi, oi)
    bind_threads_and_store(sch, (n, y, xo, ob), THREADS)
    sch.set_scope(pad, 0, "local")
    sch.compute_at(pad, ry, preserve_unit_loops=True)      # the input words of one filter row
    sch.vectorize(sch.get_loops(pad)[-1])
    w_local = sch.cache_read(conv, 1, "local")
    sch.compute_at(w_local, rx, preserve_unit_loops=True)  # one filter word, for all R pixels
    sch.vectorize(sch.get_loops(w_local)[-1])
    init = sch.decompose_reduction(conv, ry)
    for loop in (ry, rx, xi, oi, *sch.get_loops(init)[2:], *sch.get_loops(requant)[2:],
                 *sch.get_loops(pad)[3:-1]):
        sch.unroll(loop)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
