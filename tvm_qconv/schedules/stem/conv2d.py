"""A network's first conv (at most 4 input channels: the image) on int8 tensor cores
(``mma.sync.m16n8k32``), from the input as the quantizer packs it (NCHW4c: for C <= 4,
``[N, 1, H, W, 4]``, one int32 per pixel) straight into NHWC32, the tensor-core families' layout.

Why its own kernel: the tensor-core templates pad the input channels to 32 for one K step (VGG16's
first conv would do 10x the multiply-adds), and the dp4a family's NCHW4c output would have to be
converted for the next layer (on an H100 at batch 64 VGG16's first conv took 0.44 ms and that
conversion 0.78 ms, ``docs/history.md``).  Here the GEMM's K axis is ``(tap, 4 channels)``, so
one 32-bit register of mma's A fragment -- 4 consecutive K bytes of one row -- is exactly one
input pixel's word under one tap: the implicit-GEMM gather is one 32-bit load per register, from
L1 / L2, with no shared-memory staging and no im2col.  K is padded only to 8 taps (VGG16: 9 taps
-> 16, ResNet's 7x7: 49 -> 56).  The first version of this kernel ran the same gather on
``__dp4a`` (4 pixels x 16 channels per thread): 0.497 ms for VGG16's first conv at batch 64, 22
TOPS, issue-bound on the integer pipe.

The kernel (hand-written TIRx, no search space)::

    warp tile   = 16*MT output pixels (rows of the GEMM) x CN output channels (CN = 64, or 32
                  where O_p is not a multiple of 64), MT*CN/8 m16n8 accumulators (64 int32)
    for each K step (8 taps):
        B: CN/8 fragments (2 words each) from shared memory, stored in fragment order at
           build time (``pack_weight``): one conflict-free 8-byte load per fragment
        A: per m16 tile 4 words, each one pixel under one tap (0 in the padding)
        MT x CN/8 ``mma.sync.m16n8k32.s8``
    epilogue:   bias, fixed-point requantize, clamp (``requantize_tir``, in its 32-bit form
                ``requantize_tir_i32`` when every channel allows it); the GEMM's columns
                are permuted at pack time so that a thread's accumulators of one row are CN/4
                *consecutive* channels: one 16-byte (CN = 64) or 8-byte store per row

Warps stride over the warp tiles (a grid of at most 4 blocks per SM), so each block copies the
weights (``KS*8 x O_p`` words: 4 KB for VGG16, 14 KB for ResNet's 7x7) into shared memory once.
Cost model, VGG16's first conv at batch 64: 3.2 M pixels x 16 taps x 64 channels x 4 = 13 G
multiply-adds, 27 us at the H100's measured mma.sync peak; its output, 205 MB, takes 70 us at
3 TB/s, so the kernel is bound by its stores.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .. import epilogue_table
from ..requantize import requantize_i32_ok, requantize_ref, requantize_tir, requantize_tir_i32
from ..tensorcore.layout import ceil32
from ..workload import ConvWorkload

KERNEL_NAME = "conv2d_stem_int8"
MAX_IN_CHANNELS = 4      # one int32 word per pixel
TAPS_PER_STEP = 8        # one mma K step: 32 bytes = 8 words
WARPS = 4                # per block
BLOCKS_PER_SM = 4        # the grid, at most (warps stride over the tiles)
SMEM_BYTES = 48 * 1024   # the weights, in static shared memory
MMA_SRC = ('__device__ __forceinline__ void qconv_mma_s8(int& d0, int& d1, int& d2, int& d3, int a0, int a1, '
           'int a2, int a3, int b0, int b1) { asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 '
           '{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3) '
           ': "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1)); }')


def k_steps(taps: int) -> int:
    """mma K steps of a kernel of ``taps`` taps, 8 per step."""
    return -(-taps // TAPS_PER_STEP)


def tile_channels(op: int) -> int:
    """CN, the output channels of a warp tile, for ``op`` (padded) output channels: 64 where
    ``op`` allows it, else 32."""
    return 64 if op % 64 == 0 else 32


def supports(wl: ConvWorkload) -> bool:
    """An int8-out, ungrouped conv of at most 4 input channels whose weights fit in shared memory,
    of a symmetric input (the image's: its padding is 0)."""
    return (wl.groups == 1 and wl.out_dtype == "int8" and wl.in_channels <= MAX_IN_CHANNELS and not wl.in_zero
            and k_steps(wl.kernel[0] * wl.kernel[1]) * TAPS_PER_STEP * ceil32(wl.out_channels) * 4 <= SMEM_BYTES)


def _fragment_index(ks: int, op: int, cn: int):
    """For the packed weight's axes ``[KS, O_p/CN, CN/8, 32 lanes, 2 registers]``: the tap and the
    output channel each word holds.  Lane ``g*4 + t`` holds B's column ``g`` and K words ``t`` /
    ``t + 4`` (registers 0 / 1) of an m16n8k32 fragment; column ``g`` of n-tile ``j`` is channel
    ``(g // 2) * CN/4 + 2j + g % 2`` of the tile, so that the accumulator columns ``2t, 2t + 1`` of
    all n-tiles are the CN/4 consecutive channels from ``t * CN/4``."""
    k, c, j, lane, r = np.meshgrid(np.arange(ks), np.arange(op // cn), np.arange(cn // 8), np.arange(32),
                                   np.arange(2), indexing="ij")
    g, t = lane // 4, lane % 4
    return k * TAPS_PER_STEP + t + 4 * r, c * cn + g // 2 * (cn // 4) + 2 * j + g % 2


def pack_weight(w: np.ndarray) -> np.ndarray:
    """OIHW int8 ``[O, C <= 4, KH, KW]`` -> int8 ``[KS, O_p/CN, CN/8, 32, 2, 4]``: mma B fragments
    in the order the warps load them (:func:`_fragment_index`); padded taps and channels 0."""
    o, c, kh, kw = w.shape
    assert c <= MAX_IN_CHANNELS, w.shape
    ks, op = k_steps(kh * kw), ceil32(o)
    cn = tile_channels(op)
    full = np.zeros((ks * TAPS_PER_STEP, op, 4), np.int8)
    full[:kh * kw, :o, :c] = w.transpose(2, 3, 0, 1).reshape(kh * kw, o, c)
    tap, ch = _fragment_index(ks, op, cn)
    return np.ascontiguousarray(full[tap, ch])


def unpack_weight(packed: np.ndarray, out_channels: int, in_channels: int, kernel) -> np.ndarray:
    """Inverse of :func:`pack_weight`: OIHW ``[O, C, KH, KW]``."""
    ks, chunks, ntc = packed.shape[:3]
    cn = ntc * 8
    op = chunks * cn
    tap, ch = _fragment_index(ks, op, cn)
    full = np.zeros((ks * TAPS_PER_STEP, op, 4), np.int8)
    full[tap, ch] = packed
    taps = kernel[0] * kernel[1]
    return np.ascontiguousarray(full[:taps, :out_channels, :in_channels].reshape(*kernel, out_channels, in_channels)
                                .transpose(2, 3, 0, 1))


def conv2d_stem_ref(wl: ConvWorkload, data, weight, bias, mult, shift) -> np.ndarray:
    """NumPy reference on the packed layouts: int8 ``[N, OH, OW, O_p]`` (NHWC32).  float64
    accumulation is exact: at most 49 x 4 int8 products per output."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    x = data[:, 0].astype(np.float64)                                   # [N, H, W, 4]
    op = ceil32(wl.out_channels)
    w = unpack_weight(weight, op, 4, wl.kernel).astype(np.float64)      # [O_p, 4, KH, KW]
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    acc = np.zeros((x.shape[0], oh, ow, op), np.float64)
    for y in range(kh):
        for z in range(kw):
            win = xp[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, z * dw: z * dw + (ow - 1) * sw + 1: sw, :]
            acc += win @ w[:, :, y, z].T
    return requantize_ref(acc.astype(np.int64) + bias.astype(np.int64), mult, shift, wl.act_min, wl.act_max)


def conv2d_stem_compute(wl: ConvWorkload) -> tirx.PrimFunc:
    """The unscheduled definition (runs on llvm: the tests check it against the reference and
    the CUDA kernel against both): ``(data [N,1,H,W,4], weight [KS,O_p/CN,CN/8,32,2,4], bias,
    mult, shift, out)``."""
    assert supports(wl), wl
    N, H, W = wl.batch, wl.height, wl.width
    OH, OW, OP = wl.out_height, wl.out_width, ceil32(wl.out_channels)
    KH, KW = wl.kernel
    SH, SW = wl.stride
    DH, DW = wl.dilation
    PT, PL = wl.padding[:2]
    KS, CN = k_steps(KH * KW), tile_channels(OP)
    Q = CN // 4                                      # consecutive channels of one lane
    LO, HI = wl.act_min, wl.act_max
    LUT = epilogue_table.script_table(wl)            # wl.table: the function after the conv (epilogue_table.py)

    # the table's buffer becomes a parameter after parsing (with_table_param): not well-formed before
    @T.prim_func(s_tir=True, check_well_formed=LUT is None)
    def main(data: T.Buffer((N, 1, H, W, 4), "int8"), weight: T.Buffer((KS, OP // CN, CN // 8, 32, 2, 4), "int8"),
             bias: T.Buffer((OP,), "int32"), mult: T.Buffer((OP,), "int32"), shift: T.Buffer((OP,), "int32"),
             out: T.Buffer((N, OH, OW, OP), "int8")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        with T.sblock("root"):
            acc = T.sblock_alloc_buffer((N, OH, OW, OP), "int32")
            for n, y, x, o, t, c in T.grid(N, OH, OW, OP, KH * KW, 4):
                with T.sblock("conv"):
                    vn, vy, vx, vo, vt, vc = T.axis.remap("SSSSRR", [n, y, x, o, t, c])
                    h = T.meta_var(vy * SH + vt // KW * DH - PT)
                    w = T.meta_var(vx * SW + vt % KW * DW - PL)
                    r = T.meta_var(vo % CN)
                    with T.init():
                        acc[vn, vy, vx, vo] = 0
                    acc[vn, vy, vx, vo] = acc[vn, vy, vx, vo] + T.Cast("int32", T.if_then_else(
                        0 <= h and h < H and 0 <= w and w < W, data[vn, 0, h, w, vc], T.int8(0))) * T.Cast(
                        "int32", weight[vt // 8, vo // CN, r % Q // 2, (r // Q * 2 + r % 2) * 4 + vt % 4,
                                        vt % 8 // 4, vc])
            for n, y, x, o in T.grid(N, OH, OW, OP):
                with T.sblock("requant"):
                    vn, vy, vx, vo = T.axis.remap("SSSS", [n, y, x, o])
                    out[vn, vy, vx, vo] = epilogue_table.finish(requantize_tir(
                        T.Cast("int64", acc[vn, vy, vx, vo]) + T.Cast("int64", bias[vo]), mult[vo], shift[vo], LO, HI),
                        vo, LUT, wl.out_channels)

    return epilogue_table.with_table_param(main, LUT).with_attr({"tvm_qconv.kernel": KERNEL_NAME})


def conv2d_stem(wl: ConvWorkload, num_sm: int) -> tirx.PrimFunc:
    """The CUDA kernel (TIRx; module docstring) for a GPU of ``num_sm`` SMs, same arguments as
    :func:`conv2d_stem_compute`."""
    assert supports(wl), wl
    N, H, W = wl.batch, wl.height, wl.width
    OH, OW, OP = wl.out_height, wl.out_width, ceil32(wl.out_channels)
    KH, KW = wl.kernel
    TAPS = KH * KW
    KS, CN = k_steps(TAPS), tile_channels(OP)
    NTC = CN // 8                             # n8 tiles of a warp tile
    Q = CN // 4                               # consecutive channels of one lane, per row
    CHUNKS = OP // CN
    PX = N * OH * OW                          # GEMM rows
    MT = 128 // CN                            # m16 tiles of a warp tile: 64 accumulators
    while MT > 1 and -(-PX // (16 * MT)) * CHUNKS < 2 * WARPS * num_sm:
        MT //= 2                              # small layers (batch 1): smaller tiles, more warps busy
    TILES = -(-PX // (16 * MT)) * CHUNKS
    GRID = min(-(-TILES // WARPS), BLOCKS_PER_SM * num_sm)
    ITERS = -(-TILES // (GRID * WARPS))
    NT = WARPS * 32
    WORDS = KS * TAPS_PER_STEP * OP
    NACC = MT * NTC * 4
    LO, HI = wl.act_min, wl.act_max
    LUT = epilogue_table.script_table(wl)

    @T.prim_func(private=True, check_well_formed=LUT is None)
    def main(data: T.Buffer((N, 1, H, W, 4), "int8", align=4),
             weight: T.Buffer((KS, CHUNKS, NTC, 32, 2, 4), "int8", align=16),
             bias: T.Buffer((OP,), "int32"), mult: T.Buffer((OP,), "int32"), shift: T.Buffer((OP,), "int32"),
             out: T.Buffer((N, OH, OW, OP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        T.device_entry()
        cta = T.cta_id([GRID])
        tid = T.thread_id([NT])
        pixels = T.decl_buffer((N * H * W,), "int32", data=data.data)
        words = T.decl_buffer((WORDS,), "int32", data=weight.data)
        out32 = T.decl_buffer((N * OH * OW * OP // 4,), "uint32", data=out.data)
        w_s = T.alloc_buffer((WORDS,), "int32", scope="shared", align=16)
        acc = T.alloc_buffer((NACC,), "int32", scope="local")
        a = T.alloc_buffer((4,), "int32", scope="local")
        b = T.alloc_buffer((NTC * 2,), "int32", scope="local")
        base = T.alloc_buffer((2 * MT,), "int32", scope="local")     # image n's first word
        ry = T.alloc_buffer((2 * MT,), "int32", scope="local")       # input row of tap (0, 0)
        rx = T.alloc_buffer((2 * MT,), "int32", scope="local")       # input column of tap (0, 0)
        packed = T.alloc_buffer((2 * MT * Q // 4,), "uint32", scope="local", align=16)   # a row's bytes
        ok = T.alloc_buffer((2,), "int32", scope="local")
        for i in T.serial((WORDS + NT - 1) // NT):
            if i * NT + tid < WORDS:
                w_s[i * NT + tid] = words[i * NT + tid]
        # 1 where every channel takes the 32-bit requantize: block-uniform, so the epilogue's two
        # forms below never diverge (the barrier also publishes w_s)
        ok[0] = 1
        for i in T.serial((OP + NT - 1) // NT):
            if i * NT + tid < OP:
                if not requantize_i32_ok(bias[i * NT + tid], shift[i * NT + tid]):
                    ok[0] = 0
        ok[1] = T.call_extern("int32", "__syncthreads_and", ok[0])
        lane = T.meta_var(tid % 32)
        g = T.meta_var(tid % 32 // 4)
        t4 = T.meta_var(tid % 4)
        for it in T.serial(ITERS):
            tile = T.meta_var((it * GRID + cta) * WARPS + tid // 32)
            if tile < TILES:                                         # warp-uniform
                p0 = T.meta_var(tile // CHUNKS * (16 * MT))
                c = T.meta_var(tile % CHUNKS)
                # the 2*MT rows (pixels) of this lane: g and g + 8 of each m16 tile
                for i in T.unroll(2 * MT):
                    pix = T.meta_var(p0 + i // 2 * 16 + g + 8 * (i % 2))
                    if pix < PX:
                        base[i] = pix // (OH * OW) * (H * W)
                        ry[i] = pix // OW % OH * wl.stride[0] - wl.padding[0]
                        rx[i] = pix % OW * wl.stride[1] - wl.padding[1]
                    else:                                            # a row past the end: all taps 0
                        base[i] = 0
                        ry[i] = -KH * wl.dilation[0]
                        rx[i] = 0
                for i in T.unroll(NACC):
                    acc[i] = 0
                for ks in T.unroll(KS):
                    for j in T.unroll(NTC):
                        for r in T.unroll(2):
                            b[j * 2 + r] = w_s[(((ks * CHUNKS + c) * NTC + j) * 32 + lane) * 2 + r]
                    for m in T.unroll(MT):
                        # a0 / a1: rows g / g + 8 under tap 8ks + t4; a2 / a3: under tap 8ks + t4 + 4
                        for r in T.unroll(4):
                            a[r] = _tap_word(pixels, ks * TAPS_PER_STEP + t4 + 4 * (r // 2), base[m * 2 + r % 2],
                                             ry[m * 2 + r % 2], rx[m * 2 + r % 2], wl)
                        for j in T.unroll(NTC):
                            T.cuda.func_call("qconv_mma_s8", acc[(m * NTC + j) * 4], acc[(m * NTC + j) * 4 + 1],
                                             acc[(m * NTC + j) * 4 + 2], acc[(m * NTC + j) * 4 + 3], a[0], a[1],
                                             a[2], a[3], b[j * 2], b[j * 2 + 1], source_code=MMA_SRC)
                # lane (g, t4) holds, of each row, columns 2*t4 and 2*t4 + 1 of every n8 tile: the
                # channels c*CN + t4*Q + k, k = 2j + e (pack_weight's column order)
                for fast in T.unroll(2):                             # the requantize's two forms
                    if fast == ok[1]:
                        # channel by channel (its bias / mult / shift loaded once, for all the
                        # lane's rows), each row's Q bytes packed into words, then one store per row
                        for i in T.unroll(2 * MT * Q // 4):
                            packed[i] = T.uint32(0)
                        for k in T.unroll(Q):
                            o = T.meta_var(c * CN + t4 * Q + k)
                            for i in T.unroll(2 * MT):
                                v = T.meta_var(epilogue_table.finish_int32(
                                    _requant(fast, acc[(i // 2 * NTC + k // 2) * 4 + i % 2 * 2 + k % 2],
                                             bias[o], mult[o], shift[o], LO, HI), o, LUT, wl.out_channels))
                                packed[i * (Q // 4) + k // 4] = T.bitwise_or(packed[i * (Q // 4) + k // 4], T.shift_left(
                                    T.Cast("uint32", T.bitwise_and(v, 255)), T.uint32(8 * (k % 4))))
                        for i in T.unroll(2 * MT):
                            pix = T.meta_var(p0 + i // 2 * 16 + g + 8 * (i % 2))
                            if pix < PX:
                                for q in T.vectorized(Q // 4):
                                    out32[(pix * OP + c * CN + t4 * Q) // 4 + q] = packed[i * (Q // 4) + q]

    return epilogue_table.with_table_param(main, LUT)


def _requant(fast, acc, bias, mult, shift, lo: int, hi: int):
    """TIR int32: the requantized output; ``fast`` (1 or 0 once unrolled) picks the 32-bit form
    (``requantize_tir_i32``; ``supports`` bounds K to 1,536, so |acc| < 2**25) or the 64-bit one."""
    return tirx.if_then_else(fast == 1, requantize_tir_i32(acc, bias, mult, shift, lo, hi),
                             requantize_tir(acc.astype("int64") + bias.astype("int64"), mult, shift, lo, hi)
                             .astype("int32"))


def _tap_word(pixels, tap, base, ry, rx, wl: ConvWorkload):
    """TIR: the input word (4 channels) under ``tap`` of the pixel whose tap (0, 0) reads input
    ``(ry, rx)`` of the image starting at word ``base``; 0 in the padding and past the taps."""
    H, W, KW = wl.height, wl.width, wl.kernel[1]
    iy = ry + tap // KW * wl.dilation[0]
    ix = rx + tap % KW * wl.dilation[1]
    return tirx.if_then_else(tirx.all(tap < KW * wl.kernel[0], 0 <= iy, iy < H, 0 <= ix, ix < W),
                             pixels[base + iy * W + ix], 0)
