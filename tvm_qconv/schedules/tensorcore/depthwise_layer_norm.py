"""The NHWC32 depthwise conv with the LayerNorm after it in one kernel (ConvNeXt's block: a 7 x 7
depthwise conv, then a LayerNorm over each pixel's channels), written out on ``__dp4a``.

Why: ConvNeXt-T at batch 1 on an H200 (2026-11-28, ``docs/performance.md``) ran 18 depthwise and
23 LayerNorm kernels of 2-6 us each, every one latency-bound, plus a ~1.2 us gap per launch under a
CUDA graph: the LayerNorms took 69 of 432 us of kernels.  Fused, the LayerNorm reads the conv's
int8 output from shared memory: one launch and one round trip of the map fewer per block.

A block takes ``P`` consecutive output pixels (:func:`pixels_per_block`), a thread one output word
(4 channels) of one pixel, in three phases (separate thread loops: TVM puts a barrier between them,
and the CPU twin runs them one after the other):

1. the depthwise conv of its word as ``depthwise_dp4a.py`` computes it (one pixel a thread), its
   requantized int8 word into shared memory;
2. one thread per pixel sums that pixel's bytes and their squares over the real channels
   (``__dp4a`` with ones and with itself: exact int32) and takes the row factor ``M``;
3. every thread normalizes its word with them and stores it.

The integers are ``layer_norm_int8.py``'s (its module docstring: ``d = C q - S1``, ``t = d M >> 20``,
``y = t G + B >> 36``), so the fused kernel computes what the depthwise kernel and the LayerNorm
kernel compute one after the other, bit for bit.  Takes what ``depthwise_dp4a.py`` takes, channels
a multiple of 4, where that kernel would take one pixel a thread (:func:`takes`: batch 1, not 64).
``dp4a=False``: the CPU twin the tests run.
"""
from __future__ import annotations

import tvm

from ..kernel import parse_written_kernel
from ..layer_norm_int8 import NORM_BITS, OUT_SHIFT, ROW_BITS
from ..workload import ConvWorkload
from .depthwise import LANES, row_tile
from .depthwise_dp4a import _Ops, accumulate
from .layout import ceil32

MAX_THREADS = 256   # a block: as many whole pixels as fit (one pixel of 1,024 channels: 256 threads)
MAX_UNROLL = 256    # a pixel's words summed by one thread, unrolled up to this many (ConvNeXt's 192: 768 channels)


def pixels_per_block(wl: ConvWorkload) -> int:
    """``P``: the pixels of a block, as many as :data:`MAX_THREADS` threads of one word each hold."""
    return max(1, MAX_THREADS // (ceil32(wl.out_channels) // LANES))


def takes(wl: ConvWorkload) -> bool:
    """Where the unfused depthwise kernel takes one pixel a thread too (``depthwise.row_tile``: a grid
    too small for more, as at batch 1), so the fused kernel does the same conv work: at batch 64 that
    kernel's 8 pixels a thread share their input words, and the LayerNorm kernel alone runs at memory
    speed (ConvNeXt-T's batch-64 build keeps the two)."""
    return (row_tile(wl) == 1 and wl.is_depthwise and wl.out_channels == wl.in_channels and wl.dilation == (1, 1)
            and wl.out_channels % LANES == 0 and ceil32(wl.out_channels) // LANES <= 1024
            and wl.batch * max(wl.height * wl.width, wl.out_height * wl.out_width) * ceil32(wl.in_channels) < 2 ** 31)


def depthwise_layer_norm_kernel(wl: ConvWorkload, dp4a: bool = True) -> tvm.tirx.PrimFunc | None:
    """The kernel for ``wl`` (``wl.norm``) with the compute's arguments ``(A, W, Bias, Mult, Shift, G, B,
    E, Out)``, or None where it does not apply (module docstring)."""
    if not (wl.norm and takes(wl)):
        return None
    n, h, w, cp = wl.batch, wl.height, wl.width, ceil32(wl.in_channels)
    oh, ow, c = wl.out_height, wl.out_width, wl.out_channels
    kh, kw = wl.kernel
    ops = _Ops(dp4a)
    words, real = cp // LANES, c // LANES          # a pixel's words; those of real channels
    p = pixels_per_block(wl)
    threads, pixels = p * words, n * oh * ow
    blocks = -(-pixels // p)
    body, groups, parts = accumulate(wl, ops, 1, " " * 16)
    body = "\n".join(body)
    lo = -127 if wl.norm[0] == 0 else -128
    value = (f'T.max(T.min(T.shift_right((T.Cast("int64", acc[j]) + T.Cast("int64", Bias[v * {LANES} + j])) '
             f'* T.Cast("int64", Mult[v * {LANES} + j]) + T.shift_left(T.int64(1), '
             f'T.Cast("int64", Shift[v * {LANES} + j]) - T.int64(1)), T.Cast("int64", Shift[v * {LANES} + j])), '
             f'T.int64({wl.act_max})), T.int64({wl.act_min}))')
    sbyte = 'T.Cast("int32", T.Cast("int8", T.shift_right(q[tx], 8 * j)))'   # byte j of the word, signed
    norm = (f'T.max(T.min(T.shift_right(T.shift_right(T.Cast("int64", {c} * {sbyte} - s1[tx // {words}]) '
            f'* rm[tx // {words}], T.int64({ROW_BITS - NORM_BITS})) * G[T.min(v * {LANES} + j, {c - 1})] '
            f'+ B[T.min(v * {LANES} + j, {c - 1})], '
            f'T.int64({OUT_SHIFT})), T.int64(127)), T.int64({lo}))')
    src = f'''
@T.prim_func(private=True)
def main(A: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16), W: T.Buffer(({kh}, {kw}, {cp}), "int8", align=16),
         Bias: T.Buffer(({cp},), "int32"), Mult: T.Buffer(({cp},), "int32"), Shift: T.Buffer(({cp},), "int32"),
         G: T.Buffer(({c},), "int64"), B: T.Buffer(({c},), "int64"), E: T.Buffer((2,), "float64"),
         Out: T.Buffer(({n}, {oh}, {ow}, {cp}), "int8", align=16)):
    T.func_attr({{"tir.noalias": True}})
    a = T.decl_buffer(({n * h * w * words},), "int32", data=A.data, align=16)
    wf = T.decl_buffer(({kh * kw * words},), "int32", data=W.data, align=16)
    y = T.decl_buffer(({n * oh * ow * cp},), "int8", data=Out.data, align=16)
    for bx in T.thread_binding({blocks}, thread="blockIdx.x"):
        q = T.alloc_buffer(({threads},), "int32", scope="shared")     # the conv's int8 words
        # per pixel (at least 2: TVMScript cannot detect the access region of a 1-element buffer here)
        s1 = T.alloc_buffer(({max(p, 2)},), "int32", scope="shared")   # the sum of its bytes
        rm = T.alloc_buffer(({max(p, 2)},), "int64", scope="shared")   # and its row factor M
        for tx in T.thread_binding({threads}, thread="threadIdx.x"):
            acc = T.alloc_buffer(({LANES},), "int32", scope="local")
            xw = T.alloc_buffer(({4 * groups},), "int32", scope="local")
            ww = T.alloc_buffer(({4 * parts},), "int32", scope="local")
            xt = T.alloc_buffer(({LANES * groups},), "int32", scope="local")
            wt = T.alloc_buffer(({LANES * parts},), "int32", scope="local")
            wn = T.alloc_buffer((1,), "int32", scope="local")
            yv = T.alloc_buffer(({LANES},), "int8", scope="local")
            q[tx] = 0
            if bx * {p} + tx // {words} < {pixels}:
                v = tx % {words}
                px = bx * {p} + tx // {words}
                oy = px // {ow} % {oh}
                ox = px % {ow}
                b = px // {ow * oh}
                for i in T.unroll({LANES}):
                    acc[i] = 0
{body}
                for j in T.unroll({LANES}):
                    yv[j] = T.Cast("int8", {value})
                q[tx] = T.bitwise_or(T.bitwise_or(T.bitwise_and(T.Cast("int32", yv[0]), 255),
                                                  T.shift_left(T.bitwise_and(T.Cast("int32", yv[1]), 255), 8)),
                                     T.bitwise_or(T.shift_left(T.bitwise_and(T.Cast("int32", yv[2]), 255), 16),
                                                  T.shift_left(T.Cast("int32", yv[3]), 24)))
        for tx in T.thread_binding({threads}, thread="threadIdx.x"):
            st = T.alloc_buffer((2,), "int32", scope="local")
            one = T.alloc_buffer((1,), "int32", scope="local")    # 0x01010101: a dot product with it sums the bytes
            if tx < {p}:
                st[0] = 0
                st[1] = 0
                one[0] = 16843009
                for k in {"T.unroll" if real <= MAX_UNROLL else "range"}({real}):   # unrolled: the loads overlap
                    st[0] = {ops.dot(f"q[tx * {words} + k]", "one[0]", "st[0]")}
                    st[1] = {ops.dot(f"q[tx * {words} + k]", f"q[tx * {words} + k]", "st[1]")}
                s1[tx] = st[0]
                rm[tx] = T.Cast("int64", T.nearbyint(T.min(T.float64(1.0) / T.sqrt(T.Cast("float64",
                    T.int64({c}) * T.Cast("int64", st[1]) - T.Cast("int64", st[0]) * T.Cast("int64", st[0])) + E[0]),
                    T.float64(1.0)) * E[1]))
        for tx in T.thread_binding({threads}, thread="threadIdx.x"):
            zv = T.alloc_buffer(({LANES},), "int8", scope="local")
            if bx * {p} + tx // {words} < {pixels}:
                v = tx % {words}
                for j in T.unroll({LANES}):
                    zv[j] = T.if_then_else(v < {real}, T.Cast("int8", {norm}), T.int8(0))
                for j in T.vectorized({LANES}):
                    y[(bx * {p} + tx // {words}) * {cp} + v * {LANES} + j] = zv[j]
'''
    return parse_written_kernel(src)
