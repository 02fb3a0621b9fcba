"""LiftConstantsToParams: move the weights out of ``main`` into parameters.

The built library then holds code only; the weights (int8 packed, int32 bias, fixed-point
multipliers) travel in a ``.params.npz`` beside it, so a 138M-parameter VGG16 does not make a
550 MB ``.so`` and one library serves any weights of the same architecture and scales.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..relax_utils import bindings_of, substitute

MIN_ELEMENTS = 2  # scalars stay inline; every tensor-valued constant becomes a parameter


@tvm.transform.module_pass(opt_level=0, name="LiftConstantsToParams")
class LiftConstantsToParams:
    """After the pass, ``self.params`` is the list of (name, np.ndarray) in parameter order."""

    def __init__(self):
        self.params: list = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["main"]
        new_params: list = []

        def lift(expr):
            if isinstance(expr, tvm.ir.expr.GenericConst):
                arr = expr.value.numpy()
                if arr.size < MIN_ELEMENTS:
                    return expr
                # One parameter per occurrence: the int8 graph uses each packed constant once.
                var = relax.Var(f"p{len(new_params)}", relax.TensorType(arr.shape, str(arr.dtype)))
                new_params.append((var, arr))
                return var
            if isinstance(expr, relax.Call):
                return tvm.ir.Call(expr.op, [lift(a) for a in expr.args], expr.attrs, expr.ty_args)
            if isinstance(expr, relax.Tuple):
                return relax.Tuple([lift(f) for f in expr.fields])
            return expr

        bb = relax.BlockBuilder()
        binds = bindings_of(func)
        new_values = [lift(b.value) for b in binds]  # lift first: the parameter list must be known
        with bb.function("main", list(func.params) + [v for v, _ in new_params],
                         attrs={"num_input": len(func.params)}):
            with bb.dataflow():
                vmap = {}
                for b, val in zip(binds, new_values):
                    vmap[b.var] = bb.emit(substitute(val, vmap), name_hint=b.var.name)
                out = bb.emit_output(substitute(func.body.body, vmap))
            bb.emit_func_output(out)
        new_mod = bb.get()
        for gv, f in mod.functions.items():
            if gv.name_hint != "main":
                new_mod[gv] = f
        self.params = [(v.name, np.ascontiguousarray(a)) for v, a in new_params]
        return new_mod
