"""Why each op the int8 graph keeps in float stays float: the build report's ``float_op_details``.

Every op outside an int8 layer runs as the float model wrote it (float32, on the CPU and on CUDA).
What stays float in the zoo is small by construction: views (the classifier's flatten), the gates
of squeeze-excite blocks (``[N, C, 1, 1]``, a few KB per image), ops whose readers are float. For each
the report names the op, its output shape and dtype, and one of these reasons, so a user can see
what a model leaves outside int8 and why (``report.format_report`` prints them grouped).
"""
from __future__ import annotations

from ..graph import Graph, static_shape
from ..relax_utils import free_vars
from .plan import QuantizationPlan

VIEW_OPS = ("relax.reshape", "relax.flatten", "relax.permute_dims", "relax.squeeze", "relax.expand_dims")
VIEW = "a view: moves values, no arithmetic"
GATE = "computes a channel-scale gate [N, C, 1, 1], read in float by the int8 scale kernel"


def float_op_reasons(plan: QuantizationPlan) -> dict:
    """``{var: why}`` for every binding of the float graph that stays float (a float layer's vars
    included, with the plan's reason)."""
    g: Graph = plan.graph
    value = g.value
    int8_outputs = {lp.layer.output for lp in plan.layers if lp.int8}
    int8_inputs = {v for lp in plan.layers if lp.int8 for v in lp.layer.inputs}
    gates = _gate_producers(plan, value, int8_outputs)
    why: dict = {}
    for lp in plan.layers:
        if not lp.int8:
            for v in lp.layer.vars:
                why[v] = f"{lp.layer.kind} layer kept float: {lp.why_float}"
    for b in g.bindings:
        if (b.var in g.consumed and b.var not in g.lazy) or b.var in why:
            continue
        op = getattr(getattr(b.value, "op", None), "name", None) or type(b.value).__name__
        if op in VIEW_OPS or op in ("Tuple", "TupleGetItem"):
            why[b.var] = VIEW
        elif b.var in gates:
            why[b.var] = GATE
        elif b.var in int8_inputs:
            why[b.var] = f"no int8 kernel for {op} (an int8 layer reads its output, quantized)"
        else:
            why[b.var] = f"no int8 kernel for {op}, and its readers are float"
    return why


def _gate_producers(plan, value, int8_outputs) -> set:
    """The float bindings a planned int8 channel scale's gate is computed by, back to int8 outputs."""
    todo = [v for lp in plan.layers if lp.int8 for v in lp.float_reads]
    seen: set = set()
    while todo:
        v = todo.pop()
        if v in seen or v in int8_outputs or v not in value:
            continue
        seen.add(v)
        todo.extend(free_vars(value[v]))
    return seen


def describe(var, op: str, why: str) -> dict:
    """One ``float_op_details`` entry."""
    shape = static_shape(var.ty)
    return dict(op=op, var=var.name, shape=list(shape) if shape else None, dtype=str(getattr(var.ty, "dtype", "")),
                why=why)
