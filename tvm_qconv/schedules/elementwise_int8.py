"""CUDA schedule of the memory-bound int8 elementwise kernels (residual add, stand-alone affine):
16 bytes per thread, loaded and stored as one 128-bit access each.

Why: left to dlight, the residual add issued one 1-byte load per operand per thread.  Profiled
in ResNet-50 at batch 64 (H200, ``benchmarks/kernel_profile.py``, docs/history.md) its 16
adds took 1.20 of the 3.37 ms of GPU time, the 56 x 56 ones 0.18 ms each: 0.83 TB/s for
154 MB of traffic on a 4.8 TB/s GPU.

The schedule: the innermost axis of the packed layout (channels: 32 in NHWC32, 4 in NCHW4c) is
split into ``VEC``-element vectors (16, or the largest power of two dividing it), every other axis
fused with the vector index and spread over blocks of ``THREADS`` threads; each thread copies its
vector of every full-size operand into registers with one vector load, computes the elementwise
body element by element (the same integer expression as the compute definition, so bit-exact),
and writes the vector back with one store.  A block has as many threads as divide the vector
count (``block_threads``): no thread is idle, so none needs a guard.  Splitting only the innermost axis keeps each vector
inside one row of the buffer, which TVM's region analysis needs to see a contiguous load.
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx

THREADS = 256
VEC = 16   # bytes per thread: one 128-bit load per operand


def block_threads(vectors: int) -> int | None:
    """Threads per block for ``vectors`` vectors: the largest divisor of ``vectors`` up to
    ``THREADS``, so that no thread of the grid is idle; None where that is under a warp (the
    grid then has a tail, and its threads store element by element).

    Why a divisor: with a tail, the vector store (``cache_write`` + ``reverse_compute_at``) loses
    the tail's guard in TVM 0.27 -- the idle threads would store past the end of the output (seen
    on a CPU twin: the register buffer came out sized for the whole last block, unguarded)."""
    threads = max(d for d in range(1, THREADS + 1) if vectors % d == 0)
    return threads if threads >= 32 else None


def schedule_elementwise(func: tirx.PrimFunc, target: tvm.target.Target, block: str,
                         operands: tuple[int, ...]) -> tirx.PrimFunc | None:
    """CUDA: ``func``'s one elementwise ``block`` with the reads of ``operands`` (the indices of
    its reads that have the output's shape: the add's two inputs, the affine's data) vectorized.
    None elsewhere (llvm runs the compute definition)."""
    if target.kind.name != "cuda":
        return None
    sch = tvm.s_tir.Schedule(func)
    blk = sch.get_sblock(block)
    loops = sch.get_loops(blk)
    extents = [int(sch.get(loop).extent) for loop in loops]
    vec = next(v for v in (VEC, 8, 4, 2, 1) if extents[-1] % v == 0)
    vectors = math.prod(extents) // vec
    threads = block_threads(vectors)
    vector_outer, lane = sch.split(loops[-1], [None, vec])
    bx, tx = sch.split(sch.fuse(*loops[:-1], vector_outer), [None, threads or THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    for i in operands:
        load = sch.cache_read(blk, i, "local")
        sch.compute_at(load, tx)
        sch.vectorize(sch.get_loops(load)[-1])
    if threads:
        store = sch.cache_write(blk, 0, "local")
        sch.reverse_compute_at(store, tx)
        sch.vectorize(sch.get_loops(store)[-1])
    sch.unroll(lane)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
