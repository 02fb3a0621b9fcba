"""Default (untuned) CUDA schedule of the fused int8 conv kernel, on ``__dp4a``.

Each ``dp4a`` multiplies the 4 input channels ``rci`` of one int8x4 input word with the same 4
of one output channel's filter word: the compute definition's innermost reduction axis, 4 wide,
so the schedule tensorizes it with ``dp4a_s8s8s32`` (A, B int8x4 in shared memory, C an int32 in
registers).

Tiling, outermost first (``_plan`` picks the sizes from the workload)::

    blockIdx.z  n * (oc_outer / OCB)    blockIdx.y  oh / YB    blockIdx.x  ow / XT
    threadIdx.x (OCT, YT, XT)           one thread per (oc-group, row-group, column), columns
                                        fastest: a warp reads consecutive input words from
                                        shared memory (no bank conflict) and stores
                                        consecutive int8x4 output words (coalesced)
      rc / RC                           shared tiles: padded input [RC, rows, cols, 4] and
                                        weights [OCB, RC, kh, kw, 4, 4], cooperative
                                        vectorized loads (int8x4 input words, int8x16 weights)
        rc % RC, ry, rx
          OCR, YR, oci (unrolled)       OCR*4 x YR int32 accumulators in registers
            rci -> __dp4a
      requant                           epilogue straight from the registers (reverse_compute_at)

    OCB = OCT*OCR oc_outer blocks (of 4 channels), YB = YT*YR rows, XT columns.

Every tile size divides its extent (``_divisors``): a non-dividing split puts a predicate on
the conv block, and a predicated block no longer matches the dp4a description.  ``_plan`` gives
up register tiles on small batch-1 layers to keep SMs busy, picks the block shape for SM
balance and whole warps, and the reduction tile RC for the shared-memory budget.  Tile sizes
are heuristics for H100/H200-class GPUs, not tuned: MetaSchedule is for that.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm.sym
from tvm import tirx
from tvm.s_tir.meta_schedule.postproc import RewriteParallelVectorizeUnroll

from tvm_qconv.target import TargetInfo

from ..kernel import WORKLOAD_ATTR, load_tensor_intrin_file
from ..sched_utils import divisor_at_most, loops_under
from ..workload import ConvWorkload
from .conv2d import group_blocks

DP4A_INTRIN = "dp4a_s8s8s32"

# Heuristic caps of the default tile (see _plan).
MAX_OC_REG = 4        # oc_outer blocks per thread (x4 channels): 16 output channels in registers
MAX_Y_REG = 2         # output rows per thread
MAX_OC_THREADS = 8    # threads along oc_outer
MAX_XT = 32           # threads (= output columns) along ow: 32 x int8x4 = one 128-byte line
MAX_YT = 16           # threads along oh
MAX_THREADS = 256
THREADS_PER_SM = 128  # give up register tiling before the grid has fewer threads than SMs x this
SMEM_TARGET = 24 * 1024  # shared tiles per block we aim for (leaves room for 2+ blocks per SM)

# The search space's caps on the innermost (register / reduction) tile of each axis; the
# sampled tiles must still fit the target's threads and shared memory (VerifyGPUCode).
MAX_OC_INNER = 8      # 32 output channels per thread
MAX_Y_INNER = 4
MAX_X_INNER = 4
MAX_RC_INNER = 32     # 128 input channels per shared tile
UNROLL_STEPS = [0, 16, 64, 512]  # 1024 (MetaSchedule's largest) made tuning rounds 2-10x longer on the H100


def _ensure_dp4a_registered() -> None:
    """Register ``dp4a_s8s8s32`` without importing all of ``tvm.s_tir.tensor_intrin``.

    The dp4a intrinsics live in ``dot_product_common.py``, which needs only ``tvm.s_tir``
    (``load_tensor_intrin_file`` says why not the whole package).
    """
    if tvm.s_tir.TensorIntrin.get(DP4A_INTRIN, allow_missing=True) is not None:
        return
    load_tensor_intrin_file("dot_product_common")
    if tvm.s_tir.TensorIntrin.get(DP4A_INTRIN, allow_missing=True) is None:  # imported before, yet missing
        raise RuntimeError(f"tvm.s_tir.tensor_intrin.dot_product_common does not register {DP4A_INTRIN}")


def _next_smaller_divisor(n: int, d: int) -> int:
    return divisor_at_most(n, d - 1) if d > 1 else 1


@dataclass
class Dp4aTiles:
    """The decisions of the dp4a schedule (module docstring: OCB = oct*ocr, YB = yt*yr, XB = xt*xr)."""

    ocr: int  # oc_outer blocks per thread (registers, x4 channels)
    oct: int  # threads along oc_outer
    yr: int   # output rows per thread (registers)
    yt: int   # threads along oh
    xt: int   # threads along ow
    rc: int   # ic_outer blocks per shared tile
    xr: int = 1      # output columns per thread (registers)
    unroll: int = 0  # explicit unroll depth of the reduction loops, one of UNROLL_STEPS

    @property
    def threads(self) -> int:
        return self.oct * self.yt * self.xt


def _smem_bytes(p: Dp4aTiles, kh, kw, sh, sw, dh, dw) -> int:
    rows = (p.yt * p.yr - 1) * sh + (kh - 1) * dh + 1
    cols = (p.xt * p.xr - 1) * sw + (kw - 1) * dw + 1
    return p.rc * 4 * (rows * cols + p.oct * p.ocr * 4 * kh * kw)


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _plan(batch, occ, oh, ow, icc, kernel, stride, dilation, smem_max, max_threads, num_sm,
          oc_group: int | None = None) -> Dp4aTiles:
    """Pick divisor tile sizes for one workload.

    1. Registers: OCR x YR outputs (x4 channels) per thread, shrunk while the whole grid would
       have fewer than ``num_sm * THREADS_PER_SM`` threads (batch-1 layers on small feature maps).
    2. Block (OCT, YT, XT), among divisor triples of <= MAX_THREADS threads whose shared tiles
       fit ``smem_max`` with RC=1, the best by: the product of SM balance (blocks / (num_sm x
       waves)), warp efficiency (no partial warps) and block size up to 128 threads (latency
       hiding), then more threads, then wider rows (coalescing, less halo), then taller tiles.
    3. RC: the largest divisor of ic_outer whose shared tiles fit SMEM_TARGET.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    yr = divisor_at_most(oh, MAX_Y_REG)
    # Grouped convs: a block's output channels stay inside one group (``oc_group`` blocks of 4),
    # so its shared input tile holds one group's channels, not the span of several.
    oc_span = oc_group or occ
    ocr = divisor_at_most(oc_span, MAX_OC_REG)
    while batch * occ * oh * ow < num_sm * THREADS_PER_SM * ocr * yr and ocr * yr > 1:
        if ocr > 2 or (yr == 1 and ocr > 1):
            ocr = _next_smaller_divisor(oc_span, ocr)
        else:
            yr = 1
    max_threads = min(MAX_THREADS, max_threads)

    def key(q: Dp4aTiles):
        blocks = batch * (occ // (q.ocr * q.oct)) * (oh // (q.yr * q.yt)) * (ow // (q.xt * q.xr))
        balance = blocks / (num_sm * -(-blocks // num_sm))
        warp_eff = q.threads / (32 * -(-q.threads // 32))
        return (round(balance * warp_eff * min(q.threads, 128) / 128, 2), q.threads, q.xt, q.yt)

    # Grouped convs: a block of several threads' output channels must span exactly one group
    # (or be one thread's channels): for a part of a group split over threads, TVM's region
    # analysis cannot prove the block reads one group's input channels and sizes the shared
    # input tile for all of them (ResNeXt-50's 1024-channel layer at batch 1: 241 KB, past the
    # 48 KB of static shared memory; ptxas refuses it).
    cands = [Dp4aTiles(ocr, o, yr, y, x, 1)
             for o in _divisors(oc_span // ocr, MAX_OC_THREADS)
             for y in _divisors(oh // yr, MAX_YT)
             for x in _divisors(ow, MAX_XT)
             if o * y * x <= max_threads and (oc_group is None or o == 1 or o * ocr == oc_span)]
    fits = [q for q in cands if _smem_bytes(q, kh, kw, sh, sw, dh, dw) <= smem_max]
    if not fits:
        raise ValueError(f"no dp4a tile fits {smem_max} B of shared memory (kernel {kernel}, dilation {dilation})")
    p = max(fits, key=key)
    budget = min(SMEM_TARGET, smem_max)
    p.rc = max([d for d in range(1, icc + 1) if icc % d == 0
                and _smem_bytes(Dp4aTiles(p.ocr, p.oct, p.yr, p.yt, p.xt, d), kh, kw, sh, sw, dh, dw) <= budget],
               default=1)
    return p


def _cooperative_fetch(sch, block, at_loop, thread_factors, nvec: int) -> None:
    """Spread a cache block's copy (placed under ``at_loop`` with unit loops kept) over the
    block's threads: the copy loops but the last ``nvec`` (4 wide each, one vector load) are
    fused and split by the thread tile factors, whose fused product is threadIdx.x."""
    own = loops_under(sch, block, at_loop)
    inner = sch.fuse(*own[-nvec:]) if nvec > 1 else own[-1]
    split = sch.split(sch.fuse(*own[:-nvec]), [None, *thread_factors])
    sch.bind(sch.fuse(*split[1:]), "threadIdx.x")
    sch.vectorize(inner)


def apply_dp4a_schedule(sch: tvm.s_tir.Schedule, tiles: Dp4aTiles | None = None) -> None:
    """Schedule the blocks ``pad``, ``conv``, ``requant`` of ``sch`` in place (see the module
    docstring), with the tile sizes ``tiles``, or sampled ones when ``tiles`` is None.

    Every choice is a sampling instruction of the trace (``sample_perfect_tile`` per tiled
    axis, ``sample_categorical`` for the unroll depth), with ``tiles`` as its decision when
    given: the default schedule and each MetaSchedule candidate are the same program with other
    decisions, so the search's mutators (tile sizes, unroll) move between them, and the default
    can seed the search (``tvm_qconv/tuning.py``).  Unit loops are kept at every compute_at,
    so the number of loops, and with it the trace, does not depend on the decisions.  The
    unroll depth is a ``meta_schedule.unroll_explicit`` annotation that MetaSchedule's
    ``RewriteParallelVectorizeUnroll`` postprocessor turns into the pragma.
    """
    conv, pad, requant = (sch.get_sblock(b) for b in ("conv", "pad", "requant"))
    n, oc, y, x, oci, rc, ry, rx, rci = sch.get_loops(conv)

    def tile(loop, parts, decision, max_inner):
        return sch.sample_perfect_tile(loop, n=parts, max_innermost_factor=max_inner, decision=decision)

    t = tiles
    occ, oh, ow, icc = (int(sch.get(l).extent) for l in (oc, y, x, rc))
    oc_f = tile(oc, 3, t and [occ // (t.oct * t.ocr), t.oct, t.ocr], MAX_OC_INNER)
    y_f = tile(y, 3, t and [oh // (t.yt * t.yr), t.yt, t.yr], MAX_Y_INNER)
    x_f = tile(x, 3, t and [ow // (t.xt * t.xr), t.xt, t.xr], MAX_X_INNER)
    rc_f = tile(rc, 2, t and [icc // t.rc, t.rc], MAX_RC_INNER)
    unroll = sch.sample_categorical(UNROLL_STEPS, [1 / len(UNROLL_STEPS)] * len(UNROLL_STEPS),
                                    decision=t and UNROLL_STEPS.index(t.unroll))

    # Each thread's registers cover a contiguous box (oc_r, y_r, x_r innermost): reverse_compute_at
    # takes the bounding box of what a thread computes, so a strided per-thread tile would
    # make the epilogue read other threads' accumulators.
    oc_b, oc_t, oc_r = sch.split(oc, oc_f)
    y_b, y_t, y_r = sch.split(y, y_f)
    x_b, x_t, x_r = sch.split(x, x_f)
    rc_o, rc_i = sch.split(rc, rc_f)
    sch.reorder(n, oc_b, y_b, x_b, oc_t, y_t, x_t, rc_o, rc_i, ry, rx, oc_r, y_r, x_r, oci, rci)
    sch.bind(sch.fuse(n, oc_b), "blockIdx.z")
    sch.bind(y_b, "blockIdx.y")
    sch.bind(x_b, "blockIdx.x")
    tx = sch.fuse(oc_t, y_t, x_t)
    sch.bind(tx, "threadIdx.x")
    threads = [oc_f[1], y_f[1], x_f[1]]

    sch.set_scope(conv, 0, "local")
    sch.reverse_compute_at(requant, tx, preserve_unit_loops=True)

    sch.set_scope(pad, 0, "shared")
    sch.compute_at(pad, rc_o, preserve_unit_loops=True)
    _cooperative_fetch(sch, pad, rc_o, threads, 1)   # int8x4: one input word
    w_sh = sch.cache_read(conv, "W", "shared")
    sch.compute_at(w_sh, rc_o, preserve_unit_loops=True)
    _cooperative_fetch(sch, w_sh, rc_o, threads, 2)  # int8x16: one 4o x 4i filter tap

    # The epilogue computes (in int64) into registers, and a copy stores them as int8x4 words:
    # vectorizing the epilogue itself would make int64x4 vectors, 32 bytes, which
    # MetaSchedule's VerifyGPUCode rejects (max 16 bytes per vector).
    store = sch.cache_write(requant, 0, "local")
    sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
    init = sch.decompose_reduction(conv, rc_o)
    sch.tensorize(rci, DP4A_INTRIN)
    # Unroll every loop over the accumulators so they stay in registers (constant indices).
    for loop in ([oc_r, y_r, x_r, oci] + loops_under(sch, init, tx) + loops_under(sch, requant, tx)
                 + loops_under(sch, store, tx)[:-1]):
        sch.unroll(loop)
    sch.vectorize(loops_under(sch, store, tx)[-1])
    # The reduction loops (rc_i, ry, rx) are unrolled up to the sampled depth.
    sch.annotate(sch.get_sblock("root"), "meta_schedule.unroll_explicit", unroll)


def default_tiles(func: tirx.PrimFunc, target: tvm.target.Target, wl: ConvWorkload | None = None) -> Dp4aTiles:
    """The heuristic tile sizes (``_plan``) of :func:`conv2d_nchw4c_int8`'s PrimFunc on ``target``.

    Args:
        func: the unscheduled PrimFunc.
        target: the CUDA target.
        wl: the conv's workload; default: the PrimFunc's ``tvm_qconv.workload`` attribute.  The
            loops give every extent but the group size, so a function without that attribute
            (the tuner's :func:`~tvm_qconv.tuning.tasks.task_func` form) and no ``wl`` is
            planned as one group: a grouped conv then gets blocks spanning two groups, whose
            shared input tile holds both groups' channels.
    """
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    info = TargetInfo.from_target(target)
    sch = tvm.s_tir.Schedule(func)
    conv = sch.get_sblock("conv")
    n, oc, y, x, _, rc, ry, rx, _ = sch.get_loops(conv)
    batch, occ, oh, ow, icc, kh, kw = (int(sch.get(l).extent) for l in (n, oc, y, x, rc, ry, rx))
    stride, dilation = _stride_dilation(sch, conv)
    if wl is None and func.attrs is not None and WORKLOAD_ATTR in func.attrs:
        wl = ConvWorkload.of(func)
    oc_group = group_blocks(wl)[1] if wl is not None and wl.groups > 1 else None
    return _plan(batch, occ, oh, ow, icc, (kh, kw), stride, dilation, info.max_shared_memory_per_block,
                 info.max_threads_per_block, info.num_sm, oc_group)


def schedule_dp4a(func: tirx.PrimFunc, target: tvm.target.Target,
                  tiles: Dp4aTiles | None = None) -> tirx.PrimFunc:
    """Schedule :func:`conv2d_nchw4c_int8`'s PrimFunc for CUDA with a ``__dp4a`` inner product.

    Args:
        func: the unscheduled PrimFunc (blocks ``pad``, ``conv``, ``requant``; the
            ``requantize=False`` variant too).
        target: the CUDA target; ``max_shared_memory_per_block`` caps the shared tiles
            (48 KB when absent) and ``max_threads_per_block`` the threads.
        tiles: the tile sizes; default :func:`default_tiles`.
    Returns:
        The scheduled PrimFunc with attr ``tir.is_scheduled`` (dlight leaves it alone).

    Example::

        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", ...}, host="llvm")
        f = schedule_dp4a(conv2d_nchw4c_int8(Conv2dWorkload(1, 64, 56, 56, 64)), target)
        ex = tvm.compile(tvm.IRModule({"main": f}), target=target)
    """
    _ensure_dp4a_registered()
    tiles = tiles or default_tiles(func, target)
    sch = tvm.s_tir.Schedule(func)
    apply_dp4a_schedule(sch, tiles)
    if not RewriteParallelVectorizeUnroll().apply(sch):  # the unroll annotation -> pragma
        raise RuntimeError("RewriteParallelVectorizeUnroll failed on the default dp4a schedule")
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def _stride_dilation(sch, conv):
    """(stride, dilation) of the conv, read off its input index ``y * sh + ry * dh``."""
    block = sch.get(conv)
    iv = [v.var for v in block.iter_vars]  # n, oc, y, x, oci, rc, ry, rx, rci
    region = [r for r in block.reads if r.source.name == "pad"][0].region
    (sh, dh, _), (sw, dw, _) = (
        [int(c) for c in tvm.sym.detect_linear_equation(region[axis].min, [iv[o], iv[r]])]
        for axis, o, r in ((2, 2, 6), (3, 3, 7)))
    return (sh, sw), (dh, dw)
