"""Small helpers every hand-written schedule uses: divisor tile sizes, padded extents, the loops a
``compute_at`` made, and a written kernel standing in for a compute's schedule.  One copy here, so the families (``nchw4c/dp4a.py``,
``tensorcore/mma.py``) and the training kernels (``training/``) share it instead of importing
each other's private helpers.
"""
from __future__ import annotations


def divisor_at_most(n: int, cap: int) -> int:
    """Largest d <= cap dividing n (>= 1; a cap below 1 counts as 1).

    Tile sizes are divisors so that no split leaves a predicate on the block (a predicated
    block no longer matches a tensor intrinsic's description, and costs a branch per element).
    """
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``: a padded channel or reduction extent."""
    return (n + multiple - 1) // multiple * multiple


def loops_under(sch, block, loop) -> list:
    """The loops of ``block`` nested inside ``loop`` (those compute_at / decompose_reduction made)."""
    loops = sch.get_loops(block)
    at = [i for i, l in enumerate(loops) if sch.get(l).same_as(sch.get(loop))][0]
    return list(loops[at + 1:])


def as_schedule_of(func, kernel):
    """``kernel`` (a written, already scheduled PrimFunc) in place of the compute ``func``: the
    compute's attributes (kernel name, workload) kept, marked scheduled."""
    return kernel.with_attr({**{k: v for k, v in func.attrs.items()}, "tir.is_scheduled": True})
