"""Depthwise int8 conv in NCHW4c (MobileNet, EfficientNet, ShuffleNet): each output channel reads
one input channel, so the 4 channels of an int8x4 word stay independent and the kernel is
memory-bound (kh * kw multiply-adds per output byte).  Same fused epilogue as the dense conv:
int32 accumulate, + bias, fixed-point requantize, clamp to [act_min, act_max] (ReLU6 included).

Read top to bottom: the compute definition (:func:`depthwise_nchw4c_int8`), the NumPy reference,
the weight packing, and the two schedules (llvm, CUDA).

Layouts: data NCHW4c ``[n, c/4, h, w, 4]``; weight ``[o/4, kh, kw, 4]`` (one filter tap of 4
output channels is one int8x4 word); bias / mult / shift ``[o/4, 4]``.  A channel multiplier
``k = out / in`` > 1 (output channel ``o`` reads input channel ``o // k``) is supported; with
``k = 1`` the compute reads the same (block, lane) it writes, which the schedules rely on for
vector loads.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from .. import epilogue_table
from ..requantize import requantize_ref, requantize_tir
from ..workload import ConvWorkload
from .conv2d import zero_pad
from .layout import ceil4

KERNEL_NAME = "depthwise_nchw4c_int8"
THREADS = 128  # CUDA threads per block: one output word (4 channels) each


def depthwise_nchw4c_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Compute definition: blocks ``pad``, ``conv`` (int32 reduction over ry, rx), ``requant``."""
    assert wl.is_depthwise, wl
    k = wl.out_channels // wl.in_channels
    icc, occ = ceil4(wl.in_channels) // 4, ceil4(wl.out_channels) // 4
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    A = te.placeholder((wl.batch, icc, wl.height, wl.width, 4), "int8", name="A")
    W = te.placeholder((occ, kh, kw, 4), "int8", name="W")
    pad = zero_pad(A, wl)
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")

    def source(ob, oi):  # the (block, lane) of the input channel output channel ob*4+oi reads
        if k == 1:
            return ob, oi
        c = (ob * 4 + oi) // k
        return c // 4, c % 4

    conv = te.compute(
        (wl.batch, occ, wl.out_height, wl.out_width, 4),
        lambda n, ob, y, x, oi: te.sum(
            pad[n, source(ob, oi)[0], y * sh + ry * dh, x * sw + rx * dw, source(ob, oi)[1]].astype("int32")
            * W[ob, ry, rx, oi].astype("int32"), axis=[ry, rx]),
        name="conv")
    bias = te.placeholder((occ, 4), "int32", name="Bias")
    mult = te.placeholder((occ, 4), "int32", name="Mult")
    shift = te.placeholder((occ, 4), "int32", name="Shift")
    table = epilogue_table.te_table(wl)
    out = te.compute(
        conv.shape,
        lambda n, ob, y, x, oi: epilogue_table.finish(
            requantize_tir(conv[n, ob, y, x, oi].astype("int64") + bias[ob, oi].astype("int64"),
                           mult[ob, oi], shift[ob, oi], wl.act_min, wl.act_max), ob * 4 + oi, table, wl.out_channels),
        name="requant")
    return te.create_prim_func([A, W, bias, mult, shift] + ([table] if table is not None else []) + [out]).with_attr(
        {"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict())})


def depthwise_nchw4c_int8_ref(wl: ConvWorkload, a, w, bias, mult, shift) -> np.ndarray:
    """NumPy int64 reference of :func:`depthwise_nchw4c_int8` (same layouts)."""
    n, occ = a.shape[0], w.shape[0]
    x = a.transpose(0, 2, 3, 1, 4).reshape(n, wl.height, wl.width, -1)            # NHWC, padded C
    taps = w.transpose(1, 2, 0, 3).reshape(*wl.kernel, occ * 4)                      # [kh, kw, O]
    acc = depthwise_acc_nhwc(wl, x, taps).reshape(n, wl.out_height, wl.out_width, occ, 4).transpose(0, 3, 1, 2, 4)
    return requantize_ref(acc + bias.astype(np.int64)[None, :, None, None, :], mult[None, :, None, None, :],
                          shift[None, :, None, None, :], wl.act_min, wl.act_max)


def depthwise_acc_nhwc(wl: ConvWorkload, x: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """The int64 accumulators of a depthwise conv, both layouts' references' core: input ``x``
    ``[n, h, w, C]`` (channels padded or not), filter ``taps`` ``[kh, kw, O]``; output channel
    ``o`` reads input channel ``o // k`` (``k`` the channel multiplier, clamped into ``C`` for
    padded ``o``).  Returns ``[n, oh, ow, O]``."""
    k = wl.out_channels // wl.in_channels
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    xp = np.pad(x.astype(np.int64), ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=wl.in_zero)
    src = np.minimum(np.arange(taps.shape[-1]) // k, x.shape[-1] - 1)
    acc = np.zeros((x.shape[0], oh, ow, taps.shape[-1]), np.int64)
    for y in range(kh):
        for xx in range(kw):
            win = xp[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, xx * dw: xx * dw + (ow - 1) * sw + 1: sw, src]
            acc += win * taps[y, xx].astype(np.int64)
    return acc


def pack_depthwise(w: np.ndarray) -> np.ndarray:
    """[O, 1, KH, KW] -> [O/4, KH, KW, 4], output channels zero-padded."""
    o, _, kh, kw = w.shape
    wp = np.zeros((ceil4(o), kh, kw), w.dtype)
    wp[:o] = w[:, 0]
    return np.ascontiguousarray(wp.reshape(-1, 4, kh, kw).transpose(0, 2, 3, 1))


def schedule_cuda(func: tirx.PrimFunc, target) -> tirx.PrimFunc:
    """One thread per output word (4 channels), consecutive threads on consecutive columns
    (coalesced loads and stores); the kh x kw taps unrolled (:func:`schedule_word_per_thread`)."""
    sch = tvm.s_tir.Schedule(func)
    n, ob, y, x, oi, ry, rx = sch.get_loops(sch.get_sblock("conv"))
    schedule_word_per_thread(sch, (n, ob, y, x), ry, rx, oi, ConvWorkload.of(func))
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def bind_threads_and_store(sch, outer, threads: int):
    """The loops ``outer`` fused into one thread each (blocks of ``threads``), the ``conv`` accumulators
    in registers, the ``requant`` epilogue computed from them in the same thread and stored through a
    register copy as one vector (int8x4 words).  Returns the thread loop."""
    conv, requant = sch.get_sblock("conv"), sch.get_sblock("requant")
    bx, tx = sch.split(sch.fuse(*outer), [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(conv, 0, "local")
    sch.reverse_compute_at(requant, tx, preserve_unit_loops=True)
    store = sch.cache_write(requant, 0, "local")
    sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(store)[-1])
    return tx


def schedule_word_per_thread(sch, outer, ry, rx, oi, wl: ConvWorkload) -> None:
    """The CUDA schedule of a depthwise kernel (blocks ``pad``, ``conv``, ``requant``) in either
    layout, from its ``conv`` loops: ``outer`` fused into one thread per output word, the taps
    ``ry, rx``, and ``oi`` the word's 4 channels (innermost in memory in both layouts).  The
    accumulators stay in registers, the epilogue computes from them and a copy stores int8x4
    words (vectorizing the epilogue itself would make 32-byte int64x4 vectors).  With channel
    multiplier 1 each tap is one int8x4 input word and one int8x4 filter word, loaded as such
    into registers (the zero padding a predicate on the word); otherwise the input is read byte
    by byte."""
    conv, pad, requant = (sch.get_sblock(b) for b in ("conv", "pad", "requant"))
    sch.reorder(*outer, ry, rx, oi)
    bind_threads_and_store(sch, outer, THREADS)
    if wl.out_channels == wl.in_channels:
        sch.set_scope(pad, 0, "local")
        sch.compute_at(pad, rx, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(pad)[-1])
        w_local = sch.cache_read(conv, 1, "local")
        sch.compute_at(w_local, rx, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(w_local)[-1])
    else:
        sch.compute_inline(pad)
    init = sch.decompose_reduction(conv, ry)
    for loop in (ry, rx, oi, *sch.get_loops(init)[2:], *sch.get_loops(requant)[2:]):
        sch.unroll(loop)


def schedule_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Output rows in parallel; each output word's 4 channels one vector through the taps."""
    sch = tvm.s_tir.Schedule(func)
    conv, pad, requant = (sch.get_sblock(b) for b in ("conv", "pad", "requant"))
    sch.compute_inline(pad)
    n, ob, y, x, oi, ry, rx = sch.get_loops(conv)
    sch.reorder(n, ob, y, x, ry, rx, oi)
    sch.parallel(sch.fuse(n, ob, y))
    sch.reverse_compute_at(requant, x)
    init = sch.decompose_reduction(conv, ry)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.unroll(ry)
    sch.unroll(rx)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
