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


def free_vars(expr, out: list | None = None) -> list:
    """The Vars ``expr`` reads, in order: Call arguments, Tuple fields (``R.concat((a, b))`` takes
    its inputs in a Tuple) and TupleGetItem, recursively."""
    out = [] if out is None else out
    if isinstance(expr, relax.Var):
        out.append(expr)
    elif isinstance(expr, relax.Call):
        for a in expr.args:
            free_vars(a, out)
    elif isinstance(expr, relax.Tuple):
        for f in expr.fields:
            free_vars(f, out)
    elif isinstance(expr, relax.TupleGetItem):
        free_vars(expr.tuple_value, out)
    return out


def bindings_of(func: relax.Function) -> list:
    blocks = func.body.blocks
    if len(blocks) != 1:
        raise ValueError("expected main to hold one dataflow block")
    return list(blocks[0].bindings)
