"""Small helpers for rewriting Relax dataflow bindings by hand."""
from __future__ import annotations

import tvm
from tvm import relax


def substitute(expr, vmap: dict):
    """``expr`` with every Var in ``vmap`` replaced (Call / Tuple / TupleGetItem / Var leaves)."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Call):
        return tvm.ir.Call(expr.op, [substitute(a, vmap) for a in expr.args], expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    return expr


def bindings_of(func: relax.Function) -> list:
    blocks = func.body.blocks
    if len(blocks) != 1:
        raise ValueError("expected main to hold one dataflow block")
    return list(blocks[0].bindings)
