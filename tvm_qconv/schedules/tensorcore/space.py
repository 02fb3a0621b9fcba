"""The MetaSchedule search space of the tensor-core conv: the template of ``mma.py`` with its tile
decisions sampled (block rows / columns, warps x fragments, K tile), the pipeline depth of the
task's default.  The default schedule is one point of it (``seed``), so tuning starts there."""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from . import mma

SPACES = ("template",)


def _template_for(stages: int):
    def template(sch) -> None:
        mma.apply_mma_schedule(sch, None, stages)
    return template


def space_generator(stages: int, space: str = "template") -> ms.space_generator.SpaceGenerator:
    """The ``template`` space for a task whose pipeline depth is ``stages``.

    Postprocessors: the unroll annotation to its pragma, and VerifyGPUCode (threads and shared
    memory against the tuning target, whose limit is the dynamic budget ``mma.DYN_SMEM_BUDGET``).
    """
    if space not in SPACES:
        raise ValueError(f"unknown tensor-core search space {space!r}; choose one of {', '.join(SPACES)}")
    post = ms.postproc
    return ms.space_generator.ScheduleFn(
        _template_for(stages), sch_rules=[],
        postprocs=[post.DisallowDynamicLoop(), post.RewriteParallelVectorizeUnroll(), post.VerifyGPUCode()],
        mutator_probs=ms.Mutator.create("cuda"))
