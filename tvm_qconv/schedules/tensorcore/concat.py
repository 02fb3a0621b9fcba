"""The channel concatenation (``concat_int8.py``) of the NHWC32 layout on CUDA, written out: each
thread takes one 16-channel output vector (one 128-bit store) of up to 8 pixels.

Why: dlight's fallback, which ran it before, gives every output byte a thread that stores it alone
and requantizes it in int64 behind a select per input: at batch 64 on an H200 ShuffleNet-V2's
concatenations ran at ~0.5 TB/s (~20 us for a 3.2 MB output), 43% of its kernel time.

Two kernels, by workload:

* by input (no gather and every input's channels a multiple of 16: GoogLeNet's, Inception's,
  SqueezeNet's, DenseNet's concatenations): an output vector lies in one input, so the grid is split
  by input and the blocks of input ``i`` take its vectors only: a 16-byte load, the 16 bytes
  requantized with its constants, a 16-byte store.  Whole blocks per input, because a warp over
  all the vectors of a few pixels would meet every input and run their code one after the other.
  The output's padded vectors past the last input (144 channels padded to 160) get blocks that
  store 0.
* by lane (a gather -- ShuffleNet-V2's concat -> shuffle -> split piece -- or channels not a
  multiple of 16, ShuffleNet's 58 / 116 / 232): each thread first finds, for each of its 16 lanes,
  the input and the channel in it that the lane reads (through ``index`` for a gather); then per
  pixel it loads each lane's byte (16 byte loads of a pixel row, L1 hits after the first), computes
  every input's requantization of it and keeps the lane's by a mask (no branch: the lanes of a warp
  read different inputs), and stores the 16 bytes as one vector.  Lanes past the output's or the
  inputs' channels are 0.  Every input's requantization per byte is affordable because the inputs
  here are few (ShuffleNet's two, one of them a copy).

On sm_90a (SASS, no spills) a byte costs ~5.5 instructions by input (GoogLeNet's 3a at batch 64)
and ~8 by lane (ShuffleNet's piece), plus ~380 a thread for the lane table: the lane kernel gains
from several pixels a thread.

Grid: thread ``t`` (counted from its input's first block, by input) takes vector ``t % V`` of
pixels ``q, q + Q, ..., q + (P - 1) Q`` with ``q = t // V``, ``Q = pixels / P``, so that a warp
writes consecutive 16-byte runs of consecutive pixel rows.  ``P`` is the largest divisor of the
pixel count up to the affine's ``pixels_per_thread`` (a small batch keeps enough threads): no pixel
is out of range, so a thread's loads go out together, unguarded.

The integers are the compute definition's, so CUDA and CPU agree bit for bit: each input's
``requantize_tir(q - z_i, m_i, s_i, lo, 127, zero=z_out)``, rewritten so that every int8 ``q``
gives the same result (:func:`requantize`): the factors of two of ``m_i`` cancelled against
``s_i``, both zero points folded into the rounding addend, int32 where the product fits, else one
32 x 32-bit product's high word; a clamp side the value cannot reach left out.  An input already
at the output's scale and zero point becomes a copy.

Takes: indices within int32, shifts 1..62 and multipliers below about 2**22.  Anything else keeps
dlight's kernel.
"""
from __future__ import annotations

import tvm

from ..kernel import parse_written_kernel
from ..requantize import QMIN
from ..workload import ConcatWorkload
from .affine import THREADS, VEC, pixels_per_thread
from .layout import ceil32


def requantize(x: str, mult: int, shift: int, zero: int, out_zero: int) -> str | None:
    """TVMScript of ``requantize_tir(x - zero, mult, shift, lo, 127, zero=out_zero)`` for an int8
    expression ``x``, as the int32 ``clip((x * m + a) >> s)`` with the same result for every int8
    ``x``; None outside shifts 1..62 and for multipliers of about 2**22 and more (no two int8 scales
    give one)."""
    if not 1 <= shift <= 62:
        return None
    lo = QMIN if out_zero == 0 else -128
    while mult % 2 == 0 and shift:      # (v * 2m + 2**s) >> (s + 1) == (v * m + 2**(s - 1)) >> s
        mult, shift = mult // 2, shift - 1
    # ((x - zero) * m + 2**(s - 1)) >> s, then + out_zero: both zero points folded into the addend
    add = (1 << (shift - 1) if shift else 0) - zero * mult + (out_zero << shift)
    sums = [q * mult + add for q in (-128, 127)]        # the extremes: linear in x
    if max(map(abs, sums)) < 2 ** 31:
        value = f'T.shift_right(T.Cast("int32", {x}) * {mult} + {add}, {shift})'
    else:
        # int64, x + 128 (>= 0: a shift C defines) scaled by 2**d so that the shift is 32 or more:
        # the result is the high word of one 32 x 32-bit product (IMAD.HI); for shifts of 9 or more
        # (x + 128) << d fits int32 and the result, at most 2**39 >> 9, too
        d = max(0, 32 - shift)
        if shift < 9 or max(map(abs, sums)) << d >= 2 ** 63:
            return None
        value = (f'T.Cast("int32", T.shift_right(T.Cast("int64", T.shift_left(T.Cast("int32", {x}) + 128, {d}))'
                 f' * T.int64({mult}) + T.int64({(add - 128 * mult) << d}), T.int64({shift + d})))')
    low, high = sorted(v >> shift for v in sums)
    if high > 127:          # the clamp, less a side the value never reaches
        value = f"T.min({value}, 127)"
    if low < lo:
        value = f"T.max({value}, {lo})"
    return value


def concat_kernel(wl: ConcatWorkload) -> tvm.tirx.PrimFunc | None:
    """The kernel for ``wl``, parameters as the compute definition's (``X0 .. Xk, [index], Out``,
    NHWC32 ``[N, H, W, C_p]``), or None where it does not apply (module docstring)."""
    n, h, w = wl.shape
    pixels = n * h * w
    rows = [ceil32(c) for c in wl.channels]
    cp = ceil32(wl.gather or sum(wl.channels))
    zeros = wl.zeros or (0,) * len(wl.channels)
    rqs = [requantize("{x}", m, s, z, wl.out_zero) for m, s, z in zip(wl.mults, wl.shifts, zeros)]
    if None in rqs or pixels * max(cp, *rows) >= 2 ** 31:
        return None
    by_input = not wl.gather and all(c % VEC == 0 for c in wl.channels)
    body = (_by_input if by_input else _by_lane)(wl, pixels, rows, cp, rqs)
    params = [f'X{i}: T.Buffer(({n}, {h}, {w}, {row}), "int8", align=16)' for i, row in enumerate(rows)]
    params += [f'index: T.Buffer(({wl.gather},), "int32")'] * bool(wl.gather)
    params += [f'Out: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16)']
    flat = [f'x{i} = T.decl_buffer(({pixels * row},), "int8", data=X{i}.data, align=16)' for i, row in enumerate(rows)]
    flat += [f'y = T.decl_buffer(({pixels * cp},), "int8", data=Out.data, align=16)']
    params, flat = ",\n         ".join(params), "\n    ".join(flat)
    return parse_written_kernel(f'''
@T.prim_func(private=True)
def main({params}):
    T.func_attr({{"tir.noalias": True}})
    {flat}
{body}''')


def grid(pixels: int, vectors: int) -> tuple[int, int]:
    """(P, Q): pixels a thread, a divisor of ``pixels``, and pixel groups (a thread's pixels
    ``q + j * Q``)."""
    p = max(d for d in range(1, pixels_per_thread(vectors * pixels) + 1) if pixels % d == 0)
    return p, pixels // p


def _by_input(wl: ConcatWorkload, pixels: int, rows: list[int], cp: int, rqs: list[str]) -> str:
    """The body of the kernel by input: the blocks of each input, then those of the output's padding."""
    p, groups = grid(pixels, cp // VEC)
    # runs of output vectors: (vectors, the first one, the lines that fill yv with vector v of pixel px)
    runs, start = [], 0
    for i, (c, row, rq) in enumerate(zip(wl.channels, rows, rqs)):
        runs.append((c // VEC, start, [f"for l in T.vectorized({VEC}):",
                                       f"    xv[l] = x{i}[px * {row} + v * {VEC} + l]",
                                       f"for l in T.unroll({VEC}):",
                                       f"    yv[l] = T.Cast(\"int8\", {rq.format(x='xv[l]')})"]))
        start += c // VEC
    if start < cp // VEC:     # stored byte by byte: a vectorized int8 constant prints as a make_int4 of 16 values
        runs.append((cp // VEC - start, start, [f"for l in T.unroll({VEC}):", "    yv[l] = T.int8(0)"]))
    chain, first = [], 0
    for k, (vectors, start, fill) in enumerate(runs):
        blocks = -(-vectors * groups // THREADS)
        t = f"(bx - {first}) * {THREADS} + tx"
        test = "else:" if k and k == len(runs) - 1 else f"{'elif' if k else 'if'} bx < {first + blocks}:"
        chain += [test,
                  f"    if {t} < {vectors * groups}:",
                  f"        v = ({t}) % {vectors}",
                  f"        q = ({t}) // {vectors}",
                  f"        for j in T.unroll({p}):",
                  f"            px = q + j * {groups}"]
        chain += [f"            {line}" for line in fill]
        chain += [f"            for l in T.vectorized({VEC}):",
                  f"                y[px * {cp} + ({start} + v) * {VEC} + l] = yv[l]"]
        first += blocks
    chain = "\n".join(" " * 12 + line for line in chain)
    return f'''    for bx in T.thread_binding({first}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            xv = T.alloc_buffer(({VEC},), "int8", scope="local")
            yv = T.alloc_buffer(({VEC},), "int8", scope="local")
{chain}
'''


def _by_lane(wl: ConcatWorkload, pixels: int, rows: list[int], cp: int, rqs: list[str]) -> str:
    """The body of the kernel by lane: each lane's input and channel in it, then per pixel its byte."""
    vectors = cp // VEC
    p, groups = grid(pixels, vectors)
    threads = vectors * groups
    k, total = len(rows), sum(wl.channels)
    ends = [sum(wl.channels[:i + 1]) for i in range(k)]
    # the lane's concatenated channel: ``total`` (no input's) past the output's channels; a gather's
    # index clamped to 0..total, as the compute reads input 0 below 0 and gives 0 past the inputs
    channel = f"T.min(v * {VEC} + l, {total})"
    if wl.gather:
        picked = f"T.max(T.min(index[v * {VEC} + l], {total}), 0)"
        channel = f"T.if_then_else(v * {VEC} + l < {wl.gather}, {picked}, {total})"
    # from it, with no branch: the lane's input s (k: none) and its channel o there (0 for none)
    source = " + ".join(f'T.Cast("int32", cc >= {e})' for e in ends)
    start = " + ".join(f"T.if_then_else(cc >= {e}, {c}, 0)" for e, c in zip(ends, wl.channels))
    # per pixel: the lane's byte from its input (none: byte 0 of the last input's row), then every
    # input's requantization of it, masked to the lane's input's (none: 0)
    load = f"x{k - 1}[px * {rows[-1]} + o[l]]"
    for i in reversed(range(k - 1)):
        load = f"T.if_then_else(s[l] == {i}, x{i}[px * {rows[i]} + o[l]], {load})"
    value = " | ".join(f"({rq.format(x='xb[l]')} & (0 - T.Cast(\"int32\", s[l] == {i})))" for i, rq in enumerate(rqs))
    return f'''    for bx in T.thread_binding({-(-threads // THREADS)}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            s = T.alloc_buffer(({VEC},), "int32", scope="local")
            o = T.alloc_buffer(({VEC},), "int32", scope="local")
            xb = T.alloc_buffer(({VEC},), "int8", scope="local")
            yv = T.alloc_buffer(({VEC},), "int8", scope="local")
            if bx * {THREADS} + tx < {threads}:
                v = (bx * {THREADS} + tx) % {vectors}
                q = (bx * {THREADS} + tx) // {vectors}
                for l in T.unroll({VEC}):
                    cc = {channel}
                    s[l] = {source}
                    o[l] = cc - ({start})
                for j in T.unroll({p}):
                    px = q + j * {groups}
                    for l in T.unroll({VEC}):
                        xb[l] = {load}
                    for l in T.unroll({VEC}):
                        yv[l] = T.Cast("int8", {value})
                    for l in T.vectorized({VEC}):
                        y[px * {cp} + v * {VEC} + l] = yv[l]
'''
