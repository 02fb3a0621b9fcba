"""The NHWC32 depthwise conv (``depthwise.py``) on CUDA, written out on ``__dp4a``: the taps of one
channel packed four to a word, so one instruction does four of its multiply-adds.

Why: in NHWC each int8x4 word holds one tap of four channels, and the scheduled kernel
(``depthwise.schedule_cuda``) unpacked most bytes and multiply-added them alone (~1,150 PTX
instructions per thread for a 3 x 3 conv of 8 pixels x 4 channels).  EfficientNet-B0's 16 depthwise
convs took 534 of its 1,823 us of kernels at batch 64 on an H200 (~0.75 TB/s against a memory bound
of ~0.12 ms): bound by instruction issue.  Here, per filter row, a thread's input words and filter
words are 4 x 4 byte-transposed with ``__byte_perm`` (8 moves per 4 words), so that one word holds
4 consecutive taps of one channel; a pixel's window is that word, or one more ``__byte_perm`` of two
(a funnel shift) where it starts mid-word; ``__dp4a`` multiply-adds it with the filter's word of the
same taps: ``ceil(kw / 4)`` instructions per (pixel, channel, filter row).  Taps past ``kw`` multiply
filter bytes 0.  ~780 PTX instructions for the case above; measured 534 -> 335 us
(``docs/performance.md``).

Work per thread: one output word (4 channels) of ``R`` consecutive pixels of a row
(``depthwise.row_tile``), as the scheduled kernel; per filter row it loads the
``(R - 1) * stride + kw`` input words the ``R`` pixels read, as int32 (a word out of the image is the
zero point's, as the compute's padding), and the row's ``kw`` filter words once.  The epilogue is the
compute definition's (``requantize.requantize_tir``, the table of ``epilogue_table.py``), so CUDA, the
CPU build and the NumPy reference agree bit for bit.

Takes: a channel multiplier of 1 and no dilation (every depthwise conv of the zoo); indices within
int32.  ``dp4a=False`` writes the byte moves and the four products as integer arithmetic instead of
the intrinsics: the CPU twin the tests run.
"""
from __future__ import annotations

import tvm

from ..kernel import parse_written_kernel
from ..workload import ConvWorkload
from .depthwise import LANES, THREADS, row_tile
from .layout import ceil32, zero_word


# __byte_perm selectors (result byte k = byte (sel >> 4k) & 7 of the pair: x's bytes 0-3, y's 4-7)
INTERLEAVE_LO, INTERLEAVE_HI = 0x5140, 0x7362     # [x0 y0 x1 y1], [x2 y2 x3 y3]
HALVES_LO, HALVES_HI = 0x5410, 0x7632             # [x0 x1 y0 y1], [x2 x3 y2 y3]
FUNNEL = {1: 0x4321, 2: 0x5432, 3: 0x6543}        # bytes o .. o + 3 of the 8-byte pair


class _Ops:
    """The text of the byte moves and dot products: CUDA intrinsics, or their integer twins."""

    def __init__(self, dp4a: bool):
        self.dp4a = dp4a

    def perm(self, x: str, y: str, sel: int) -> str:
        if self.dp4a:
            return f'T.call_pure_extern("int32", "__byte_perm", {x}, {y}, {sel})'
        terms = []
        for k in range(4):
            n = sel >> 4 * k & 7
            src = x if n < 4 else y
            terms.append(f'T.shift_left(T.bitwise_and(T.shift_right(T.Cast("uint32", {src}), T.uint32({8 * (n % 4)})), '
                         f'T.uint32(255)), T.uint32({8 * k}))')
        return 'T.Cast("int32", ' + " | ".join(terms) + ")"

    def dot(self, a: str, b: str, c: str) -> str:
        if self.dp4a:
            return f'T.call_pure_extern("int32", "__dp4a", {a}, {b}, {c})'
        def sbyte(x, k):
            return f'T.Cast("int32", T.Cast("int8", T.shift_right({x}, {8 * k})))'
        return c + "".join(f" + {sbyte(a, k)} * {sbyte(b, k)}" for k in range(4))


def _transpose(ops: _Ops, src: str, dst: str, groups: int, indent: str) -> list[str]:
    """Lines that turn words ``src[4g .. 4g + 3]`` (4 channels each) into ``dst[j * groups + g]``:
    byte ``t`` of channel ``j``'s word is byte ``j`` of ``src[4g + t]`` (a 4 x 4 byte transpose,
    8 byte moves per group)."""
    lines = []
    for g in range(groups):
        w = [f"{src}[{4 * g + t}]" for t in range(4)]
        lines += [f"{indent}s0 = {ops.perm(w[0], w[1], INTERLEAVE_LO)}", f"{indent}s1 = {ops.perm(w[0], w[1], INTERLEAVE_HI)}",
                  f"{indent}s2 = {ops.perm(w[2], w[3], INTERLEAVE_LO)}", f"{indent}s3 = {ops.perm(w[2], w[3], INTERLEAVE_HI)}"]
        for j, (a, b, sel) in enumerate([("s0", "s2", HALVES_LO), ("s0", "s2", HALVES_HI),
                                         ("s1", "s3", HALVES_LO), ("s1", "s3", HALVES_HI)]):
            lines.append(f"{indent}{dst}[{j * groups + g}] = {ops.perm(a, b, sel)}")
    return lines


def accumulate(wl: ConvWorkload, ops: _Ops, r: int, ind: str) -> tuple[list[str], int, int]:
    """``(lines, groups, parts)``: the TVMScript lines that add the taps of output word ``v`` (4
    channels) of the ``r`` pixels ``ox .. ox + r - 1`` of output row ``oy`` of image ``b`` into
    ``acc[i * 4 + j]`` (module docstring), with the local buffers' sizes: ``xw`` / ``xt`` hold
    ``4 * groups`` words, ``ww`` / ``wt`` ``4 * parts``; ``a``, ``wf`` are the input's and filter's
    int32 views."""
    h, w, cp = wl.height, wl.width, ceil32(wl.in_channels)
    (kh, kw), (sh, sw) = wl.kernel, wl.stride
    pt, pl = wl.padding[0], wl.padding[1]
    words = cp // LANES
    span = (r - 1) * sw + kw             # input words one filter row of R pixels reads
    parts = -(-kw // 4)                  # P: dp4a words per filter row
    groups = -(-((r - 1) * sw + 4 * parts) // 4)   # transposed words per channel: every window's bytes
    zero = zero_word(wl.in_zero)
    body = []
    for ry in range(kh):
        body.append(f"{ind}iy = oy * {sh} - {pt} + {ry}")
        # the row's input words, the zero point's outside the image; words past the span 0
        for i in range(4 * groups):
            if i < span:
                body += [f"{ind}ix = ox * {sw} - {pl} + {i}",
                         f"{ind}xw[{i}] = T.if_then_else(0 <= iy and iy < {h} and 0 <= ix and ix < {w}, "
                         f"a[((b * {h} + iy) * {w} + ix) * {words} + v], {zero})"]
            else:
                body.append(f"{ind}xw[{i}] = 0")
        # the row's filter words (taps past kw 0: they multiply whatever the window holds there)
        for i in range(4 * parts):
            body.append(f"{ind}ww[{i}] = " + (f"wf[({ry} * {kw} + {i}) * {words} + v]" if i < kw else "0"))
        body += _transpose(ops, "xw", "xt", groups, ind)
        body += _transpose(ops, "ww", "wt", parts, ind)
        for i in range(r):
            for j in range(LANES):
                for p in range(parts):
                    o = i * sw + 4 * p           # the window's first byte in channel j's stream
                    g, off = divmod(o, 4)
                    win = f"xt[{j * groups + g}]"
                    if off:    # through an int register: __byte_perm is unsigned, and TVM's CUDA
                        # header declares an unsigned __dp4a overload it does not define on the device
                        body.append(f"{ind}wn[0] = " + ops.perm(win, f"xt[{j * groups + g + 1}]", FUNNEL[off]))
                        win = "wn[0]"
                    body.append(f"{ind}acc[{i * LANES + j}] = "
                                + ops.dot(win, f"wt[{j * parts + p}]", f"acc[{i * LANES + j}]"))
    return body, groups, parts


def depthwise_dp4a_kernel(wl: ConvWorkload, dp4a: bool = True) -> tvm.tirx.PrimFunc | None:
    """The kernel for ``wl`` with the compute's arguments ``(A, W, Bias, Mult, Shift[, Table], Out)``,
    or None where it does not apply (module docstring)."""
    if not wl.is_depthwise or wl.out_channels != wl.in_channels or wl.dilation != (1, 1):
        return None
    n, h, w, cp = wl.batch, wl.height, wl.width, ceil32(wl.in_channels)
    oh, ow = wl.out_height, wl.out_width
    kh, kw = wl.kernel
    if n * max(h * w, oh * ow) * cp >= 2 ** 31:
        return None
    ops = _Ops(dp4a)
    r = row_tile(wl)
    words = cp // LANES                  # V: output words of a pixel
    threads = n * oh * (ow // r) * words
    blocks = -(-threads // THREADS)
    body, groups, parts = accumulate(wl, ops, r, " " * 16)
    body = "\n".join(body)

    table_param = 'Table: T.Buffer((256,), "int8"), ' if wl.table else ""
    value = (f'T.max(T.min(T.shift_right((T.Cast("int64", acc[i * {LANES} + j]) + T.Cast("int64", bv[j])) '
             f'* T.Cast("int64", mv[j]) + T.shift_left(T.int64(1), T.Cast("int64", sv[j]) - T.int64(1)), '
             f'T.Cast("int64", sv[j])), T.int64({wl.act_max})), T.int64({wl.act_min}))')
    store = f'T.Cast("int8", {value})'
    if wl.table:   # epilogue_table.finish: the table's entry, 0 on the padded channels
        store = (f'T.if_then_else(v * {LANES} + j < {wl.out_channels}, '
                 f'Table[T.Cast("int32", T.Cast("int8", {value})) + 128], T.int8(0))')
    src = f'''
@T.prim_func(private=True)
def main(A: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16), W: T.Buffer(({kh}, {kw}, {cp}), "int8", align=16),
         Bias: T.Buffer(({cp},), "int32"), Mult: T.Buffer(({cp},), "int32"), Shift: T.Buffer(({cp},), "int32"),
         {table_param}Out: T.Buffer(({n}, {oh}, {ow}, {cp}), "int8", align=16)):
    T.func_attr({{"tir.noalias": True}})
    a = T.decl_buffer(({n * h * w * words},), "int32", data=A.data, align=16)
    wf = T.decl_buffer(({kh * kw * words},), "int32", data=W.data, align=16)
    y = T.decl_buffer(({n * oh * ow * cp},), "int8", data=Out.data, align=16)
    for bx in T.thread_binding({blocks}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            acc = T.alloc_buffer(({r * LANES},), "int32", scope="local")
            xw = T.alloc_buffer(({4 * groups},), "int32", scope="local")
            ww = T.alloc_buffer(({4 * parts},), "int32", scope="local")
            xt = T.alloc_buffer(({LANES * groups},), "int32", scope="local")
            wt = T.alloc_buffer(({LANES * parts},), "int32", scope="local")
            wn = T.alloc_buffer((1,), "int32", scope="local")
            bv = T.alloc_buffer(({LANES},), "int32", scope="local")
            mv = T.alloc_buffer(({LANES},), "int32", scope="local")
            sv = T.alloc_buffer(({LANES},), "int32", scope="local")
            yv = T.alloc_buffer(({LANES},), "int8", scope="local")
            if bx * {THREADS} + tx < {threads}:
                v = (bx * {THREADS} + tx) % {words}
                px = (bx * {THREADS} + tx) // {words}       # pixel run: (image, output row, R pixels)
                oy = px // {ow // r} % {oh}
                ox = px % {ow // r} * {r}
                b = px // {(ow // r) * oh}
                for i in T.unroll({r * LANES}):
                    acc[i] = 0
{body}
                for l in T.vectorized({LANES}):
                    bv[l] = Bias[v * {LANES} + l]
                    mv[l] = Mult[v * {LANES} + l]
                    sv[l] = Shift[v * {LANES} + l]
                for i in T.unroll({r}):
                    for j in T.unroll({LANES}):
                        yv[j] = {store}
                    for l in T.vectorized({LANES}):
                        y[((b * {oh} + oy) * {ow} + ox + i) * {cp} + v * {LANES} + l] = yv[l]
'''
    return parse_written_kernel(src)
