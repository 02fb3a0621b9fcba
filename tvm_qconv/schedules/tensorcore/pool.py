"""The NHWC32 max-pool on CUDA, 16 channels per thread: one 16-byte load per window position,
``__vmaxs4`` (four signed int8 maxima per instruction) on its four words, one 16-byte store.

Why: the layout-generic pool (``schedules/pool_int8.py``: one output byte per thread) ran
VGG16's first max-pool (205 MB in, 51 MB out at batch 64) at 1.6 TB/s on an H100, 164 us; the
five pools took 320 us, 8 % of the model (``benchmarks/kernel_profile.py``).  Byte loads issue
16 times the instructions of these; the pool is a pure stream, so the vector kernel should run
near the copy bandwidth.

Same compute definition, reference and output as the generic NHWC32 max-pool (it subclasses it):
windows outside the input read -128, and max commutes with the quantizer, so the scale is
unchanged.  Written as scheduled S-TIR (thread-bound loops), not TIRx: Relax's
``RewriteDataflowReshape`` inspects every two-buffer kernel (x -> out) and requires an S-TIR body
(and a buffer view declared in S-TIR does not reach CUDA codegen: the words are reinterpreted).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ..layout_kernels import MaxPool2d
from ..pool_int8 import pool_out_size
from ..sched_utils import as_schedule_of
from ..workload import PoolWorkload

VEC = 16            # channels (bytes) per thread: one 16-byte load / store
THREADS = 256
NEG = 0x80808080    # four int8 -128s: the max-pool's padding value, as one word


def max_pool2d_nhwc32_vec(wl: PoolWorkload):
    """The kernel for ``wl`` (packed NHWC32 ``shape``): int8 ``[N, H, W, C_p]`` -> ``[N, OH, OW, C_p]``."""
    N, H, W, CP = wl.shape
    (KH, KW), (SH, SW), (DH, DW) = wl.pool, wl.stride, wl.dilation
    PT, PL = wl.padding[:2]
    OH, OW = pool_out_size(H, W, wl.pool, wl.stride, wl.padding, wl.dilation, wl.ceil_mode)
    G = CP // VEC                         # 16-channel groups per pixel
    TOTAL = N * OH * OW * G
    GRID = (TOTAL + THREADS - 1) // THREADS
    WORDS = VEC // 4

    @T.prim_func(s_tir=True, private=True)
    def main(x: T.Buffer((N, H, W, CP), "int8", align=16), out: T.Buffer((N, OH, OW, CP), "int8", align=16)):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            got = T.sblock_alloc_buffer((VEC,), "int8", scope="local")
            res = T.sblock_alloc_buffer((VEC,), "int8", scope="local")
            best = T.sblock_alloc_buffer((WORDS,), "uint32", scope="local")
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    i = T.meta_var(cta * THREADS + tid)          # (pixel, channel group), group fastest
                    if i < TOTAL:
                        g = T.meta_var(i % G)
                        ox = T.meta_var(i // G % OW)
                        oy = T.meta_var(i // (G * OW) % OH)
                        n = T.meta_var(i // (G * OW * OH))
                        for q in T.unroll(WORDS):
                            best[q] = T.uint32(NEG)
                        for ry in T.unroll(KH):
                            for rx in T.unroll(KW):
                                iy = T.meta_var(oy * SH + ry * DH - PT)
                                ix = T.meta_var(ox * SW + rx * DW - PL)
                                if 0 <= iy and iy < H and 0 <= ix and ix < W:
                                    for c in T.vectorized(VEC):
                                        got[c] = x[n, iy, ix, g * VEC + c]
                                    for q in T.unroll(WORDS):
                                        best[q] = T.call_pure_extern("uint32", "__vmaxs4", best[q], T.reinterpret(
                                            "uint32", got.vload([q * 4], "int8x4")))
                        for q in T.unroll(WORDS):
                            res.vstore([q * 4], T.reinterpret("int8x4", best[q]))
                        for c in T.vectorized(VEC):
                            out[n, oy, ox, g * VEC + c] = res[c]

    return main


class MaxPool2dNhwc32(MaxPool2d):
    """``max_pool2d.nhwc32`` with the vector CUDA kernel above; llvm keeps the generic definition."""

    def schedule(self, func, target):
        if target.kind.name != "cuda":
            return super().schedule(func, target)
        return as_schedule_of(func, max_pool2d_nhwc32_vec(PoolWorkload.of(func)))

