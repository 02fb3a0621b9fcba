"""Schedule template of the implicit-GEMM conv on int8 tensor cores: ``mma.sync.m16n8k32``.

Loop nest of the scheduled conv, outermost first (units: 16-row / 16-col / 32-k mma tiles)::

    blockIdx.y   s                     the slice of a split reduction (``splits > 1``; else absent)
    blockIdx.x   fuse(m0, o0)          o0 fastest: neighbouring blocks share their A (im2col) rows
    threadIdx.y  fuse(m1, o1)          warps; warp tile WM x WN = 16*m2 x 16*o2
      conv_init                        mma_fill (accumulators = 0), m2 x o2 fragments
      k0   (software pipeline, `stages` deep; stage 0 = the two copies, async = cp.async)
        im2col -> A_shared [BM, BK]    gather with zero padding, int8x16 predicated cp.async.ca
        weight -> W_shared [BN, BK]    int8x16 cp.async.cg
        k1 (software pipeline, 2 deep: the ldmatrix of step k1 + 1 before the mma of step k1)
          ldmatrix A (m2 fragments 16x32), ldmatrix B (o2 fragments 16x32, "trans" = [n, k])
          m2 x o2 x mma_i8i8i32_trans_b (2 x mma.sync.m16n8k32 each)
      requant  (threadIdx.x = lane)    epilogue on the accumulator fragments: each lane reads
                                       its 8 int32 per 16x16 fragment, requantizes, stores int8

    BM = 16*m1*m2, BN = 16*o1*o2, BK = 32*k1, threads = 32*m1*o1.

* Accumulators: the conv's output buffer in "warp" scope, in the mma C fragment layout; the
  epilogue is re-indexed with the same map (``transform_block_layout``), so each lane reads only
  its own registers: no shared-memory staging, no shuffles.
* Shared rows are padded by 16 bytes: ldmatrix's 8 rows hit 8 distinct 16-byte bank groups.
* Shared memory is dynamic (``shared.dyn``) up to ``DYN_SMEM_BUDGET`` (two 96 KB blocks per
  H100 SM): measured 10-25 % faster than 48 KB static tiles at batch 64 (docs/tensorcore.md).
* The gather goes through L1 (``cp.async.ca``, ``pipeline.py``): the taps of a KxK conv re-read
  the same input rows a few K steps apart.

Decisions, each a sampling instruction of the trace (``decisions`` gives them, else they are
sampled): "m" = [m0, m1, m2] (block rows m1*m2 in {2, 4, 8} fragments, categorical; warps x
fragments, perfect tile), "o" = [o0, o1, o2] (the same for O_p/16), "k" = [k0, k1] (perfect tile,
BK <= 128).  The pipeline depth ``stages`` is fixed per task, not sampled: its annotation is a
constant of the trace, which MetaSchedule's mutators would not update; a sampled tile whose
stages do not fit the shared memory is rejected by VerifyGPUCode.
"""
from __future__ import annotations

import functools

import tvm

from ..kernel import load_tensor_intrin_file
from ..sched_utils import loops_under


@functools.lru_cache(None)
def intrinsics() -> dict:
    """Names of the tensor intrinsics the template uses (registering the missing ones: TVM has
    int8 ldmatrix intrinsics for plain ``shared`` only)."""
    cu = load_tensor_intrin_file("cuda")
    # int8 ldmatrix from dynamic shared memory: TVM registers only the "shared" variants
    dyn = {"ldmatrix_a_dyn": ("mma_ldmatrix_i8_a_dyn", "A", False),
           "ldmatrix_b_dyn": ("mma_ldmatrix_i8_b_trans_dyn", "B", True)}
    for name, matrix, trans in dyn.values():
        if tvm.s_tir.TensorIntrin.get(name, allow_missing=True) is None:
            tvm.s_tir.TensorIntrin.register(name, *cu.get_ldmatrix_intrin(32, "int8", matrix, trans, "shared.dyn"))
    return {
        "ldmatrix_a": cu.LDMATRIX_i8_A_INTRIN,          # shared [16, 32] -> warp [32, 16]
        "ldmatrix_b": cu.LDMATRIX_i8_B_TRANS_INTRIN,    # shared [16 (n), 32 (k)] -> warp [32, 16]
        **{k: v[0] for k, v in dyn.items()},
        "mma": cu.MMA_i8i8i32_TRANS_B_INTRIN,           # 2 x mma.sync.m16n8k32.row.col.s32.s8.s8.s32
        "fill": cu.MMA_fill_16x16_i32_INTRIN,
        "index_map_a": lambda i, j: (i // 16, j // 32, *cu.shared_16x32_to_ldmatrix_32x16_layout(i % 16, j % 32)),
        "index_map_c": lambda i, j: (i // 16, j // 16, *cu.shared_16x16_to_ldmatrix_32x8_layout(i % 16, j % 16)),
    }


STAGE_CHOICES = [2, 3, 4]  # pipeline depths the default considers
BLOCK_FRAGS = [2, 4, 8]  # block tile rows / columns in 16-wide fragments: 32, 64, 128 (divide M_ALIGN)
MAX_FRAGS = 4        # innermost m2 / o2: warp tile up to 64 x 64 (128 int32 accumulators/thread)
MAX_K_STEPS = 4      # BK up to 128
SMEM_PAD = 16        # bytes of padding per shared row (ldmatrix / cp.async bank-conflict free)
DYN_SMEM_BUDGET = 96 * 1024  # dynamic shared memory per block: 2 blocks per SM on sm_80 / sm_90


class InvalidDecisions(ValueError):
    """The (sampled or given) decisions do not make a valid kernel (shared memory)."""


def smem_bytes(d: dict) -> int:
    bm, bn, bk = 16 * d["m"][1] * d["m"][2], 16 * d["o"][1] * d["o"][2], 32 * d["k"][1]
    return d["stages"] * (bm + bn) * (bk + SMEM_PAD)


def apply_mma_schedule(sch: tvm.s_tir.Schedule, decisions: dict | None = None, stages: int = 3) -> dict:
    """Schedule the blocks ``im2col``, ``conv``, ``requant`` of :func:`conv2d_nhwc_int8`'s PrimFunc
    in place (module docstring).  ``decisions`` gives the tiles (sampled when None); ``stages``
    the pipeline depth (>= 2).  Returns the decisions taken, sampled ones included.

    Raises:
        InvalidDecisions: given decisions whose pipeline does not fit the shared memory.
    """
    I = intrinsics()
    d = decisions or {}
    conv, im2col, requant = (sch.get_sblock(b) for b in ("conv", "im2col", "requant"))

    # 16 x 16 x 32 mma tiles; the inner tile becomes the block tensorized by mma_i8i8i32_trans_b.
    # A split reduction (``conv2d_nhwc_int32`` with ``splits > 1``) has one more, outer loop over
    # its slices: each slice a grid row of its own (blockIdx.y), the rest as without it.
    *split_k, m, o, k = sch.get_loops(conv)
    m, m_tc = sch.split(m, [None, 16])
    o, o_tc = sch.split(o, [None, 16])
    k, k_tc = sch.split(k, [None, 32])
    sch.reorder(m, o, k, m_tc, o_tc, k_tc)
    conv_o = sch.blockize(m_tc)

    # Block tile = a categorical choice of 32/64/128 rows (always divides M_p: a multiple of
    # 128) and of 32/64/128 columns dividing O_p; its split into warps x fragments per warp is a
    # perfect tile (<= 4 fragments per warp).  K tile: perfect tile of K/32 (<= 4 mma steps).
    mt, ot = (int(sch.get(l).extent) for l in (m, o))
    bm_c = [c for c in BLOCK_FRAGS if mt % c == 0]
    bn_c = [c for c in BLOCK_FRAGS if ot % c == 0]
    bm_rv = sch.sample_categorical(bm_c, [1 / len(bm_c)] * len(bm_c),
                                   decision=bm_c.index(d["m"][1] * d["m"][2]) if "m" in d else None)
    bn_rv = sch.sample_categorical(bn_c, [1 / len(bn_c)] * len(bn_c),
                                   decision=bn_c.index(d["o"][1] * d["o"][2]) if "o" in d else None)
    m_blk, m_in = sch.split(m, [None, bm_rv])
    o_blk, o_in = sch.split(o, [None, bn_rv])
    m_f = sch.sample_perfect_tile(m_in, n=2, max_innermost_factor=MAX_FRAGS, decision=d["m"][1:] if "m" in d else None)
    o_f = sch.sample_perfect_tile(o_in, n=2, max_innermost_factor=MAX_FRAGS, decision=d["o"][1:] if "o" in d else None)
    k_f = sch.sample_perfect_tile(k, n=2, max_innermost_factor=MAX_K_STEPS, decision=d.get("k"))
    taken = {"m": [mt // int(sch.get(bm_rv))] + [int(sch.get(x)) for x in m_f],
             "o": [ot // int(sch.get(bn_rv))] + [int(sch.get(x)) for x in o_f],
             "k": [int(sch.get(x)) for x in k_f], "stages": stages}
    # Fewer than 2 stages is unusable: TVM's software pipeline with a single async stage waits
    # (cp.async.wait_group 0) *before* committing the iteration's copies, i.e. reads shared memory
    # still in flight; and without async copies the CUDA codegen cannot print the int8x16 zero of
    # the predicated im2col copy.
    if stages < 2:
        raise InvalidDecisions(f"pipeline depth {stages}: the template needs >= 2 stages")
    if decisions is not None and smem_bytes(taken) > DYN_SMEM_BUDGET:
        raise InvalidDecisions(f"{taken}: {smem_bytes(taken)} B of shared memory > {DYN_SMEM_BUDGET}")

    m0, (m1, m2) = m_blk, sch.split(m_in, m_f)
    o0, (o1, o2) = o_blk, sch.split(o_in, o_f)
    k0, k1 = sch.split(k, k_f)
    sch.reorder(m0, o0, m1, o1, k0, k1, m2, o2)
    sch.bind(sch.fuse(m0, o0), "blockIdx.x")
    if split_k:
        sch.bind(split_k[0], "blockIdx.y")
    ty = sch.fuse(m1, o1)
    sch.bind(ty, "threadIdx.y")

    # Accumulators: the conv's own output buffer in "warp" scope, in the mma C fragment layout
    # [M/16, O/16, lane, 8]; the epilogue iterates in that layout (transform_block_layout) so
    # that each lane (threadIdx.x) reads only its own registers.
    sch.set_scope(conv_o, 0, "warp")
    index_map_c = (lambda s, i, j: (s, *I["index_map_c"](i, j))) if split_k else I["index_map_c"]
    sch.transform_layout(requant, ("read", 0), index_map_c)
    sch.transform_block_layout(requant, index_map_c)
    sch.reverse_compute_at(requant, ty, preserve_unit_loops=True)
    r_a, r_b, r_lane, r_local = sch.get_loops(requant)[-4:]
    sch.bind(r_lane, "threadIdx.x")

    # Global -> shared copies (cooperative, int8x16 per thread); storage_align pads each row
    # by 16 bytes (row stride BK+16: ldmatrix's 8 rows hit 8 distinct 16-byte bank groups).
    def fetch(block):
        sch.compute_at(block, k0, preserve_unit_loops=True)
        row, col = sch.get_loops(block)[-2:]
        col, f_v = sch.split(col, [None, 16])  # split first: a vector never straddles a row
        fused = sch.fuse(row, col)
        _, f_y0, f_y1, f_x = sch.split(fused, [None, m_f[0], o_f[0], 32])
        sch.bind(sch.fuse(f_y0, f_y1), "threadIdx.y")
        sch.bind(f_x, "threadIdx.x")
        sch.vectorize(f_v)
        sch.storage_align(block, 0, axis=-2, factor=32, offset=SMEM_PAD)

    scope = "shared.dyn"
    sch.set_scope(im2col, 0, scope)
    fetch(im2col)
    w_sh = sch.cache_read(conv_o, 1, scope)
    fetch(w_sh)

    # Shared -> registers (ldmatrix), per k1 step: m2 A fragments and o2 B fragments
    a_w = sch.cache_read(conv_o, 0, "warp")
    b_w = sch.cache_read(conv_o, 1, "warp")
    sch.compute_at(a_w, k1, preserve_unit_loops=True)
    sch.compute_at(b_w, k1, preserve_unit_loops=True)
    init = sch.decompose_reduction(conv_o, k0)

    def frag(block):
        i, j = sch.get_loops(block)[-2:]
        i0, i1 = sch.split(i, [None, 16])
        j0, j1 = sch.split(j, [None, 32])
        sch.reorder(i0, j0, i1, j1)
        return i0, j0, i1

    a_i0, a_j0, a_in = frag(a_w)
    b_i0, b_j0, b_in = frag(b_w)
    sch.transform_layout(a_w, ("write", 0), I["index_map_a"])
    sch.transform_layout(b_w, ("write", 0), I["index_map_a"])  # B is [n, k]: same 16x32 layout
    sch.tensorize(a_in, I["ldmatrix_a_dyn"])
    sch.tensorize(b_in, I["ldmatrix_b_dyn"])
    sch.tensorize(sch.get_loops(conv)[-3], I["mma"])
    sch.tensorize(sch.get_loops(sch.get_sblock("conv_init"))[-2], I["fill"])

    # Unroll everything that indexes the accumulator / fragment arrays (constant register
    # indices), and the short k1 loop.
    init_loops = loops_under(sch, init, ty)
    for loop in [k1, m2, o2, a_i0, a_j0, b_i0, b_j0, r_a, r_b, r_local] + init_loops:
        sch.unroll(loop)

    # Register double buffering over k1: the ldmatrix of step k1 + 1 is issued before the mma of
    # step k1, so the mma waits on no shared-memory load but the first of each k0 step.  (The
    # ldmatrix and mma calls are volatile asm: nvcc keeps their order, so the pipeline has to be
    # written into the code.)
    sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
    sch.annotate(k1, "software_pipeline_order", [0, 1, 2])

    # Software pipeline over k0: the two copies are stage 0 (async: cp.async), the compute
    # `stages - 1` iterations behind.  k0's body, once k1 is pipelined: the two copies, the k1
    # pipeline's ldmatrix prologue (A, B) and its loop.  (The annotation values are plain ints
    # computed from the decisions: replaying the trace with another stage decision keeps them.)
    sch.annotate(k0, "software_pipeline_stage", [0, 0, stages - 1, stages - 1, stages - 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2, 3, 4])
    sch.annotate(k0, "software_pipeline_async_stages", [0])
    return taken


# Default block tiles (BM, BN) with their 4-warp (2 x 2) arrangement, largest first; a block's
# efficiency ~ sqrt of its arithmetic intensity BM*BN/(BM+BN), normalized to 128 x 128.
DEFAULT_TILES = [(128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32)]


def _k_choice(kt: int, bm: int, bn: int, budget: int = DYN_SMEM_BUDGET):
    """(k1, stages): the largest K tile BK (up to 128) whose pipeline fits ``budget``, then the
    deepest pipeline; the pipeline needs at least `stages - 1` k0 iterations.  BK before depth:
    with the k1 pipeline, BK = 128 x 2 stages ran VGG16's convs at batch 64 1.00-1.13x faster
    than BK = 64 x 4 (longer k1 steps keep the ldmatrix pipeline full; ``docs/history.md``).
    Those convs have >= 18 K steps of 32.  Where K is short (ResNet's 1x1 convs: 2-8 steps) this
    leaves 1-2 K steps per block, so a block's copies barely overlap its math (the other block
    on the SM hides some of it): not measured per layer yet (open in docs/history.md)."""
    best = None
    for kk in (1, 2, 4):
        if kt % kk:
            continue
        for stages in STAGE_CHOICES:
            if (bm + bn) * (32 * kk + SMEM_PAD) * stages > budget or kt // kk < stages - 1:
                continue
            key = (kk, stages)
            if best is None or key > best[0]:
                best = (key, kk, stages)
    return None if best is None else best[1:]


def default_decisions(mp: int, op: int, k: int, num_sm: int, columns: int | None = None) -> tuple[dict, int]:
    """Heuristic (untuned) tiles and pipeline depth for an (M_p, O_p, K) implicit GEMM.

    Block tile: among :data:`DEFAULT_TILES` that divide (M_p, O_p) (and are ``columns`` wide, where
    given: the grouped GEMMs' one super-group a block, ``grouped_gemm.py``), minimize the estimated time
    ceil(blocks / num_sm) x BM*BN / efficiency(BM, BN) (the busiest SM's work): large tiles unless
    they leave SMs idle (small batch-1 layers then get 32x32 / 64x64 tiles; no split-K).  Warps
    2 x 2, warp tile BM/2 x BN/2.  K: :func:`_k_choice`.

    Returns:
        (decisions, stages).
    """
    mt, ot, kt = mp // 16, op // 16, k // 32
    best = None
    for bm, bn in DEFAULT_TILES:
        if (mp % bm) or (op % bn) or (columns is not None and bn != columns):
            continue
        kc = _k_choice(kt, bm, bn)
        if kc is None:
            continue
        blocks = (mp // bm) * (op // bn)
        eff = (bm * bn / (bm + bn) / 64.0) ** 0.5
        t = -(-blocks // num_sm) * bm * bn / eff
        if best is None or t < best[0]:
            best = (t, bm, bn, kc)
    if best is None:
        raise InvalidDecisions(f"no mma tile fits the GEMM M_p={mp} O_p={op} K={k}")
    _, bm, bn, (kk, stages) = best
    return {"m": [mt // (bm // 16), 2, bm // 32], "o": [ot // (bn // 16), 2, bn // 32], "k": [kt // kk, kk]}, stages


def gemm_extents(sch: tvm.s_tir.Schedule) -> tuple[int, int, int]:
    """(M_p, O_p, K) of a :func:`conv2d_nhwc_int8` PrimFunc, read off its conv block's loops (a
    split reduction's: K of one slice)."""
    return tuple(int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock("conv"))[-3:])
