"""LowerToRelax: a quantization plan in, the int8 Relax ``main`` out -- one ``call_tir`` per int8 layer.

Each int8 layer of the plan (``tvm_qconv/quantization``) becomes its kernel's compute definition
called on its int8 inputs and its packed arguments; its output stays int8 for the next int8
layer.  Everything else is copied in float.  What this pass adds is only what joins the two, and
only where needed; the report lists each:

- ``quantize``: a float tensor feeds an int8 layer (the model input), into that layer's layout,
  at the scale and zero point the plan gives the read;
- ``dequantize``: an int8 tensor feeds a float op (the classifier's flatten, an op with no kernel);
- ``relayout``: an int8 tensor feeds a kernel of another layout (a family boundary).

Each conversion is made once per tensor and layout and shared by every consumer.  A linear
layer's float input is quantized into rows by its own small kernel (``quantize_rows``).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import tvm
from tvm import relax

from .. import registry
from ..graph import static_shape
from ..quantization.float_ops import describe, float_op_reasons
from ..quantization.plan import LayerPlan, QuantizationPlan, TensorQuant, TensorRead
from ..relax_utils import bindings_of, free_vars, substitute
from ..schedules.workload import DequantizeWorkload, QuantizeRowsWorkload, QuantizeWorkload, RelayoutWorkload


def constant(array: np.ndarray) -> relax.Constant:
    """A Relax constant of ``array``'s own dtype (``relax.const`` turns int64 NumPy data into int32)."""
    return relax.const(array, str(array.dtype))


class _Int8:
    """An int8 tensor of the new graph: its var, and what the plan says it holds."""

    def __init__(self, var, quant: TensorQuant):
        self.var, self.quant = var, quant


@tvm.transform.module_pass(opt_level=0, name="LowerToRelax")
class LowerToRelax:
    """Rewrite ``main`` as ``plan`` says.

    Args:
        plan: the build's plan, made for this module's ``main`` (its graph's vars are ``main``'s).
        expose_activations: make main return ``(outputs, *int8 activations)``, in layer order,
            to compare builds layer by layer (the report's ``exposed`` describes each).
    After the pass, ``self.report`` holds the float ops that remain, every conversion kernel and
    the exposed activations.
    """

    def __init__(self, plan: QuantizationPlan, expose_activations: bool = False):
        self.plan, self.expose_activations = plan, expose_activations
        self.report: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _Emitter(self.plan, self).run(mod)


class _Emitter:
    def __init__(self, plan: QuantizationPlan, lower: LowerToRelax):
        self.plan, self.g, self.lower = plan, plan.graph, lower
        self.bb = relax.BlockBuilder()
        self.fenv: dict = {}   # old var -> new float var
        self.qenv: dict = {}   # old var -> {layout name: _Int8}
        self.float_ops: Counter = Counter()
        self.float_details: list = []   # every float op: its shape, dtype and why (quantization/float_ops.py)
        self.why_float = float_op_reasons(plan)
        self.conversions: list = []   # (kind, tensor) of every conversion kernel emitted
        self.pending: dict = {}       # graph.lazy var -> its binding, emitted in float at the first float read

    # ---- values -------------------------------------------------------------------------
    def quantized(self, expr) -> _Int8 | None:
        """The int8 version of ``expr`` in the layout its producer wrote, if any."""
        versions = self.qenv.get(expr) if isinstance(expr, relax.Var) else None
        return next(iter(versions.values())) if versions else None

    def float_of(self, expr):
        if not isinstance(expr, relax.Var):
            return substitute(expr, {})
        if expr in self.fenv:
            return self.fenv[expr]
        if expr in self.pending:  # e.g. a split whose piece stayed float
            self.emit_float(self.pending.pop(expr))
            return self.fenv[expr]
        q = self.quantized(expr)
        if q is not None:
            wl = DequantizeWorkload(static_shape(q.var.ty), q.quant.channels, q.quant.scale, q.quant.zero)
            impl = self.conversion("dequantize", wl, q.quant.layout)
            self.fenv[expr] = self.call(impl.compute(wl), "dequantize_unpack", [q.var], impl.out_shape(wl), "float32")
            self.conversions.append(("dequantize", f"{expr.name} ({q.quant.layout})"))
            return self.fenv[expr]
        return expr  # a function parameter

    def int8_of(self, read: TensorRead) -> _Int8:
        """``read.var`` as int8 in the plan's layout: as produced, relayouted, or quantized from float."""
        expr, want = read.var, read.quant
        versions = self.qenv.setdefault(expr, {})
        if want.layout in versions:
            return versions[want.layout]
        src = next(iter(versions.values()), None)
        if src is not None:  # int8 already, in another family's layout
            shape = (*static_shape(expr.ty)[:1], src.quant.channels, *static_shape(expr.ty)[2:])
            wl = RelayoutWorkload(shape, src.quant.layout, want.layout)
            impl = self.conversion("relayout", wl, want.layout)
            var = self.call(impl.compute(wl), "relayout_int8", [src.var], impl.out_shape(wl), "int8")
            self.conversions.append(("relayout", f"{expr.name} ({src.quant.layout}->{want.layout})"))
        else:
            x = self.float_of(expr)
            wl = QuantizeWorkload(static_shape(x.ty), want.scale, want.zero)
            impl = self.conversion("quantize", wl, want.layout)
            var = self.call(impl.compute(wl), "quantize_pack", [x], impl.out_shape(wl), "int8")
            self.conversions.append(("quantize", f"{expr.name} ({want.layout})"))
        versions[want.layout] = _Int8(var, want)
        return versions[want.layout]

    def conversion(self, op: str, wl, layout: str):
        """The registry's conversion kernel ``op`` into (or, dequantize: out of) ``layout``."""
        impl = registry.select(op, wl, self.plan.target, layout=layout)
        if impl is None:
            raise RuntimeError(f"no {op} kernel for layout {layout} on {self.plan.target.kind}: "
                               "a layout without its conversions is not registered whole (registry.py)")
        return impl

    def call(self, prim, name, args, shape, dtype, scratch=()):
        """``prim`` on ``args``, its result a ``dtype`` tensor of ``shape``; ``scratch``: (shape, dtype)
        of the outputs it writes before its result, for its own use (``KernelImpl.scratch``)."""
        if "global_symbol" in prim.attrs:
            prim = prim.without_attr("global_symbol")  # add_func names it; te's default "main" would clash
        gv = self.bb.add_func(prim.with_attr("op_pattern", 8), name)  # 8 = kOpaque: FuseOps leaves it alone
        if not scratch:
            return self.bb.emit(relax.call_tir(gv, args, relax.TensorType(shape, dtype)), name_hint=name)
        outs = [relax.TensorType(s, d) for s, d in scratch] + [relax.TensorType(shape, dtype)]
        both = self.bb.emit(relax.call_tir(gv, args, outs), name_hint=name + "_with_scratch")
        return self.bb.emit(relax.TupleGetItem(both, len(scratch)), name_hint=name)

    def emit_float(self, binding):
        value = substitute(binding.value, {})
        # Every Var the value reads, inside a Tuple argument too (R.concat((a, b))): an int8
        # producer's output must be dequantized, a float one renamed.  Looking at direct
        # arguments only left concat's inputs undefined ("Var lv403 is not defined").
        vmap = {a: self.float_of(a) for a in free_vars(value)}
        new = substitute(value, vmap)
        if isinstance(new, relax.Call) and getattr(new.op, "name", None):
            self.float_ops[new.op.name] += 1
            self.float_details.append(describe(binding.var, new.op.name,
                                               self.why_float.get(binding.var, f"no int8 kernel for {new.op.name}")))
        self.fenv[binding.var] = self.bb.emit(new, name_hint=binding.var.name)

    # ---- layers -------------------------------------------------------------------------
    def emit_layer(self, lp: LayerPlan) -> None:
        """The layer's kernel on its int8 inputs, its float ones and its packed arguments (a linear
        layer's input: its float tensor quantized into rows)."""
        if lp.layer.kind == "dense":
            read = lp.reads[0]
            x = self.float_of(read.var)
            wl = QuantizeRowsWorkload(read.quant.shape, read.quant.scale, lp.impl.in_features_padded(lp.workload),
                                      read.quant.zero)
            impl = self.conversion("quantize_rows", wl, "rows")
            inputs = [self.call(impl.compute(wl), "quantize_rows", [x], impl.out_shape(wl), "int8")]
        else:
            inputs = [self.int8_of(r).var for r in lp.reads] + [self.float_of(v) for v in lp.float_reads]
        prim = lp.impl.compute(lp.workload)
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), inputs + [constant(p) for p in lp.params],
                        lp.out_shape, lp.out_dtype, lp.impl.scratch(lp.workload))
        if lp.output is None:
            self.fenv[lp.layer.output] = var
        else:   # a conv with a table or an add in its epilogue writes that layer's output (lp.writes)
            self.qenv[lp.layer.output if lp.writes is None else lp.writes] = {lp.output.layout: _Int8(var, lp.output)}

    def run(self, mod):
        func = mod["main"]
        value = {b.var: b for b in bindings_of(func)}
        deferred = {lp.runs_at: lp for lp in self.plan.layers if lp.runs_at is not None}
        with self.bb.function("main", list(func.params), attrs=dict(func.attrs.items()) if func.attrs else None):
            with self.bb.dataflow():
                for b in bindings_of(func):
                    ly = self.g.layer_of_var.get(b.var)
                    if ly is not None:
                        lp = self.plan.of(ly)
                        if ly.output in deferred:   # a conv with this residual add in its epilogue runs here
                            self.emit_layer(deferred[ly.output])
                        if lp.fused_into is not None or lp.runs_at is not None:
                            pass   # its output is made by the kernel of the layer it was fused into
                        elif lp.int8:
                            self.emit_layer(lp)
                        else:
                            for v in ly.vars:
                                self.emit_float(value[v])
                    elif b.var in self.g.lazy:
                        self.pending[b.var] = b
                    elif b.var not in self.g.consumed:
                        self.emit_float(b)
                result = self._output(func.body.body)
                exposed = self._exposed() if self.lower.expose_activations else []
                if self.lower.expose_activations:
                    result = relax.Tuple([result] + [v for _, v in exposed])
                out = self.bb.emit_output(result)
            self.bb.emit_func_output(out)
        new_mod = self.bb.get()
        for gv, f in mod.functions.items():
            if gv.name_hint != "main" and gv.name_hint not in [g.name_hint for g in new_mod.get_global_vars()]:
                new_mod[gv] = f
        kinds = Counter(kind for kind, _ in self.conversions)
        self.lower.report = {"float_ops": dict(self.float_ops), "float_op_details": self.float_details,
                             "conversions": [f"{kind} {at}" for kind, at in self.conversions],
                             "relayouts": kinds.get("relayout", 0),
                             "exposed": [e for e, _ in exposed]}
        return relax.transform.DeadCodeElimination(["main"])(new_mod)

    def _exposed(self) -> list:
        """(description, var) of every int8 layer output, in layer order."""
        made_by = {ly.output: ly.name for ly in self.g.layers}
        exposed = []
        for ly in self.g.layers:
            q = self.quantized(ly.output)
            if q is not None:
                # inputs: the layers whose outputs it reads (none: the image, or float ops)
                exposed.append((dict(layer=ly.name, point=self.g.points.get(ly.output), layout=q.quant.layout,
                                     channels=q.quant.channels, scale=q.quant.scale, zero=q.quant.zero,
                                     inputs=[made_by[v] for v in ly.inputs if v in made_by]), q.var))
        return exposed

    def _output(self, body):
        if isinstance(body, relax.Tuple):
            return relax.Tuple([self.float_of(f) for f in body.fields])
        return self.float_of(body)
