"""MetaSchedule search spaces of the fused int8 conv on CUDA: every candidate runs on ``__dp4a``.

The tuned twins of ``dp4a.py``: instead of one heuristic tile, MetaSchedule samples
candidates from a space, measures them and learns which to try next (``tvm_qconv/tuning/``,
``tune.py``).  Two spaces, picked by name (``SPACES``, ``tune.py --space``):

``template`` (the default): the default schedule itself, with its decisions sampled
    (``apply_dp4a_schedule(sch, tiles=None)``): the tiles of output channels, rows and columns
    into block / thread / register parts, the reduction tile of the shared-memory stage, the
    unroll depth.  Structure fixed by hand (shared tiles of input and weights per reduction
    step, int8x4 / int8x16 vector loads spread over all threads, dp4a on register
    accumulators, epilogue from registers), numbers searched.  About half the random samples
    pass the GPU checks (measured on CPU over VGG16 shapes: 47-78 %), the default schedule is
    one point of the space (so tuning can start from it), and the evolutionary search's tile
    and unroll mutators move between its points.

``mlt``: MetaSchedule's generic ``MultiLevelTilingWithIntrin`` on the same kernel, free to pick
    the loop structure too.  Rules, in the order PostOrderApply runs them over the blocks
    (``requant``, ``conv``, ``pad``):

    1. ``MultiLevelTilingWithIntrin(dp4a_s8s8s32)`` on ``conv``: splits off the 4-wide ``rci``
       reduction as the dp4a block, tiles the rest ``SSSRRSRS`` (spatial tiles bound to
       blockIdx.x / vthread.x / threadIdx.x, then reduction and register tiles), reads both
       operands through shared memory at the outer reduction tile (the intrinsic wants A and B in
       "shared") and accumulates in registers (C in "local").  The plain ``MultiLevelTiling`` is
       left out on purpose, so no candidate falls back to scalar int8 multiply-adds.  For sm_90 the
       rule also emits two software-pipelined variants of the sketch (3 sketches in all).
    2. ``AutoInline`` after tiling: ``pad`` is inlined into the shared-memory copy of the input
       (the zero border is produced while loading the tile, no padded copy in global memory), and
       ``requant`` is reverse-inlined into the register write-back, so the epilogue runs on the
       accumulators and each output is written once, as int8.  Running it before tiling would
       inline ``pad`` into ``conv``, and the conditional load no longer matches the dp4a operand.
    3. ``ParallelizeVectorizeUnroll`` (unroll depth sampled) and ``AutoBind`` (binds any block
       left outside the thread loops).

    Postprocessors turn the annotations into code and reject what cannot run: cooperative
    fetches across the block's threads, VerifyGPUCode (threads per block in [32, 1024], shared
    memory <= the target's 48 KB), then the tensorize itself.  VerifyGPUCode rejects ~94% of
    random samples (mostly fewer than 32 threads or too much shared memory: the tile factors
    are sampled independently per axis); the evolutionary search keeps sampling until it has
    enough.  Measured on CPU over VGG16 layer shapes (900 random samples, 49 passing the
    postprocessors): every passing sample calls ``__dp4a`` and builds to CUDA.
    ``vector_load_lens`` stays [1, 2, 4]: with 3, 2 of the 49 crashed the CUDA build
    (``Check failed: (eval_vec_)`` on a 3-lane int8 fetch); with 8 and 16, 2 failed (``Cannot
    convert type T.int32x16 to CUDA type``).  A smaller ``max_innermost_factor`` (16, 8) raises
    the pass rate only to 7-8% and does not shorten candidate generation, so it stays 64.
"""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from .dp4a import DP4A_INTRIN, _ensure_dp4a_registered, apply_dp4a_schedule

STRUCTURE = "SSSRRSRS"
TILE_BINDS = ["blockIdx.x", "vthread.x", "threadIdx.x"]
MAX_INNERMOST_FACTOR = 64
VECTOR_LOAD_LENS = [1, 2, 4]  # int8 lanes per cooperative-fetch load; not 3, 8 or 16 (see above)
UNROLL_MAX_STEPS = [0, 16, 64, 512, 1024]


def schedule_rules() -> list:
    """The schedule rules of the ``mlt`` space, in application order (see the module docstring)."""
    _ensure_dp4a_registered()  # the tiling rule looks the intrinsic up when constructed
    rule = ms.schedule_rule
    return [
        rule.MultiLevelTilingWithIntrin(
            DP4A_INTRIN, structure=STRUCTURE, tile_binds=TILE_BINDS,
            max_innermost_factor=MAX_INNERMOST_FACTOR, vector_load_lens=VECTOR_LOAD_LENS,
            # Level 4 = under the outer reduction tile: one shared tile per block and k-step.
            reuse_read=rule.ReuseType(req="must", levels=[4], scope="shared"),
            # Level 3 = under threadIdx: each thread's accumulators in registers.
            reuse_write=rule.ReuseType(req="must", levels=[3], scope="local")),
        # MetaSchedule's CUDA defaults; disallow_if_then_else=False lets the padding inline.
        rule.AutoInline(into_producer=True, into_consumer=True, inline_const_tensor=True,
                        disallow_if_then_else=False, require_injective=False, require_ordered=False),
        rule.ParallelizeVectorizeUnroll(max_jobs_per_core=-1, max_vectorize_extent=-1,
                                        unroll_max_steps=UNROLL_MAX_STEPS, unroll_explicit=True),
        rule.AutoBind(),
    ]


def postprocs() -> list:
    """The ``mlt`` space's postprocessors, in order: the tensorize comes last, after the GPU checks."""
    post = ms.postproc
    return [
        post.DisallowDynamicLoop(),
        post.RewriteCooperativeFetch(),
        post.RewriteUnboundBlock(),
        post.RewriteParallelVectorizeUnroll(),
        post.RewriteReductionBlock(),
        post.VerifyGPUCode(),
        # True vectorizes the accumulator init and fails (init_loops.size() == 1).
        post.RewriteTensorize(vectorize_init_loop=False),
    ]


def template_postprocs() -> list:
    """The ``template`` space's postprocessors: the trace binds, vectorizes and tensorizes
    itself, so they only turn the unroll annotation into the pragma and reject candidates
    with too many threads or too much shared memory."""
    post = ms.postproc
    return [post.DisallowDynamicLoop(), post.RewriteParallelVectorizeUnroll(), post.VerifyGPUCode()]


def _template(sch) -> None:
    apply_dp4a_schedule(sch)  # tiles=None: every decision sampled


SPACES = ("template", "mlt")


def space_generator(space: str = "template") -> ms.space_generator.SpaceGenerator:
    """The MetaSchedule design space of :func:`conv2d_nchw4c_int8` for CUDA on ``__dp4a``.

    Args:
        space: ``"template"`` or ``"mlt"`` (module docstring).
    Returns:
        A space generator with its rules, postprocessors and CUDA mutators; give it to
        ``ms.TuneContext(space_generator=...)`` with a CUDA target that has
        ``max_threads_per_block``, ``max_shared_memory_per_block`` and
        ``thread_warp_size`` (``tvm_qconv.build.make_target``).
    Raises:
        ValueError: an unknown space name.

    Example::

        ctx = ms.TuneContext(mod=conv2d_nchw4c_int8(wl), target=make_target("cuda", "sm_90"),
                             space_generator=space_generator(), task_name="conv")
        sketches = ctx.generate_design_space()
    """
    _ensure_dp4a_registered()
    if space == "template":
        return ms.space_generator.ScheduleFn(_template, sch_rules=[], postprocs=template_postprocs(),
                                             mutator_probs=ms.Mutator.create("cuda"))
    if space == "mlt":
        return ms.space_generator.PostOrderApply(sch_rules=schedule_rules(), postprocs=postprocs(),
                                                 mutator_probs=ms.Mutator.create("cuda"))
    raise ValueError(f"unknown dp4a search space {space!r}; choose one of {', '.join(SPACES)}")
