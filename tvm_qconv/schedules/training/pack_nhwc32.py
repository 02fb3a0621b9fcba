"""The training path's ``pack`` on CUDA (``elementwise.pack``: int8 NCHW -> the tensor cores'
NHWC32 ``[N, H, W, C_p]``, or transposed ``[C (or C_p), H, W, N_p]``) as a shared-memory transpose:
a block takes 32 channels x 128 pixels of a row; each thread loads 4 of its words (a warp: 128
contiguous bytes of a channel) and stores 16 channels of a pixel (two neighbouring threads: a
pixel's whole 32-byte sector).

Why: what matters is that every store fills whole 32-byte sectors.  Standalone on an H200
(2026-11-29, the experiment in history.md; VGG16's 32 x 64 x 224 x 224,
copy 4.2 TB/s), this tile moved 3.05 TB/s; a thread per pixel x 16 channels
(``channels_last_conversions``, byte loads) 2.3 TB/s; a thread per 4 pixels x 32 channels
transposing its words in registers 0.86-1.6 TB/s, although its loads were as wide: each of its
16-byte stores was half a sector, the other half written by the next instruction, and ncu counted
3.7 L2 write sectors per sector of output and 178 MB read from DRAM for 103 MB of input (the
partial sectors read back).  On ResNet-50's 14 x 14 and 28 x 28 maps the tile was 1.2-1.3x the
byte-load kernel.

The pixels are the channel plane's flat ``H * W`` (a word's 4 pixels may run into the next row;
they never straddle two planes when ``H * W`` is a multiple of 4: :func:`supports`).  Written as
scheduled S-TIR with thread-bound loops (``tensorcore/pool.py`` says why not TIRx), the load and
the store as two thread loops (TVM puts the barrier between them), so that
``tests/test_grad_kernels.py``'s CPU twin runs it against the compute.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ..tensorcore.layout import ceil32

PIXELS = 4          # pixels of a channel in one 4-byte word
CHANNELS = 32       # packed channels of a tile: one 32-byte sector of a pixel
WORDS = 32          # words of a channel in a tile: 128 pixels, a warp's 128-byte load
THREADS = 256       # each loads 4 words and stores 16 bytes (half a pixel's sector)
STRIDE = WORDS + 1  # a channel's row in shared memory, padded


def supports(shape) -> bool:
    """Whole 4-pixel words: ``H * W`` a multiple of 4 (every channel plane then starts 4-byte aligned)."""
    return shape[2] * shape[3] % PIXELS == 0


def pack_kernel(wl):
    """The CUDA kernel of ``elementwise.pack(wl)`` (same parameters, same bits)."""
    if not supports(wl.shape):
        raise ValueError(f"pack_kernel needs H * W a multiple of {PIXELS}: {wl.shape}")
    N, C, H, W = wl.shape
    ROWS, COLS = (C, N) if wl.transpose else (N, C)
    RP, CP = (ceil32(ROWS) if wl.pad_rows else ROWS), ceil32(COLS)
    Q = H * W // PIXELS                      # words of a channel plane
    TILES = (Q + WORDS - 1) // WORDS         # tiles of a plane
    G = CP // CHANNELS                       # 32-channel groups of a pixel
    GRID = RP * G * TILES
    TRANSPOSE = wl.transpose
    LOADS = CHANNELS * WORDS // THREADS      # words a thread loads

    @T.prim_func(s_tir=True, private=True)
    def main(src: T.Buffer((N, C, H, W), "int8", align=4), out: T.Buffer((RP, H, W, CP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            # [CHANNELS, WORDS + 1] flat (a 2-D buffer is compacted to the columns used): the row
            # stride of 33 puts the two channel rows a warp reads at once on different banks
            tile = T.sblock_alloc_buffer((CHANNELS * STRIDE,), "uint32", scope="shared")
            res = T.sblock_alloc_buffer((4,), "uint32", scope="local")
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                t0 = T.meta_var(cta % TILES * WORDS)     # the tile's first word
                g = T.meta_var(cta // TILES % G)
                i = T.meta_var(cta // (TILES * G))       # the row: image (or, transposed, channel)
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):     # a warp: a channel's 128 bytes
                    for r in T.unroll(LOADS):
                        k = T.meta_var(r * (THREADS // WORDS) + tid // WORDS)
                        j = T.meta_var(g * CHANNELS + k)
                        q = T.meta_var(t0 + tid % WORDS)
                        if i < ROWS and j < COLS and q < Q:
                            if TRANSPOSE:
                                tile[k * STRIDE + tid % WORDS] = T.reinterpret("uint32", src.vload(
                                    [j, i, q * PIXELS // W, q * PIXELS % W], "int8x4"))
                            else:
                                tile[k * STRIDE + tid % WORDS] = T.reinterpret("uint32", src.vload(
                                    [i, j, q * PIXELS // W, q * PIXELS % W], "int8x4"))
                        else:
                            tile[k * STRIDE + tid % WORDS] = T.uint32(0)
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):     # a pixel's 16 channels
                    w = T.meta_var(tid // 2 // PIXELS)
                    shift = T.meta_var(T.Cast("uint32", tid // 2 % PIXELS * 8))
                    if t0 + w < Q:
                        for v in T.unroll(4):           # channels 4v .. 4v + 3 of the thread's 16
                            c = T.meta_var(tid % 2 * 16 + v * 4)
                            res[v] = ((tile[c * STRIDE + w] >> shift & T.uint32(255))
                                      | (tile[(c + 1) * STRIDE + w] >> shift & T.uint32(255)) << T.uint32(8)
                                      | (tile[(c + 2) * STRIDE + w] >> shift & T.uint32(255)) << T.uint32(16)
                                      | (tile[(c + 3) * STRIDE + w] >> shift & T.uint32(255)) << T.uint32(24))
                        pixel = T.meta_var(t0 * PIXELS + tid // 2)
                        out.vstore([i, pixel // W, pixel % W, g * CHANNELS + tid % 2 * 16],
                                   T.reinterpret("int8x16", res.vload([0], "uint32x4")))

    return main
