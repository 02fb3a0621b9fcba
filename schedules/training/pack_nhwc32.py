"""The training path's ``pack`` on CUDA (``elementwise.pack``: int8 NCHW -> the tensor cores'
NHWC32 ``[N, H, W, C_p]``, or transposed ``[C (or C_p), H, W, N_p]``): a thread per 4 pixels x 32
channels, 32 four-byte loads, the 4 x 4 byte transposes in registers, 8 sixteen-byte stores.

Why: the two schedules before it ran at 48 % of a copy's bandwidth and worse.  A thread per pixel x
16 channels (``channels_last_conversions``) loads a byte per channel, 32 bytes a warp load; a
thread per 4 pixels x 16 channels (185a0dc) loaded 4-byte words into a byte array and read it back
byte by byte, and the step's ``pack`` time went *up* (VGG16 b32 1.2 -> 2.0 ms, ResNet-50 b128 6.3
-> 9.6 ms: H200, 2026-11-29).  Both stored 16 of a 32-byte sector, whose other half another block
wrote much later.  Here the words stay words (a byte of each is moved by shifts and masks, which
nvcc makes byte permutes), a warp load reads 128 contiguous bytes of a channel, and each store
covers whole 32-byte sectors of a pixel's channels.

The pixels are the channel plane's flat ``H * W`` (4 of them never straddle two planes when
``H * W`` is a multiple of 4: :func:`supports`), so ResNet's 14 x 14 and 28 x 28 maps qualify as
well as VGG16's.  Written as scheduled S-TIR with thread-bound loops (``tensorcore/pool.py`` says
why not TIRx); ``tests/test_grad_kernels.py`` runs it on a CPU twin against the compute.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ..tensorcore.layout import ceil32

PIXELS = 4          # consecutive pixels of a channel a thread reads: one 4-byte word per channel
CHANNELS = 32       # packed channels a thread writes per pixel: one 32-byte sector, two 16-byte stores
THREADS = 256


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
    Q = H * W // PIXELS                      # 4-pixel words of a channel plane
    G = CP // CHANNELS                       # 32-channel groups of a pixel
    TOTAL = RP * G * Q
    GRID = (TOTAL + THREADS - 1) // THREADS
    TRANSPOSE = wl.transpose

    @T.prim_func(s_tir=True, private=True)
    def main(src: T.Buffer((N, C, H, W), "int8", align=4), out: T.Buffer((RP, H, W, CP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            word = T.sblock_alloc_buffer((CHANNELS,), "uint32", scope="local")    # a channel's 4 pixels
            res = T.sblock_alloc_buffer((CHANNELS // 4,), "uint32", scope="local")  # a pixel's 32 channels
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    t = T.meta_var(cta * THREADS + tid)      # (row, channel group, word), word fastest
                    if t < TOTAL:
                        q = T.meta_var(t % Q)
                        g = T.meta_var(t // Q % G)
                        i = T.meta_var(t // (Q * G))
                        y = T.meta_var(q * PIXELS // W)      # the word's first pixel (its 4 may run on
                        x = T.meta_var(q * PIXELS % W)       # into the next row: one flat plane)
                        for k in T.unroll(CHANNELS):
                            j = T.meta_var(g * CHANNELS + k)
                            if i < ROWS and j < COLS:
                                if TRANSPOSE:
                                    word[k] = T.reinterpret("uint32", src.vload([j, i, y, x], "int8x4"))
                                else:
                                    word[k] = T.reinterpret("uint32", src.vload([i, j, y, x], "int8x4"))
                            else:
                                word[k] = T.uint32(0)
                        for p in T.unroll(PIXELS):
                            for w in T.unroll(CHANNELS // 4):      # channels 4w .. 4w + 3 at pixel p
                                res[w] = ((word[4 * w] >> T.uint32(8 * p) & T.uint32(255))
                                          | (word[4 * w + 1] >> T.uint32(8 * p) & T.uint32(255)) << T.uint32(8)
                                          | (word[4 * w + 2] >> T.uint32(8 * p) & T.uint32(255)) << T.uint32(16)
                                          | (word[4 * w + 3] >> T.uint32(8 * p) & T.uint32(255)) << T.uint32(24))
                            for h in T.unroll(CHANNELS // 16):
                                out.vstore([i, (q * PIXELS + p) // W, (q * PIXELS + p) % W, g * CHANNELS + h * 16],
                                           T.reinterpret("int8x16", res.vload([h * 4], "uint32x4")))

    return main
