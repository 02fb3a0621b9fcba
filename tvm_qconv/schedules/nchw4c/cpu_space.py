"""MetaSchedule search space of the fused int8 conv on llvm (``cpu.py``'s schedule).

``template``: :func:`cpu.apply_cpu_schedule` with its two decisions sampled uniformly
(``tile_choices``): the output-channel tile (1-16 blocks of 4 channels: the vector width, 4 to 64
int32 lanes) and the output-column tile (the register tile's other side).  The structure is the
default's (one task per output row and oc tile, the per-task padded input and weight copy, the
unrolled register tile, the requantize fused per column tile); the default is one point of the
space (``Conv2dCpu.seed``).  The oc tile is also the layout of the accumulator and of the
weight copy (a constant of ``transform_layout``), which a mutated trace would keep from the
sample it mutated, so the tuner re-runs the schedule function for every candidate
(``Conv2dCpu.search = "replay_func"``: MetaSchedule's ReplayFunc); the space is small (at most
5 x 8 points).

It exists so a CPU build can be tuned on the CPU it will run on, locally or through TVM RPC on a
remote one (``tune.py --target llvm``), with the same database and resume logic as CUDA.
"""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from .cpu import apply_cpu_schedule

SPACES = ("template",)


def _template(sch) -> None:
    apply_cpu_schedule(sch)


def space_generator(space: str = "template") -> ms.space_generator.SpaceGenerator:
    """The MetaSchedule design space of :func:`conv2d_nchw4c_int8` on an llvm target.

    Raises:
        ValueError: an unknown space name.
    """
    if space not in SPACES:
        raise ValueError(f"unknown CPU search space {space!r}; choose one of {', '.join(SPACES)}")
    return ms.space_generator.ScheduleFn(_template, sch_rules=[], postprocs=[], mutator_probs={})
