"""CUDA schedule of the conversions between a float NCHW tensor and the NHWC32 int8 layout
(``quantize_pack_nhwc32``, ``dequantize_unpack_nhwc32``): a transpose, so one side's threads
must walk the pixels and the other side's the channels.

Why: left to dlight, each thread took one output element with consecutive threads on
consecutive *channels* of the NHWC32 side, so the float NCHW side -- four times the bytes -- was
read (or written) at a stride of a whole feature map per thread.  Profiled in EfficientNet-B0 at
batch 64 (H100, 2026-11-26, ``benchmarks/kernel_profile.py``, docs/history.md) the 131
quantize / dequantize kernels around its float SiLUs and squeeze-excite gates took 5.0 of its
9.6 ms of GPU time; the largest quantize (64 x 96 x 112 x 112, 385 MB moved) 526 us: 0.73 TB/s.

The schedule: the channel axis is split into ``V``-channel vectors (16, or the largest power of
two dividing it), and the loops are ordered (image, channel vector, row, column) with the column
innermost of the thread index, so consecutive threads sit on consecutive *pixels*: each of a
thread's ``V`` float accesses is one coalesced 128-byte warp access on the NCHW side, and its
``V`` int8 channels of the NHWC32 side are one vector access (16 bytes at ``V`` = 16).  A block has
as many threads as divide the vector count (``elementwise_int8.block_threads``); where that is
under a warp, the grid has a tail and the int8 side is accessed element by element (so it is
where the channel count is odd: a vector of one).
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx

from .elementwise_int8 import THREADS, block_threads

VEC = 16  # int8 channels per thread: one 128-bit access of the NHWC32 side


def _vector(channels: int) -> int:
    return next(v for v in (VEC, 8, 4, 2, 1) if channels % v == 0)


def _pixel_threads(sch, loops, channel: int):
    """Split ``loops[channel]`` into vectors, order (image, vector, row, column, lane), bind the
    first four fused to blocks x threads; returns (thread loop, or None when the grid has a tail
    or the vector is one channel: no vector access then, lane loop)."""
    extents = [int(sch.get(loop).extent) for loop in loops]
    vec = _vector(extents[channel])
    outer, lane = sch.split(loops[channel], [None, vec])
    image, rest = loops[0], [loop for i, loop in enumerate(loops) if i not in (0, channel)]
    sch.reorder(image, outer, *rest, lane)
    vectors = math.prod(extents) // vec
    threads = block_threads(vectors)
    bx, tx = sch.split(sch.fuse(image, outer, *rest), [None, threads or THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return (tx if threads and vec > 1 else None), lane


def _schedule(func: tirx.PrimFunc, target, block: str, channel: int, int8_is_output: bool):
    """Threads on pixels; the int8 side (the output of a quantize, the input of a dequantize)
    staged in registers and accessed as one vector.  None off CUDA (llvm runs the compute)."""
    if target.kind.name != "cuda":
        return None
    sch = tvm.s_tir.Schedule(func)
    blk = sch.get_sblock(block)
    tx, lane = _pixel_threads(sch, sch.get_loops(blk), channel)
    if tx is not None:
        if int8_is_output:
            stage = sch.cache_write(blk, 0, "local")
            sch.reverse_compute_at(stage, tx)
        else:
            stage = sch.cache_read(blk, 0, "local")
            sch.compute_at(stage, tx)
        sch.vectorize(sch.get_loops(stage)[-1])
    sch.unroll(lane)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def schedule_quantize_nhwc32(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """float [N, C, H, W] -> int8 [N, H, W, C32]: a vector of channels stored at once."""
    return _schedule(func, target, "quantize_pack", channel=3, int8_is_output=True)


def schedule_dequantize_nhwc32(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """int8 [N, H, W, C32] -> float [N, C, H, W]: a vector of channels loaded at once."""
    return _schedule(func, target, "dequantize_unpack", channel=1, int8_is_output=False)
