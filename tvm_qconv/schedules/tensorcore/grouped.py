"""Grouped int8 conv (ResNeXt's 32 groups, RegNet's group widths) in NHWC32, the tensor-core
family's layout, on ``__dp4a``: a grouped conv between two tensor-core convs reads and writes their
layout, where the NCHW4c dp4a kernel needs a relayout in and one out (the sm_90a plan of ResNeXt-50
at batch 64 has 32 relayouts, two per grouped conv: ~840 MB moved per forward).

Each output channel ``o`` of group ``g = o // go`` sums ``gi`` input channels ``g * gi ...`` over the
taps: ``gi / 4`` int8x4 words per tap, one ``__dp4a`` each.  Same fused epilogue as every conv:
int32 accumulate, + bias, fixed-point requantize, clamp.

Layouts: data ``[n, h, w, ceil32(c)]``; weight ``[kh, kw, gi / 4, ceil32(o), 4]`` (for one tap and
input word, the 4 words of 4 consecutive output channels are 16 contiguous bytes); bias / mult /
shift ``[ceil32(o)]`` (``conv2d.pack_channels``).  Takes ``gi`` and ``go`` multiples of 4.

Also one group of fewer than ``FEW_CHANNELS`` input channels (squeeze-excite's second conv: 4-10
channels in EfficientNet-B0), which the tensor-core template does not take: its ``gi`` padded to a
multiple of 4 with zero weights (the NHWC32 input's padded channels are read and multiplied by 0).
Reading NHWC32, it spares such a conv the relayouts around an NCHW4c kernel (11 of EfficientNet-B0's
at batch 1); the planner picks it where the input already is NHWC32 (``KernelImpl.follows_input``).

On CUDA the kernel is written out (``grouped_kernel``): a thread per up to 2 output words (8
channels of one group, ``words_per_thread``) and a row of up to ``ROW_TILE`` pixels, consecutive
threads on consecutive words (coalesced stores and weight loads; the threads of one group read the
same input words); per tap and input word, 16-byte weight loads serve the row, and each input word
(the zero point's outside the image, chosen without a branch) feeds ``4 * words`` ``__dp4a``.  With
one word a thread, RegNet-X's grouped convs ran at 16 % of the dp4a peak at batch 64 (H200,
``docs/performance.md``): ~1.7 other instructions per ``dp4a``, one input load per 4.  Untuned.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..kernel import parse_written_kernel
from ..requantize import requantize_ref
from ..workload import ConvWorkload
from .depthwise import with_epilogue
from .layout import ceil32, zero_word

KERNEL_NAME = "conv2d_grouped_nhwc32_int8"
THREADS = 128
ROW_TILE = 4
MIN_THREADS = 1 << 16   # as the depthwise kernel: a row tile only where the grid stays this large


FEW_CHANNELS = 16       # one group of fewer input channels: the tensor-core template's minimum


def takes(wl: ConvWorkload) -> bool:
    if wl.out_dtype != "int8":
        return False
    if wl.groups == 1:
        return wl.in_channels < FEW_CHANNELS
    gi, go = wl.in_channels // wl.groups, wl.out_channels // wl.groups
    return not wl.is_depthwise and gi % 4 == 0 and go % 4 == 0


def group_widths(wl: ConvWorkload) -> tuple[int, int]:
    """(input, output) channels per group as the kernel reads them: one group's input channels
    padded to a multiple of 4 (zero weights on the padded ones)."""
    gi, go = wl.in_channels // wl.groups, wl.out_channels // wl.groups
    return (-(-gi // 4) * 4 if wl.groups == 1 else gi), go


def grouped_nhwc32_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Compute definition ``(A, W, Bias, Mult, Shift, Out)``: blocks ``pad``, ``conv``, ``requant``."""
    assert takes(wl), wl
    gi, go = group_widths(wl)
    cip, cop = ceil32(wl.in_channels), ceil32(wl.out_channels)
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    h, w = wl.height, wl.width
    A = te.placeholder((wl.batch, h, w, cip), "int8", name="A")
    W = te.placeholder((kh, kw, gi // 4, cop, 4), "int8", name="W")
    pad = te.compute(
        (wl.batch, h + pt + pb, w + pl + pr, cip),
        lambda n, y, x, c: tirx.if_then_else(
            tirx.all(y >= pt, y < h + pt, x >= pl, x < w + pl), A[n, y - pt, x - pl, c],
            tirx.const(wl.in_zero, "int8")),
        name="pad")
    ry, rx = te.reduce_axis((0, kh), name="ry"), te.reduce_axis((0, kw), name="rx")
    ri = te.reduce_axis((0, gi), name="ri")

    def source(o, i):   # the input channel i of output o's group (a padded o: the last group; its weights are 0)
        return tirx.min(o // go, wl.groups - 1) * gi + i

    conv = te.compute(
        (wl.batch, wl.out_height, wl.out_width, cop),
        lambda n, y, x, o: te.sum(
            pad[n, y * sh + ry * dh, x * sw + rx * dw, source(o, ri)].astype("int32")
            * W[ry, rx, ri // 4, o, ri % 4].astype("int32"), axis=[ry, rx, ri]),
        name="conv")
    return with_epilogue(A, W, conv, wl, KERNEL_NAME)


def grouped_nhwc32_int8_ref(wl: ConvWorkload, a, w, bias, mult, shift) -> np.ndarray:
    """NumPy int64 reference of :func:`grouped_nhwc32_int8` (same layouts)."""
    g, (gi, go) = wl.groups, group_widths(wl)
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow, o = wl.out_height, wl.out_width, wl.out_channels
    xp = np.pad(a[..., :g * gi].astype(np.int64), ((0, 0), (pt, pb), (pl, pr), (0, 0)),
                constant_values=wl.in_zero)
    taps = w[:, :, :, :o].transpose(0, 1, 3, 2, 4).reshape(kh, kw, g, go, gi).astype(np.int64)  # [kh, kw, g, go, gi]
    acc = np.zeros((a.shape[0], oh, ow, g, go), np.int64)
    for y in range(kh):
        for x in range(kw):
            win = xp[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, x * dw: x * dw + (ow - 1) * sw + 1: sw, :]
            acc += np.einsum("nhwgi,goi->nhwgo", win.reshape(*win.shape[:3], g, gi), taps[y, x])
    full = np.zeros((a.shape[0], oh, ow, w.shape[3]), np.int64)
    full[..., :o] = acc.reshape(*acc.shape[:3], o)
    return requantize_ref(full + bias.astype(np.int64), mult, shift, wl.act_min, wl.act_max)


def pack_grouped(w: np.ndarray, groups: int) -> np.ndarray:
    """[O, gi, KH, KW] -> [KH, KW, gi / 4, ceil32(O), 4], output channels zero-padded (one group's
    input channels too, to a multiple of 4)."""
    if groups == 1 and w.shape[1] % 4:
        w = np.pad(w, ((0, 0), (0, -w.shape[1] % 4), (0, 0), (0, 0)))
    o, gi, kh, kw = w.shape
    wp = np.zeros((kh, kw, gi // 4, ceil32(o), 4), w.dtype)
    wp[:, :, :, :o, :] = w.reshape(o, gi // 4, 4, kh, kw).transpose(3, 4, 1, 0, 2)
    return wp


WORDS_PER_THREAD = (1, 2)   # measured: 2 words a thread helped groups of 8, 4 hurt groups of 16 and 32


def words_per_thread(wl: ConvWorkload) -> int:
    """Output words (4 channels each) per thread: the most of ``WORDS_PER_THREAD`` that divides a
    group's words and leaves at least ``MIN_THREADS`` threads at one pixel a thread (1 where none
    does).  Each input word a thread loads then feeds ``4 * words`` ``__dp4a`` instead of 4.

    Why not 4: ResNeXt-50 at batch 64 on an H200 (2026-11-28, ``docs/performance.md``), before and
    after c029fb3 (these words, and the branchless input word): groups of 4 (one word) 229 -> 125 us
    and of 8 (2 words) 156 -> 104 us, but groups of 16 and 32 (4 words) 206 -> 422 and 127 -> 325 us.
    With 2 words (tree fb6fe24) the groups of 16 and 32 were mixed against one: RegNet-X's 251 -> 210
    and 119 -> 101 us, ResNeXt's 206 -> 235 and 127 -> 151 us.  Groups of 16 and more run as GEMMs
    on the tensor cores where they can (``grouped_gemm.py``), faster than either."""
    go_words = group_widths(wl)[1] // 4
    words = wl.batch * wl.out_height * wl.out_width * ceil32(wl.out_channels) // 4
    return max(k for k in WORDS_PER_THREAD if go_words % k == 0 and (k == 1 or words // k >= MIN_THREADS))


def row_tile(wl: ConvWorkload) -> int:
    """Pixels per thread: the largest divisor of the output width up to ``ROW_TILE`` that leaves at
    least ``MIN_THREADS`` threads (1 where none does), with :func:`words_per_thread` words each."""
    threads = wl.batch * wl.out_height * wl.out_width * ceil32(wl.out_channels) // 4 // words_per_thread(wl)
    return max(d for d in range(1, ROW_TILE + 1) if wl.out_width % d == 0 and (d == 1 or threads // d >= MIN_THREADS))


def grouped_kernel(wl: ConvWorkload, emulate_dp4a: bool = False) -> tirx.PrimFunc:
    """The CUDA kernel of :func:`grouped_nhwc32_int8` (module docstring).  ``emulate_dp4a``: each
    ``__dp4a`` written as its four products instead, for a CPU twin (tests)."""
    gi, go = group_widths(wl)
    cip, cop = ceil32(wl.in_channels), ceil32(wl.out_channels)
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl = wl.padding[0], wl.padding[1]
    n, h, w, oh, ow = wl.batch, wl.height, wl.width, wl.out_height, wl.out_width
    oc, r = words_per_thread(wl), row_tile(wl)
    words = cop // 4 // oc                # threads per pixel run: oc output words each
    threads = n * oh * (ow // r) * words

    def dp4a(w_local: str) -> str:
        """acc + the 4 products of the input word ``xw[0]`` and the weight word at ``w_local``."""
        if not emulate_dp4a:
            return f'T.call_pure_extern("int32", "__dp4a", xw[0], wv.vload([{w_local}], "int8x4"), {{acc}})'
        terms = " + ".join(f'T.Cast("int32", T.Cast("int8", T.shift_right(xw[0], {8 * k}))) '
                           f'* T.Cast("int32", wv[{w_local} + {k}])' for k in range(4))
        return f"{{acc}} + {terms}"

    # the input word of a tap, or the zero point's outside the image: loaded once, no branch, for
    # the 4 * oc dp4a of the thread's output words
    base = f"T.min(ob * {4 * oc} // {go}, {wl.groups - 1}) * {gi // 4}"   # the first word of the thread's group
    xi = f"((img * {h} + iy) * {w} + ix) * {cip // 4} + {base} + i4"
    word = f"T.if_then_else(0 <= iy and iy < {h} and 0 <= ix and ix < {w}, x[{xi}], {zero_word(wl.in_zero)})"
    mac = dp4a("(q * 4 + oo) * 4")
    src = f'''
@T.prim_func(private=True)
def main(A: T.Buffer(({n}, {h}, {w}, {cip}), "int8", align=16), W: T.Buffer(({kh}, {kw}, {gi // 4}, {cop}, 4), "int8", align=16),
         Bias: T.Buffer(({cop},), "int32"), Mult: T.Buffer(({cop},), "int32"), Shift: T.Buffer(({cop},), "int32"),
         Out: T.Buffer(({n}, {oh}, {ow}, {cop}), "int8", align=16)):
    T.func_attr({{"tir.noalias": True}})
    x = T.decl_buffer(({n * h * w * cip // 4},), "int32", data=A.data, align=16)
    wt = T.decl_buffer(({kh * kw * (gi // 4) * cop * 4},), "int8", data=W.data, align=16)
    y = T.decl_buffer(({n * oh * ow * cop},), "int8", data=Out.data, align=16)
    for bx in T.thread_binding({-(-threads // THREADS)}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            acc = T.alloc_buffer(({r * oc * 4},), "int32", scope="local")
            wv = T.alloc_buffer(({16 * oc},), "int8", scope="local")
            xw = T.alloc_buffer((1,), "int32", scope="local")
            yv = T.alloc_buffer((4,), "int8", scope="local")
            if bx * {THREADS} + tx < {threads}:
                ob = (bx * {THREADS} + tx) % {words}          # the thread's words: ob * oc .. ob * oc + oc - 1
                col = (bx * {THREADS} + tx) // {words} % {ow // r} * {r}
                row = (bx * {THREADS} + tx) // {words * (ow // r)} % {oh}
                img = (bx * {THREADS} + tx) // {words * (ow // r) * oh}
                for a in T.unroll({r * oc * 4}):
                    acc[a] = 0
                for ry in T.unroll({kh}):
                    for rx in T.unroll({kw}):
                        for i4 in T.serial({gi // 4}):
                            for q in T.unroll({oc}):
                                for l in T.vectorized(16):
                                    wv[q * 16 + l] = wt[((ry * {kw} + rx) * {gi // 4} + i4) * {cop * 4} + (ob * {oc} + q) * 16 + l]
                            for p in T.unroll({r}):
                                iy = row * {sh} + ry * {dh} - {pt}
                                ix = (col + p) * {sw} + rx * {dw} - {pl}
                                xw[0] = {word}
                                for q in T.unroll({oc}):
                                    for oo in T.unroll(4):
                                        acc[(p * {oc} + q) * 4 + oo] = {mac.format(acc=f"acc[(p * {oc} + q) * 4 + oo]")}
                for p in T.unroll({r}):
                    for q in T.unroll({oc}):
                        for oo in T.unroll(4):
                            yv[oo] = T.Cast("int8", T.max(T.min(T.shift_right(
                                (T.Cast("int64", acc[(p * {oc} + q) * 4 + oo]) + T.Cast("int64", Bias[(ob * {oc} + q) * 4 + oo]))
                                * T.Cast("int64", Mult[(ob * {oc} + q) * 4 + oo])
                                + T.shift_left(T.int64(1), T.Cast("int64", Shift[(ob * {oc} + q) * 4 + oo]) - T.int64(1)),
                                T.Cast("int64", Shift[(ob * {oc} + q) * 4 + oo])), T.int64({wl.act_max})), T.int64({wl.act_min})))
                        for oo in T.vectorized(4):
                            y[((img * {oh} + row) * {ow} + col + p) * {cop} + (ob * {oc} + q) * 4 + oo] = yv[oo]
'''
    return parse_written_kernel(src)
