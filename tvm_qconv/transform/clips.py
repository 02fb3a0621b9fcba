"""clips: the ONNX frontend's ``Clip`` (a ``maximum`` then a ``minimum`` kernel) written as ``clip``.

TVM's Relax ONNX frontend imports ``Clip(x, min, max)`` with tensor bounds (opset 11 on: ReLU6 in
MobileNet-V2, hardtanh) as two TIR kernels, ``call_tir(maximum, (x, min))`` then
``call_tir(minimum, (., max))``, where the torch frontend writes ``clip(x, min, max)``.
``graph.py`` takes a ``relu`` or a ``clip`` with constant bounds into the conv before it (the
kernel clamps in the integer domain); two opaque kernels it cannot read would stay float ops
between int8 layers.  Here, with constant scalar bounds:

- ``minimum(maximum(x, lo), hi)`` (the maximum read by nothing else) -> ``clip(x, lo, hi)``;
- a lone ``maximum(x, 0)`` -> ``relu(x)``;
- any other such ``maximum`` / ``minimum`` -> ``relax.maximum`` / ``relax.minimum`` (float ops
  the rest of the pipeline knows).

The same values: each is the elementwise max / min with a scalar.  The kernels left unused are
dropped.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..relax_utils import bindings_of, emit_like, free_vars, rebuild_main, substitute

_KINDS = ("maximum", "minimum")


def _scalar_kernel(call) -> tuple[str, relax.Expr, float] | None:
    """``(kind, x, bound)`` of ``call_tir(maximum|minimum, (x, scalar constant))``, else None."""
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", None) == "relax.call_tir"):
        return None
    callee, args = call.args[0], call.args[1]
    name = getattr(callee, "name_hint", "")
    # the frontend names them after topi's kernels: maximum, maximum1, ...
    kind = next((k for k in _KINDS if name.startswith(k) and (name == k or name[len(k):].isdigit())), None)
    if kind is None or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
        return None
    x, bound = args.fields
    if not isinstance(bound, tvm.ir.expr.GenericConst):
        return None
    value = bound.value.numpy()
    if value.size != 1 or str(value.dtype) != "float32":
        return None
    return kind, x, float(value.reshape(()))


def clips_from_min_max(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the frontend's scalar ``maximum`` / ``minimum`` kernels as ``clip`` / ``relu`` /
    ``relax.maximum`` / ``relax.minimum`` (``mod`` itself where there is none)."""
    binds = bindings_of(mod["main"])
    kernels = {b.var: _scalar_kernel(b.value) for b in binds}
    kernels = {v: k for v, k in kernels.items() if k is not None}
    if not kernels:
        return mod
    readers: dict = {}
    for b in binds:
        for arg in free_vars(b.value):
            readers.setdefault(arg, []).append(b.var)
    # a maximum whose one reader is a minimum of it: the pair is one clip, emitted at the minimum
    pairs = {}
    for var, (kind, x, hi) in kernels.items():
        if kind == "minimum" and x in kernels and kernels[x][0] == "maximum" and readers.get(x) == [var] \
                and kernels[x][2] < hi:
            pairs[var] = x
    inner = set(pairs.values())

    def rewrite(bb, b, vmap, is_output):
        if b.var in inner:
            return None     # emitted as part of its minimum's clip
        if b.var not in kernels:
            return emit_like(bb, b, substitute(b.value, vmap), is_output)
        kind, x, bound = kernels[b.var]
        if b.var in pairs:
            _, x0, lo = kernels[pairs[b.var]]
            new = relax.op.clip(substitute(x0, vmap), lo, bound)   # float bounds: prim values, as the torch frontend writes them
        elif kind == "maximum" and bound == 0.0:
            new = relax.op.nn.relu(substitute(x, vmap))
        else:
            const = relax.const(np.float32(bound), "float32")
            op = relax.op.maximum if kind == "maximum" else relax.op.minimum
            new = op(substitute(x, vmap), const)
        return emit_like(bb, b, new, is_output)

    out = rebuild_main(mod, rewrite)
    return relax.transform.DeadCodeElimination(["main"])(out)

