"""Ranges: where every activation's int8 range comes from, before the plan is made.

- :mod:`.sources`: the range sources a build takes (:class:`Calibrate`, :class:`GivenRanges`,
  :class:`LearnedRanges`: ``resolve(RangeContext) -> (amax, report)``) and the mapping of a QAT
  checkpoint's learned ranges onto the graph
- :mod:`.calibrate`: the calibration run (the float graph with every candidate point exposed, on
  TVM or torch) and :mod:`.observers` (max, percentile, entropy, MSE; weight scales per channel)
- :mod:`.search`: ``calibration="search"``, one observer per point chosen by logits SQNR
- :mod:`.weight_rounding`: GPTQ, the weights rounded against the calibration images

The names below are imported on first use (PEP 562): :mod:`tvm_qconv.nn` reads the observers'
weight scales without bringing TVM in.
"""
from ..lazy import lazy_exports

_LAZY = dict.fromkeys(("Calibrate", "GivenRanges", "LearnedRanges", "RangeContext", "RangeSource", "describe",
                       "map_learned_ranges"), "sources")

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
