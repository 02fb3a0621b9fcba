"""The global average pool of the NHWC32 layout (squeeze-excite's squeeze, the classifier's pool)
in two stages: the int32 sums of chunks of each image's pixels (``Partial [N, chunks, C_p]``, an
output of the kernel that the build allocates), then their total requantized.  On CUDA, written
out: a block sums one chunk, 16 channels (one 128-bit load) per thread, and a second kernel adds the
chunks' sums and requantizes.

Why the sums are an output and not a buffer of the kernel's own: a buffer the kernel allocated
would be TVM's workspace, taken from a pool at run time (``cudaMalloc`` on first use), which a CUDA
graph being captured cannot do; an output is memory Relax plans like any activation.

Why not dlight's reduction rule (what ran before): it gives each (image, 16 channels) one block of
16 x 16 threads that loads one byte per thread per step, so at batch 64 EfficientNet-B0's first
squeeze (64 x 112 x 112 x 32) gets 128 blocks, each walking 784 steps of 256 bytes, and at batch 1
two blocks for the whole GPU.  Here a thread loads 16 bytes a step, the pixels of an image are split
over ``chunks`` blocks so that the grid has about ``MIN_BLOCKS`` blocks at any batch, and the sums
are exact int32 (``pixels x 255 < 2**31``).

Kernel 1, grid ``N x chunks``, 256 threads: thread ``t`` takes vector ``v = t % V`` (``V = C_p / 16``)
of pixels ``lane, lane + L, ...`` of its chunk (``lane = t // V``, ``L = 256 // V`` lanes), summing
16 int32 in registers; the lanes' sums meet in shared memory and are added up in two rounds into
``partial[n, chunk, c]``.  Kernel 2, one thread per output ``(n, c)``: the chunks' sums, less
``pixels x in_zero``, requantized as the compute definition does (``pool_int8.avg_pool2d_int8``), so
CUDA and CPU agree bit for bit.

Also the 14 x 14 and 7 x 7 maps (``MIN_PIXELS``): on the generic kernel (a thread per output, each
summing its pixels a row apart, a load and an add per pixel) EfficientNet-B0's squeezes took ~8.5 us
each at 14 x 14 and 8.85 us each at 7 x 7 x 1152 at batch 1 on an H200 (2026-11-28,
``docs/results/kernel_profile_efficientnet_b0_b1_h200_tables_in_epilogues.json``), where this
kernel's two launches took 2.2-2.8 and 0.8-1.2 us for the larger maps.

Takes: a pool over the whole map (no padding) of at least ``MIN_PIXELS`` pixels, ``C_p <= 4096`` (a
block's 256 threads hold one vector of every channel).  Anything else keeps the generic kernels.
"""
from __future__ import annotations

import tvm
from tvm import te, tirx

from ..requantize import QMIN, requantize_tir
from ..kernel import parse_written_kernel
from ..workload import AvgPoolWorkload

VEC = 16
THREADS = 256
MIN_BLOCKS = 264      # two blocks per SM of an H100 (132 SMs)
MIN_STEPS = 4         # pixels per thread at least, so that a chunk is not all reduction overhead
MIN_PIXELS = 49       # 7 x 7 and up; below, the generic kernel's one thread per output (module docstring)


def chunks_per_image(batch: int, pixels: int, lanes: int) -> int:
    """How many blocks share one image's pixels: enough for ``MIN_BLOCKS`` blocks in all, as long
    as each thread still sums ``MIN_STEPS`` pixels."""
    return max(1, min(-(-MIN_BLOCKS // batch), pixels // (lanes * MIN_STEPS)))


def applies(wl: AvgPoolWorkload) -> bool:
    """Whether ``wl`` (packed NHWC32 ``[N, H, W, C_p]``) is a pool this module takes: the window the
    whole map, at least ``MIN_PIXELS`` pixels, at most 256 vectors of channels, a sum that
    fits int32 (``pixels x 255``: the total times a 31-bit multiplier then fits int64) and indices
    that fit int32."""
    if not isinstance(wl, AvgPoolWorkload) or len(wl.shape) != 4:   # a generic query (None), NCHW4c
        return False
    n, h, w, cp = wl.shape
    return (tuple(wl.pool) == (h, w) and not any(wl.padding) and h * w >= MIN_PIXELS
            and cp // VEC <= THREADS and h * w * 255 < 2 ** 31 and n * h * w * cp < 2 ** 31)


def chunking(wl: AvgPoolWorkload) -> tuple[int, int]:
    """(chunks per image, pixels per chunk)."""
    n, h, w, cp = wl.shape
    chunks = chunks_per_image(n, h * w, THREADS // (cp // VEC))
    return chunks, -(-h * w // chunks)


def scratch_shape(wl: AvgPoolWorkload) -> tuple[int, int, int]:
    """``Partial``'s shape: ``[N, chunks, C_p]`` int32."""
    return (wl.shape[0], chunking(wl)[0], wl.shape[3])


def global_avg_pool_int8(wl: AvgPoolWorkload) -> tirx.PrimFunc:
    """Compute definition ``(X, Partial, Out)``: the chunks' sums, then ``Out[n, 0, 0, c]`` their
    total less ``pixels x in_zero``, requantized as ``pool_int8.avg_pool2d_int8`` does."""
    if not applies(wl):
        raise ValueError(f"not a global pool this kernel takes (tensorcore/global_pool.applies): {wl}")
    n, h, w, cp = wl.shape
    pixels = h * w
    chunks, per_chunk = chunking(wl)
    x = te.placeholder(wl.shape, "int8", name="X")
    r = te.reduce_axis((0, per_chunk), name="r")

    def pixel(k, r):   # clamped: the guard's false branch still indexes
        return tirx.min(k * per_chunk + r, pixels - 1)

    partial = te.compute(
        (n, chunks, cp),
        lambda b, k, c: te.sum(tirx.if_then_else(k * per_chunk + r < pixels,
                                                 x[b, pixel(k, r) // w, pixel(k, r) % w, c].astype("int32"), 0),
                               axis=r),
        name="partial")
    kk = te.reduce_axis((0, chunks), name="kk")
    total = te.compute((n, cp), lambda b, c: te.sum(partial[b, kk, c], axis=kk), name="total")
    lo = QMIN if wl.out_zero == 0 else -128
    out = te.compute(
        (n, 1, 1, cp),
        lambda b, y, xx, c: requantize_tir(total[b, c].astype("int64") - tirx.const(pixels * wl.in_zero, "int64"),
                                           tirx.const(wl.mult, "int32"), tirx.const(wl.shift, "int32"), lo, 127,
                                           zero=wl.out_zero),
        name="avg_requant")
    return te.create_prim_func([x, partial, out]).with_attr({"tvm_qconv.kernel": "global_avg_pool2d_nhwc32_int8"})


def global_pool_kernel(wl: AvgPoolWorkload) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc of :func:`global_avg_pool_int8` for ``wl``: two kernels (module docstring)."""
    n, h, w, cp = wl.shape
    vectors = cp // VEC
    pixels, lanes = h * w, THREADS // vectors
    chunks, per_chunk = chunking(wl)
    steps = -(-per_chunk // lanes)
    # the lanes' sums meet in two rounds: ``subsets`` threads per channel each add every
    # subsets-th lane (all 256 threads busy where C_p < 256), then one thread per channel adds the
    # subsets; the lane rows are padded by a word so that a warp's stores of one element spread
    # over the banks (a flat buffer: TVM compacts a 2-D one to the columns it reads, pad gone)
    subsets = max(1, THREADS // cp)
    lo = QMIN if wl.out_zero == 0 else -128
    src = f'''
@T.prim_func(private=True)
def main(X: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16), partial: T.Buffer(({n}, {chunks}, {cp}), "int32"),
         Out: T.Buffer(({n}, 1, 1, {cp}), "int8")):
    T.func_attr({{"tir.noalias": True}})
    x = T.decl_buffer(({n * pixels * cp},), "int8", data=X.data, align=16)
    for bx in T.thread_binding({n * chunks}, thread="blockIdx.x"):
        lane_sums = T.alloc_buffer(({lanes * (cp + 1)},), "int32", scope="shared")   # flat: compaction keeps the pad
        subset_sums = T.alloc_buffer(({subsets}, {cp}), "int32", scope="shared")
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            acc = T.alloc_buffer(({VEC},), "int32", scope="local")
            xv = T.alloc_buffer(({VEC},), "int8", scope="local")
            if tx < {lanes * vectors}:
                for l in T.unroll({VEC}):
                    acc[l] = 0
                for i in T.serial({steps}):
                    p = (bx % {chunks}) * {per_chunk} + tx // {vectors} + i * {lanes}
                    if p < {pixels} and tx // {vectors} + i * {lanes} < {per_chunk}:
                        for l in T.vectorized({VEC}):
                            xv[l] = x[((bx // {chunks}) * {pixels} + p) * {cp} + tx % {vectors} * {VEC} + l]
                        for l in T.unroll({VEC}):
                            acc[l] = acc[l] + T.Cast("int32", xv[l])
                for l in T.unroll({VEC}):
                    lane_sums[tx // {vectors} * {cp + 1} + tx % {vectors} * {VEC} + l] = acc[l]
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            for j in T.serial({-(-subsets * cp // THREADS)}):
                if j * {THREADS} + tx < {subsets * cp}:
                    s = T.alloc_buffer((1,), "int32", scope="local")
                    s[0] = 0
                    for k in T.serial({-(-lanes // subsets)}):
                        if (j * {THREADS} + tx) // {cp} + k * {subsets} < {lanes}:
                            s[0] = s[0] + lane_sums[((j * {THREADS} + tx) // {cp} + k * {subsets}) * {cp + 1}
                                                    + (j * {THREADS} + tx) % {cp}]
                    subset_sums[(j * {THREADS} + tx) // {cp}, (j * {THREADS} + tx) % {cp}] = s[0]
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            for j in T.serial({-(-cp // THREADS)}):
                if j * {THREADS} + tx < {cp}:
                    s = T.alloc_buffer((1,), "int32", scope="local")
                    s[0] = 0
                    for k in T.serial({subsets}):
                        s[0] = s[0] + subset_sums[k, j * {THREADS} + tx]
                    partial[bx // {chunks}, bx % {chunks}, j * {THREADS} + tx] = s[0]
    for bx in T.thread_binding({-(-n * cp // THREADS)}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            if bx * {THREADS} + tx < {n * cp}:
                t = T.alloc_buffer((1,), "int64", scope="local")
                t[0] = T.int64({-pixels * wl.in_zero})
                for k in T.serial({chunks}):
                    t[0] = t[0] + T.Cast("int64", partial[(bx * {THREADS} + tx) // {cp}, k, (bx * {THREADS} + tx) % {cp}])
                Out[(bx * {THREADS} + tx) // {cp}, 0, 0, (bx * {THREADS} + tx) % {cp}] = T.Cast("int8", T.max(T.min(
                    T.shift_right(t[0] * T.int64({wl.mult}) + T.shift_left(T.int64(1), T.int64({wl.shift - 1})),
                                  T.int64({wl.shift})) + T.int64({wl.out_zero}), T.int64(127)), T.int64({lo})))
'''
    return parse_written_kernel(src)
