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


def rebuild_main(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """``mod`` with ``main``'s one dataflow block emitted again, binding by binding, in order.

    ``rewrite(bb, binding, vmap, is_output)`` returns what ``binding.var`` becomes: usually a var
    emitted on ``bb`` (:func:`emit_like`), or an existing expression to read instead (the binding
    dropped); ``vmap`` maps the earlier bindings' vars to what they became.  The function's
    parameters, attributes and other functions are kept."""
    func = mod["main"]
    binds = bindings_of(func)
    outputs = {b.var for b in binds if not isinstance(b.var, relax.DataflowVar)}
    bb = relax.BlockBuilder()
    with bb.function("main", list(func.params), attrs=dict(func.attrs) if func.attrs is not None else None):
        with bb.dataflow():
            vmap: dict = {}
            for b in binds:
                vmap[b.var] = rewrite(bb, b, vmap, b.var in outputs)
            out = substitute(func.body.body, vmap)
        bb.emit_func_output(out)
    new_mod = bb.get()
    for gv, f in mod.functions.items():
        if gv.name_hint != "main":
            new_mod[gv] = f
    return new_mod


def emit_like(bb, binding, expr, is_output: bool):
    """``expr`` emitted under ``binding``'s name, as a dataflow output where the binding was one."""
    return bb.emit_output(expr, name_hint=binding.var.name) if is_output else bb.emit(expr, name_hint=binding.var.name)
