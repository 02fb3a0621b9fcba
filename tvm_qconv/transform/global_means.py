"""global_means: a mean over both spatial axes that drops them, written as the global pool it is.

``x.mean((2, 3))`` (ShuffleNet-V2's classifier input) is ``mean(x, axis=[2, 3], keepdims=False)``:
``[N, C, H, W] -> [N, C]``.  ``graph.py`` runs a mean that keeps the dimensions (``[N, C, 1, 1]``,
the classifier pools and squeeze-excite means of the other models) as an int8 average pool over
the whole map; this one stayed float, so the whole last feature map was dequantized to float32
to be averaged.  Written as ``reshape(mean(x, axis=[2, 3], keepdims=True), [N, C])`` -- the same
values, the reshape a view -- it is that int8 pool, and only its ``[N, C]`` result is dequantized.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..graph import static_shape
from ..relax_utils import bindings_of, emit_like, rebuild_main, substitute


def _dropping_global_mean(call) -> bool:
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", None) == "relax.mean"):
        return False
    shape = static_shape(call.args[0].ty)
    if shape is None or len(shape) != 4 or call.attrs.keepdims or call.attrs.axis is None:
        return False
    return sorted(int(a) % 4 for a in call.attrs.axis) == [2, 3]


def keep_global_mean_dims(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each spatial mean that drops its axes as a mean that keeps them, then a reshape
    (``mod`` itself where there is none)."""
    if not any(_dropping_global_mean(b.value) for b in bindings_of(mod["main"])):
        return mod

    def rewrite(bb, b, vmap, is_output):
        new = substitute(b.value, vmap)
        if _dropping_global_mean(b.value):
            n, c = static_shape(b.value.args[0].ty)[:2]
            pooled = bb.emit(relax.op.mean(new.args[0], axis=[2, 3], keepdims=True), name_hint=b.var.name + "_pooled")
            new = relax.op.reshape(pooled, [n, c])
        return emit_like(bb, b, new, is_output)

    return rebuild_main(mod, rewrite)
