"""A network's first conv (at most 4 input channels: the image) on ``__dp4a``, from the input as
the quantizer packs it (NCHW4c: for C <= 4, ``[N, 1, H, W, 4]``, one int32 per pixel) straight
into NHWC32, the tensor-core families' layout.

Why its own kernel: the tensor-core templates pad the input channels to 32 for one K step (VGG16's
first conv would do 10x the multiply-adds), so this layer ran on the dp4a family, whose NCHW4c
output then had to be converted for the next layer: on an H100 at batch 64, VGG16's first conv
took 0.44 ms and the conversion of its 205 MB output 0.78 ms (``docs/benchmarks.md``), 28 % of
the model.  Here one pixel's 4 channels are one int32, the whole reduction of an output is
``KH*KW`` dp4a instructions, and the output goes out in the next layer's layout.

The kernel (hand-written TIRx, no search space)::

    thread = 4 adjacent output pixels (along x) x 16 output channels: 64 int32 accumulators
    for each tap:      4 input words (zero outside the image), from L1 / L2, loaded one tap
                       ahead (the loads of tap t + 1 are in flight during tap t's math)
        for 16 channels:   1 weight word from shared memory, 4 dp4a (one per pixel)
    epilogue:          bias, fixed-point requantize, clamp (``requantize_tir``), and each
                       pixel's 16 channels as one 16-byte store

A block holds ``256 // OG`` pixel groups x ``OG = O_p / 16`` channel groups (channel group fastest,
so a warp's stores cover whole pixels: 4 x 16 bytes of a 64-channel pixel, contiguous).  The
weights (``KH*KW x O_p`` int32: 2.3 KB for VGG, 12.5 KB for ResNet's 7x7) sit in shared memory,
stored channel-group fastest (``[tap, o % 16, o // 16]``) so the ``OG`` distinct words a warp
reads at once lie in distinct banks.  Cost model: a 1:4 ratio of shared loads to dp4a, and the
output written once (VGG16 b64: 1.85 G dp4a = 0.12 ms at the H100's measured dp4a peak, 205 MB
= 0.07 ms at 3 TB/s).
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..requantize import requantize_ref, requantize_tir
from ..tensorcore.layout import ceil32
from ..workload import ConvWorkload

KERNEL_NAME = "conv2d_stem_int8"
MAX_IN_CHANNELS = 4      # one int32 word per pixel
PIXELS = 4               # output pixels per thread (adjacent along x)
CHANNELS = 16            # output channels per thread: one 16-byte store per pixel
THREADS = 256            # per block, at most
SMEM_BYTES = 48 * 1024   # the weights, in static shared memory


def channel_groups(wl: ConvWorkload) -> int:
    return ceil32(wl.out_channels) // CHANNELS


def supports(wl: ConvWorkload) -> bool:
    """An int8-out, ungrouped conv of at most 4 input channels whose weights fit in shared memory."""
    taps = wl.kernel[0] * wl.kernel[1]
    return (wl.groups == 1 and wl.out_dtype == "int8" and wl.in_channels <= MAX_IN_CHANNELS
            and channel_groups(wl) <= THREADS and taps * ceil32(wl.out_channels) * 4 <= SMEM_BYTES)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """OIHW int8 ``[O, C <= 4, KH, KW]`` -> int8 ``[KH*KW, O_p, 4]``, the ``O_p`` axis ordered
    ``(o % 16, o // 16)`` (channel group fastest: the shared-memory order, module docstring);
    padded input and output channels 0."""
    o, c, kh, kw = w.shape
    assert c <= MAX_IN_CHANNELS, w.shape
    op = ceil32(o)
    full = np.zeros((kh * kw, op, 4), np.int8)
    full[:, :o, :c] = w.transpose(2, 3, 0, 1).reshape(kh * kw, o, c)
    og = op // CHANNELS
    return np.ascontiguousarray(full.reshape(kh * kw, og, CHANNELS, 4).transpose(0, 2, 1, 3).reshape(kh * kw, op, 4))


def unpack_weight(packed: np.ndarray, out_channels: int, in_channels: int, kernel) -> np.ndarray:
    """Inverse of :func:`pack_weight`: OIHW ``[O, C, KH, KW]``."""
    taps, op, _ = packed.shape
    og = op // CHANNELS
    full = packed.reshape(taps, CHANNELS, og, 4).transpose(0, 2, 1, 3).reshape(taps, op, 4)
    return np.ascontiguousarray(full[:, :out_channels, :in_channels].reshape(*kernel, out_channels, in_channels)
                                .transpose(2, 3, 0, 1))


def conv2d_stem_ref(wl: ConvWorkload, data, weight, bias, mult, shift) -> np.ndarray:
    """NumPy reference on the packed layouts: int8 ``[N, OH, OW, O_p]`` (NHWC32).  float64
    accumulation is exact: at most 49 x 4 int8 products per output."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    x = data[:, 0].astype(np.float64)                                   # [N, H, W, 4]
    op = weight.shape[1]
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
    the CUDA kernel against both): ``(data [N,1,H,W,4], weight [T,O_p,4], bias, mult, shift, out)``."""
    assert supports(wl), wl
    N, H, W = wl.batch, wl.height, wl.width
    OH, OW, OP = wl.out_height, wl.out_width, ceil32(wl.out_channels)
    KH, KW = wl.kernel
    SH, SW = wl.stride
    DH, DW = wl.dilation
    PT, PL = wl.padding[:2]
    OG = OP // CHANNELS
    LO, HI = wl.act_min, wl.act_max

    @T.prim_func(s_tir=True)
    def main(data: T.Buffer((N, 1, H, W, 4), "int8"), weight: T.Buffer((KH * KW, OP, 4), "int8"),
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
                    with T.init():
                        acc[vn, vy, vx, vo] = 0
                    acc[vn, vy, vx, vo] = acc[vn, vy, vx, vo] + T.Cast("int32", T.if_then_else(
                        0 <= h and h < H and 0 <= w and w < W, data[vn, 0, h, w, vc], T.int8(0))) * T.Cast(
                        "int32", weight[vt, vo % CHANNELS * OG + vo // CHANNELS, vc])
            for n, y, x, o in T.grid(N, OH, OW, OP):
                with T.sblock("requant"):
                    vn, vy, vx, vo = T.axis.remap("SSSS", [n, y, x, o])
                    out[vn, vy, vx, vo] = requantize_tir(T.Cast("int64", acc[vn, vy, vx, vo])
                                                         + T.Cast("int64", bias[vo]), mult[vo], shift[vo], LO, HI)

    return main.with_attr({"tvm_qconv.kernel": KERNEL_NAME})


def conv2d_stem(wl: ConvWorkload) -> tirx.PrimFunc:
    """The CUDA kernel (TIRx; module docstring), same arguments as :func:`conv2d_stem_compute`."""
    assert supports(wl), wl
    N, H, W = wl.batch, wl.height, wl.width
    OH, OW, OP = wl.out_height, wl.out_width, ceil32(wl.out_channels)
    KH, KW = wl.kernel
    TAPS = KH * KW
    SH, SW = wl.stride
    DH, DW = wl.dilation
    PT, PL = wl.padding[:2]
    OG = channel_groups(wl)
    PGB = max(1, THREADS // OG)               # pixel groups per block
    NT = OG * PGB                             # threads per block
    XG = (OW + PIXELS - 1) // PIXELS          # pixel groups per output row
    PG = N * OH * XG
    GRID = (PG + PGB - 1) // PGB
    WORDS = TAPS * OP                         # weight words
    LO, HI = wl.act_min, wl.act_max

    @T.prim_func(private=True)
    def main(data: T.Buffer((N, 1, H, W, 4), "int8", align=4), weight: T.Buffer((TAPS, OP, 4), "int8", align=16),
             bias: T.Buffer((OP,), "int32"), mult: T.Buffer((OP,), "int32"), shift: T.Buffer((OP,), "int32"),
             out: T.Buffer((N, OH, OW, OP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        T.device_entry()
        cta = T.cta_id([GRID])
        tid = T.thread_id([NT])
        pixels = T.decl_buffer((N * H * W,), "int32", data=data.data)
        words = T.decl_buffer((WORDS,), "int32", data=weight.data)
        out32 = T.decl_buffer((N * OH * OW * OP // 4,), "uint32", data=out.data)
        w_s = T.alloc_buffer((WORDS,), "int32", scope="shared")
        acc = T.alloc_buffer((CHANNELS * PIXELS,), "int32", scope="local")
        x = T.alloc_buffer((PIXELS,), "int32", scope="local")
        nxt = T.alloc_buffer((PIXELS,), "int32", scope="local")
        packed = T.alloc_buffer((CHANNELS // 4,), "uint32", scope="local", align=16)
        for i in T.serial((WORDS + NT - 1) // NT):
            if i * NT + tid < WORDS:
                w_s[i * NT + tid] = words[i * NT + tid]
        T.cuda.cta_sync()
        og = T.meta_var(tid % OG)
        pg = T.meta_var(cta * PGB + tid // OG)
        if pg < PG:
            n = T.meta_var(pg // (OH * XG))
            oy = T.meta_var(pg // XG % OH)
            x0 = T.meta_var(pg % XG * PIXELS)
            for i in T.unroll(CHANNELS * PIXELS):
                acc[i] = 0
            for j in T.unroll(PIXELS):
                nxt[j] = _tap_word(pixels, 0, j, n, oy, x0, wl)
            for t in T.serial(TAPS):
                # this tap's words; the next tap's loads go out before this tap's math
                for j in T.unroll(PIXELS):
                    x[j] = nxt[j]
                if t + 1 < TAPS:
                    for j in T.unroll(PIXELS):
                        nxt[j] = _tap_word(pixels, t + 1, j, n, oy, x0, wl)
                for oi in T.unroll(CHANNELS):
                    for j in T.unroll(PIXELS):
                        acc[oi * PIXELS + j] = T.call_pure_extern("int32", "__dp4a", x[j], w_s[t * OP + oi * OG + og],
                                                                  acc[oi * PIXELS + j])
            for j in T.unroll(PIXELS):
                if x0 + j < OW:
                    for q in T.unroll(CHANNELS // 4):
                        packed[q] = T.uint32(0)
                        for b in T.unroll(4):
                            o = T.meta_var(og * CHANNELS + q * 4 + b)
                            v = T.meta_var(requantize_tir(T.Cast("int64", acc[(q * 4 + b) * PIXELS + j])
                                                          + T.Cast("int64", bias[o]), mult[o], shift[o], LO, HI))
                            packed[q] = T.bitwise_or(packed[q], T.shift_left(
                                T.Cast("uint32", T.bitwise_and(T.Cast("int32", v), 255)), T.uint32(8 * b)))
                    for q in T.vectorized(CHANNELS // 4):
                        out32[(((n * OH + oy) * OW + x0 + j) * OP + og * CHANNELS) // 4 + q] = packed[q]

    return main


def _tap_word(pixels, t, j, n, oy, x0, wl: ConvWorkload):
    """TIR: the input word (4 channels) under tap ``t`` of pixel ``x0 + j`` of row ``oy``, 0 in
    the padding."""
    H, W, KW = wl.height, wl.width, wl.kernel[1]
    iy = oy * wl.stride[0] + t // KW * wl.dilation[0] - wl.padding[0]
    ix = (x0 + j) * wl.stride[1] + t % KW * wl.dilation[1] - wl.padding[1]
    return tirx.if_then_else(tirx.all(0 <= iy, iy < H, 0 <= ix, ix < W), pixels[(n * H + iy) * W + ix], 0)
