"""Default (untuned) llvm schedule of the fused int8 conv kernel (:func:`conv2d_nchw4c_int8`).

Structure, outermost first::

    parallel  fused(n, oc_outer / OCT, oh)        one output row of OCT*4 channels per task
      pad       kh input rows x full padded width x every input channel (a plain copy)
      W_tile    this task's weights, re-laid out [rc, ry, rx, rci, OCT, oci]
      serial    ow / OWT
        init      acc[OWT, OCT*4] = 0
        serial    rc, ry, rx
          unroll    rci, OWT                      register tile of OWT x OCT*4 int32
            vectorize OCT*4 output channels       one contiguous int8 weight vector
        requant   acc -> int8 (epilogue, fused here by reverse_compute_at)

Why this shape:

* The vector axis is the OCT*4 output channels (up to 32 lanes): per (rci, ow) the inner step
  is one broadcast input byte times one contiguous weight vector added into OCT*4 int32
  accumulators.  That needs the weights in ``[.., rci, oc]`` order, which ``W`` (``[oc, .., oci,
  rci]``) is not, hence the per-task ``W_tile`` copy (reused ``ow`` times) and the accumulator
  re-laid out ``[.., oc // OCT, .., oc % OCT, oci]``.  Vectorising over the 4 ``oci`` only (the
  natural layout) ran at 40% of the speed with AVX-512.  OCT is a power of two: 12- or
  20-lane vectors (3 or 5 oc blocks) ran 3-5x slower than 4 lanes.
* The accumulator tile is fully unrolled so LLVM keeps it in registers; each weight vector is
  reused OWT times and each input byte OCT*4 times.
* ``pad`` is materialised per task so the multiply-add loop has no bounds test (inlining it
  puts an ``if_then_else`` in every multiply-add).
* Tile sizes are divisors of the workload's extents (``_largest_divisor``), so no partial tile
  and no predicate in the unrolled body; an output width with no useful divisor (a prime such
  as 113) falls back to a predicated partial tile, which is still better than a 1-wide tile.

The speed depends on the llvm target's ISA: with no ``mcpu`` LLVM targets baseline x86-64
(SSE2, no 32-bit vector multiply), so give the target an ``mcpu`` (e.g.
``tvm.target.codegen.llvm_get_system_cpu()``) for AVX2/AVX-512 code.
"""
from __future__ import annotations

import tvm
from tvm import tirx

# Register tile: OWT x OCT*4 int32 accumulators (4 x 32 = 128 int32 = 8 zmm / 16 ymm).  On the
# 64->64 56x56 layer (2 Zen 4 cores, AVX-512) 8x4 ran 65 GOP/s, 4x4 62, 4x8 55, 2x8 48.
MAX_OC_TILE = 8   # oc_outer blocks (of 4 channels) per task: the 32-lane vector
MAX_OW_TILE = 4   # output columns per register tile


def _largest_divisor(n: int, cap: int) -> int:
    """Largest d <= cap dividing n (1 if none): a tile size that leaves no partial tile."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _ow_tile(ow: int) -> int:
    """A divisor of ow near MAX_OW_TILE: <= MAX_OW_TILE, else up to twice that (7 for 7, 14,
    ...); with none (ow = 113), MAX_OW_TILE with a predicated partial tile, which on a CPU is
    cheaper than a 1-wide register tile (no tensorize here for a predicate to break)."""
    for cap in (MAX_OW_TILE, 2 * MAX_OW_TILE):
        d = _largest_divisor(ow, cap)
        if d >= min(ow, MAX_OW_TILE - 1):
            return d
    return min(ow, MAX_OW_TILE)


def default_tiles(func: tirx.PrimFunc) -> tuple[int, int]:
    """(oc tile in blocks of 4 channels, ow tile): the heuristic choice of :func:`schedule_cpu`."""
    sch = tvm.s_tir.Schedule(func)
    _, oc, _, x, *_ = sch.get_loops(sch.get_sblock("conv"))
    occ, ow = (int(sch.get(l).extent) for l in (oc, x))
    return max(d for d in (1, 2, 4, 8) if d <= MAX_OC_TILE and occ % d == 0), _ow_tile(ow)


def tile_choices(func: tirx.PrimFunc) -> tuple[list[int], list[int]]:
    """The tiles the ``template`` search space samples from (``cpu_space.py``): every
    power-of-two oc tile up to 16 blocks (64 lanes) dividing the blocks, and ow tiles of 1 to
    2 * MAX_OW_TILE (divisors, plus the heuristic's own choice)."""
    sch = tvm.s_tir.Schedule(func)
    _, oc, _, x, *_ = sch.get_loops(sch.get_sblock("conv"))
    occ, ow = (int(sch.get(l).extent) for l in (oc, x))
    octs = [d for d in (1, 2, 4, 8, 16) if occ % d == 0]
    owts = sorted({d for d in range(1, min(ow, 2 * MAX_OW_TILE) + 1) if ow % d == 0} | {_ow_tile(ow)})
    return octs, owts


def schedule_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Schedule :func:`conv2d_nchw4c_int8`'s PrimFunc for an llvm target.

    Args:
        func: the unscheduled PrimFunc (blocks ``pad``, ``conv``, ``requant``).
    Returns:
        The scheduled PrimFunc, with attr ``tir.is_scheduled`` so dlight leaves it alone.

    Example::

        f = schedule_cpu(conv2d_nchw4c_int8(Conv2dWorkload(1, 64, 56, 56, 64)))
        ex = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    """
    sch = tvm.s_tir.Schedule(func)
    apply_cpu_schedule(sch, *default_tiles(func))
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def apply_cpu_schedule(sch: tvm.s_tir.Schedule, octile: int | None = None, owt: int | None = None) -> None:
    """The schedule above, applied to ``sch`` in place with the given tiles; a tile left None
    is sampled (``sample_categorical`` over :func:`tile_choices`, uniform): the search space."""
    func = sch.mod["main"]
    if octile is None or owt is None:
        octs, owts = tile_choices(func)
        if octile is None:
            octile = int(sch.get(sch.sample_categorical(octs, [1.0 / len(octs)] * len(octs))))
        if owt is None:
            owt = int(sch.get(sch.sample_categorical(owts, [1.0 / len(owts)] * len(owts))))
    conv, pad, requant = (sch.get_sblock(b) for b in ("conv", "pad", "requant"))
    n, oc, y, x, oci, rc, ry, rx, rci = sch.get_loops(conv)

    oco, oct_l = sch.split(oc, [None, octile])
    xo, xt = sch.split(x, [None, owt])
    sch.reorder(n, oco, y, xo, rc, ry, rx, rci, xt, oct_l, oci)
    task = sch.fuse(n, oco, y)
    sch.parallel(task)

    sch.compute_at(pad, task)
    sch.vectorize(sch.get_loops(pad)[-1])  # the 4 channels of one int8x4 word

    # Output channels contiguous in the accumulator and in the weight copy: the vector axis.
    sch.transform_layout(conv, ("write", 0),
                         lambda n, oc, y, x, oci: (n, oc // octile, y, x, oc % octile, oci))
    w_tile = sch.cache_read(conv, 1, "global")
    sch.transform_layout(w_tile, ("write", 0),
                         lambda oc, rc, ry, rx, oci, rci: (oc // octile, rc, ry, rx, rci, oc % octile, oci))
    sch.compute_at(w_tile, task)

    sch.reverse_compute_at(requant, xo)
    sch.vectorize(sch.get_loops(requant)[-1])

    # Annotate before decompose_reduction: vectorize needs the block to still own its init.
    sch.unroll(rci)
    sch.unroll(xt)
    sch.vectorize(sch.fuse(oct_l, oci))
    sch.decompose_reduction(conv, rc)
