"""channels_first: a model's channels-last regions rewritten as the NCHW ops they are.

A ConvNeXt block computes, between two ``permute_dims``, a LayerNorm over the last axis and two
Linear layers on the last axis with an elementwise activation between them::

    permute_dims(x, [0, 2, 3, 1]) -> layer_norm(axes=[-1]) -> reshape [NHW, C] -> matmul(W1) -> add(b1)
      -> reshape [N, H, W, 4C] -> gelu -> reshape -> matmul(W2) -> add(b2) -> reshape -> permute_dims([0, 3, 1, 2])
      -> multiply(layer_scale [C, 1, 1])

A LayerNorm over the last axis of an NHWC tensor is a LayerNorm over the channels of the NCHW
one, a Linear layer on it a 1x1 conv, an elementwise op the same op.  Written that way the
permutes and reshapes disappear, each Linear becomes a conv the tensor-core families run in
their channels-last layout (NHWC32 already is channels-last), the activation an int8 lookup
table between two int8 convs, and the LayerNorm one int8 kernel (``graph.py``: ``layer_norm``).
A per-channel constant that multiplies the region's result (ConvNeXt's layer scale) is folded
into the last conv's weights and bias.

The rewrite is exact math (the same sums in another order): the float module before and after
agree to float rounding (``tests/test_layer_norm.py``).  A region is rewritten only when every
tensor in it is read inside it -- an intermediate read elsewhere (or returned) keeps the whole
region as it was.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..graph import static_shape
from ..relax_utils import bindings_of, emit_like, free_vars, rebuild_main, substitute

TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
# Elementwise ops of one tensor that commute with a permutation of it.
UNARY = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu", "relax.nn.silu", "relax.sigmoid", "relax.tanh",
         "relax.clip")


def _op(expr) -> str | None:
    return getattr(expr.op, "name", None) if isinstance(expr, relax.Call) else None


def _const(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.expr.GenericConst) else None


def _axes(call) -> list[int] | None:
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def channels_first(mod: tvm.IRModule, names: dict | None = None) -> tuple[tvm.IRModule, dict | None]:
    """``mod`` with its channels-last regions as NCHW ops (module docstring), and the torch layer
    names re-filed: a Linear layer that became a 1x1 conv is named among the convs, in graph order.

    Args:
        mod: a simplified float module (static shapes, one dataflow block).
        names: ``{"conv2d": [...], "dense": [...]}`` in graph order (``frontend``), or None.
    """
    func = mod["main"]
    binds = bindings_of(func)
    value = {b.var: b.value for b in binds}
    users: dict = {}
    for b in binds:
        for a in free_vars(b.value):
            users.setdefault(a, []).append(b.var)
    returned = set(free_vars(func.body.body))
    plan: dict = {}  # var -> how it is rewritten
    for b in binds:
        if _op(b.value) == "relax.permute_dims" and _axes(b.value) == TO_NHWC and b.var not in plan:
            region = _region(b.var, value, users, returned)
            if region is not None:
                plan.update(region)
    if not plan:
        return mod, names
    new_mod = _emit(mod, plan)
    return new_mod, (_refile_names(binds, plan, names) if names is not None else None)


def _region(start, value, users, returned) -> dict | None:
    """How each var of the channels-last region that ``start`` (a permute to NHWC) opens is
    rewritten, or None where the region cannot be: ``{var: (kind, ...)}``."""
    x = value[start].args[0]
    if len(static_shape(x.ty) or ()) != 4:
        return None
    n, _, h, w = static_shape(x.ty)
    plan = {start: ("enter",)}
    todo = [start]
    while todo:
        v = todo.pop()
        if v in returned:
            return None
        rows = len(static_shape(v.ty)) == 2  # a [N*H*W, C] view of the NHWC tensor
        for u in users.get(v, []):
            if u in plan:
                continue
            call, shape = value[u], static_shape(u.ty)
            op = _op(call)
            if shape is None or not isinstance(call, relax.Call) or sum(a.same_as(v) for a in free_vars(call)) != 1:
                return None
            if op == "relax.permute_dims" and not rows and _axes(call) == TO_NCHW:
                plan[u] = ("exit",)
                continue  # the region ends here: its readers are ordinary NCHW ops
            if op == "relax.reshape" and shape == ((n, h, w, shape[-1]) if rows else (n * h * w, shape[-1])):
                plan[u] = ("view",)
            elif op == "relax.nn.layer_norm" and _ln_over_last(call, v):
                plan[u] = ("layer_norm",)
            elif op == "relax.matmul" and rows and call.args[0].same_as(v) and _const(call.args[1]) is not None \
                    and _const(call.args[1]).ndim == 2:
                plan[u] = ("linear",)
            elif op in ("relax.add", "relax.multiply") and _last_axis_const(call, v, shape[-1]) is not None:
                plan[u] = ("channel_const", _last_axis_const(call, v, shape[-1]))
            elif op in UNARY and call.args[0].same_as(v):
                plan[u] = ("unary",)
            else:
                return None
            todo.append(u)
    _fold_layer_scale(plan, value, users, returned)
    return plan


def _ln_over_last(call, v) -> bool:
    rank = len(static_shape(v.ty))
    axes = _axes(call)
    return (call.args[0].same_as(v) and axes is not None and [a % rank for a in axes] == [rank - 1]
            and all(_const(a) is not None for a in call.args[1:3]))


def _last_axis_const(call, v, channels: int) -> np.ndarray | None:
    """The [C] constant that ``call`` (an add or multiply of ``v``) broadcasts over the last axis, else None."""
    a, b = call.args
    other = b if a.same_as(v) else a
    c = _const(other)
    if c is None or c.size != channels or (c.ndim and c.shape[-1] != channels):
        return None
    return c.reshape(channels)


def _fold_layer_scale(plan, value, users, returned) -> None:
    """A region whose result is ``linear -> add(bias) -> ... -> exit`` and whose exit's one reader
    multiplies it by a per-channel constant [C, 1, 1]: that constant goes into the linear layer."""
    for e in [v for v, how in plan.items() if how[0] == "exit"]:
        readers = users.get(e, [])
        if e in returned or len(readers) != 1 or _op(value[readers[0]]) != "relax.multiply":
            continue
        mul = value[readers[0]]
        other = mul.args[1] if mul.args[0].same_as(e) else mul.args[0]
        c = _const(other)
        channels = static_shape(e.ty)[1]
        if c is None or c.ndim not in (3, 4) or c.shape[-3:] != (channels, 1, 1) or c.size != channels:
            continue
        # walk back through views to the bias add and the linear layer
        v = value[e].args[0]
        while plan.get(v, ("",))[0] == "view":
            v = value[v].args[0]
        if plan.get(v, ("",))[0] != "channel_const" or _op(value[v]) != "relax.add":
            continue
        lin = next((a for a in value[v].args if a in plan and plan[a][0] == "linear"), None)
        if lin is None or len(users.get(lin, [])) != 1:
            continue
        factor = c.reshape(channels)
        plan[lin] = ("linear", factor)
        plan[v] = ("channel_const", plan[v][1] * factor)
        plan[readers[0]] = ("scaled",)


def _emit(mod, plan) -> tvm.IRModule:
    """The module with the planned rewrites made (every other binding kept)."""

    def rewrite(bb, b, vmap, is_output):     # vmap: old var -> new expression (an NCHW var in a region)
        how = plan.get(b.var)
        call = b.value
        if how is None:
            return emit_like(bb, b, substitute(call, vmap), is_output)
        kind = how[0]
        if kind == "enter":
            return vmap.get(call.args[0], call.args[0])
        if kind in ("view", "exit"):
            return vmap[call.args[0]]
        if kind == "scaled":   # the layer scale, folded into the linear layer
            return vmap[next(a for a in call.args if a in plan)]
        if kind == "layer_norm":
            a = call.attrs
            return bb.emit(relax.op.nn.layer_norm(vmap[call.args[0]], call.args[1], call.args[2], axes=[1],
                                                  epsilon=float(a.epsilon), center=bool(a.center), scale=bool(a.scale)),
                           name_hint=b.var.name)
        if kind == "linear":
            wt = _const(call.args[1])                     # [K, O]
            weight = np.ascontiguousarray(wt.T)[:, :, None, None]
            if len(how) > 1:
                weight = weight * how[1].reshape(-1, 1, 1, 1).astype(weight.dtype)
            return bb.emit(relax.op.nn.conv2d(vmap[call.args[0]], relax.const(weight.astype(wt.dtype)), out_dtype="float32"),
                           name_hint=b.var.name)
        if kind == "channel_const":
            x = next(a for a in call.args if a in vmap and a in plan)
            c = how[1].reshape(1, -1, 1, 1).astype(str(b.var.ty.dtype))
            fn = relax.op.add if _op(call) == "relax.add" else relax.op.multiply
            return bb.emit(fn(vmap[x], relax.const(c)), name_hint=b.var.name)
        assert kind == "unary", kind
        args = [vmap[call.args[0]], *call.args[1:]]
        return bb.emit(tvm.ir.Call(call.op, args, call.attrs, call.ty_args), name_hint=b.var.name)

    return rebuild_main(mod, rewrite)


def _refile_names(binds, plan, names: dict) -> dict:
    """``names`` with each Linear layer that became a conv moved to the convs, in graph order."""
    seen = {"conv2d": 0, "dense": 0}
    out = {"conv2d": [], "dense": []}
    for b in binds:
        op = _op(b.value)
        kind = "conv2d" if op == "relax.nn.conv2d" else "dense" if op == "relax.matmul" \
            and _const(b.value.args[1]) is not None and len(static_shape(b.value.args[0].ty) or ()) == 2 else None
        if kind is None:
            continue
        lst = names.get(kind, [])
        name = lst[seen[kind]] if seen[kind] < len(lst) else f"{kind}_{seen[kind]}"
        seen[kind] += 1
        out["conv2d" if plan.get(b.var, ("",))[0] == "linear" else kind].append(name)
    return {**names, **out}
