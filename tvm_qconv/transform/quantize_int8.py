"""QuantizeInt8: float Relax main -> int8 NCHW4c main calling one TensorIR kernel per layer.

Each conv2d(+bias)(+ReLU) becomes one call to the fused int8 kernel
(``schedules/conv2d_nchw4c_int8.py``) with weights packed OIHW4o4i, bias in int32 at scale
``s_x * s_w[c]`` and the requantize multiplier ``s_x * s_w[c] / s_y`` in fixed point.
Activations stay int8 NCHW4c from one int8 layer to the next (max-pool and residual adds
included); a float op that needs an int8 tensor gets it unpacked and dequantized once, and an
int8 layer fed by a float tensor quantizes and packs it once: those two kernels are the only
layout transforms.  Everything the pass could not put in int8 is listed in ``self.report``.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import tvm
from tvm import relax

from schedules.add_int8 import add_multipliers, add_nchw4c_int8
from schedules.conv2d_nchw4c_int8 import (Conv2dWorkload, ceil4, conv2d_nchw4c_int8, pack_channels,
                                          pack_oihw4o4i)
from schedules.dense_int8 import dense_int8
from schedules.layout_int8 import dequantize_unpack, quantize_pack, quantize_rows
from schedules.pool_int8 import max_pool2d_nchw4c_int8
from schedules.requantize import quantize_multiplier

from ..config import QuantConfig
from ..graph import Graph, analyze, static_shape
from ..observers import quantize_weight_per_channel
from ..relax_utils import bindings_of, substitute

AMAX_FLOOR = 1e-6  # a dead (all-zero) tensor still needs a finite scale


class _QTensor:
    """An int8 NCHW4c tensor of the new graph: its var, scale and real channel count."""

    def __init__(self, var, scale: float, channels: int):
        self.var, self.scale, self.channels = var, scale, channels


@tvm.transform.module_pass(opt_level=0, name="QuantizeInt8")
class QuantizeInt8:
    """Rewrite ``main`` to int8.

    Args:
        amax: ``{point name: amax}`` from calibration (or learned QAT ranges).
        config: the scheme (skip list, dense on/off).
        names: torch layer names from the frontend (``{"conv2d": [...], "dense": [...]}``).
        expose_activations: make main return ``(outputs, *int8 activations)``, in layer order,
            to compare builds layer by layer (the report's ``exposed`` lists their layers).
    After the pass, ``self.report`` holds one row per layer and the float ops that remain.
    """

    def __init__(self, amax: dict, config: QuantConfig, names: dict | None = None,
                 expose_activations: bool = False):
        self.amax, self.config, self.names = dict(amax), config, names
        self.expose_activations = expose_activations  # main also returns every int8 activation (debug)
        self.report: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        graph = analyze(mod["main"], self.names)
        missing = sorted(set(graph.points.values()) - set(self.amax))
        if missing:
            raise ValueError(f"no calibrated range for {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                             "calibrate this model (or this checkpoint) again")
        unknown_skip = set(self.config.skip) - {ly.name for ly in graph.layers}
        if unknown_skip:
            raise ValueError(f"skip list names unknown layers {sorted(unknown_skip)}; layers are "
                             f"{[ly.name for ly in graph.layers if ly.kind in ('conv2d', 'dense')]}")
        return _Rewriter(graph, self).run(mod)


class _Rewriter:
    def __init__(self, graph: Graph, qpass: QuantizeInt8):
        self.g, self.p = graph, qpass
        self.bb = relax.BlockBuilder()
        self.fenv: dict = {}   # old var -> new float var
        self.qenv: dict = {}   # old var -> _QTensor
        self.rows: list = []
        self.float_ops: Counter = Counter()
        self.transforms: list = []   # (kind, at) of every layout transform emitted

    # ---- values -------------------------------------------------------------------------
    def scale(self, var) -> float:
        name = self.g.points[var]
        return max(self.p.amax[name], AMAX_FLOOR) / 127.0

    def float_of(self, expr):
        if not isinstance(expr, relax.Var):
            return substitute(expr, {})
        if expr in self.fenv:
            return self.fenv[expr]
        if expr in self.qenv:
            q = self.qenv[expr]
            shape = static_shape(q.var.ty)
            out = (shape[0], q.channels, shape[2], shape[3])
            f = dequantize_unpack(shape, q.channels, q.scale)
            self.fenv[expr] = self.call(f, "dequantize_unpack", [q.var], out, "float32")
            self.transforms.append(("dequantize_unpack", expr.name))
            return self.fenv[expr]
        return expr  # a function parameter

    def int8_of(self, expr) -> _QTensor:
        if expr in self.qenv:
            return self.qenv[expr]
        x = self.float_of(expr)
        n, c, h, w = static_shape(x.ty)
        s = self.scale(expr)
        var = self.call(quantize_pack((n, c, h, w), s), "quantize_pack", [x], (n, ceil4(c) // 4, h, w, 4), "int8")
        self.transforms.append(("quantize_pack", expr.name))
        self.qenv[expr] = _QTensor(var, s, c)
        return self.qenv[expr]

    def call(self, prim, name, args, shape, dtype):
        if "global_symbol" in prim.attrs:
            prim = prim.without_attr("global_symbol")  # add_func names it; te's default "main" would clash
        gv = self.bb.add_func(prim.with_attr("op_pattern", 8), name)  # 8 = kOpaque: FuseOps leaves it alone
        return self.bb.emit(relax.call_tir(gv, args, relax.TensorType(shape, dtype)), name_hint=name)

    def emit_float(self, binding):
        value = substitute(binding.value, {})
        args = value.args if isinstance(value, relax.Call) else value.fields if isinstance(value, relax.Tuple) else []
        vmap = {a: self.float_of(a) for a in args if isinstance(a, relax.Var)}
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            vmap[value.tuple_value] = self.float_of(value.tuple_value)
        new = substitute(value, vmap)
        if isinstance(new, relax.Call) and getattr(new.op, "name", None):
            self.float_ops[new.op.name] += 1
        self.fenv[binding.var] = self.bb.emit(new, name_hint=binding.var.name)

    # ---- layers -------------------------------------------------------------------------
    def run(self, mod):
        func = mod["main"]
        value = {b.var: b for b in bindings_of(func)}
        with self.bb.function("main", list(func.params), attrs=dict(func.attrs.items()) if func.attrs else None):
            with self.bb.dataflow():
                for b in bindings_of(func):
                    ly = self.g.layer_of_var.get(b.var)
                    if ly is not None:
                        why = self.why_float(ly)
                        if why is None:
                            getattr(self, f"emit_{ly.kind}")(ly)
                            continue
                        self.rows.append(dict(layer=ly.name, kind=ly.kind, kernel="float (" + why + ")",
                                              dtype="float32"))
                        for v in ly.vars:
                            self.emit_float(value[v])
                    elif b.var not in self.g.consumed:
                        self.emit_float(b)
                result = self._output(func.body.body)
                if self.p.expose_activations:
                    exposed = [(ly.name, self.qenv[ly.output].var) for ly in self.g.layers if ly.output in self.qenv]
                    self.exposed = [n for n, _ in exposed]
                    result = relax.Tuple([result] + [v for _, v in exposed])
                out = self.bb.emit_output(result)
            self.bb.emit_func_output(out)
        new_mod = self.bb.get()
        for gv, f in mod.functions.items():
            if gv.name_hint != "main" and gv.name_hint not in [g.name_hint for g in new_mod.get_global_vars()]:
                new_mod[gv] = f
        self.p.report = {"layers": self.rows, "float_ops": dict(self.float_ops),
                         "layout_transforms": [f"{k} at {at}" for k, at in self.transforms],
                         "exposed": getattr(self, "exposed", [])}
        return relax.transform.DeadCodeElimination(["main"])(new_mod)

    def _output(self, body):
        if isinstance(body, relax.Tuple):
            return relax.Tuple([self.float_of(f) for f in body.fields])
        return self.float_of(body)

    def why_float(self, ly) -> str | None:
        if ly.reason_float:
            return ly.reason_float
        if ly.name in self.p.config.skip:
            return "in the skip list"
        if ly.kind == "dense" and not self.p.config.quantize_dense:
            return "quantize_dense=False"
        if ly.kind == "max_pool2d" and ly.inputs[0] not in self.qenv:
            return "input is float"
        return None

    def emit_conv2d(self, ly):
        a = ly.call.attrs
        x = self.int8_of(ly.inputs[0])
        n, _, h, w = static_shape(ly.inputs[0].ty)
        o, i, kh, kw = ly.weight.shape
        wl = Conv2dWorkload(n, i, h, w, o, (kh, kw), tuple(map(int, a.strides)), tuple(map(int, a.padding)),
                            tuple(map(int, a.dilation)), ly.relu)
        qw, s_w = quantize_weight_per_channel(ly.weight)
        s_y = self.scale(ly.output)
        acc_scale = x.scale * s_w.astype(np.float64)
        bias = np.zeros(o) if ly.bias is None else ly.bias.astype(np.float64)
        bias_q = np.clip(np.round(bias / acc_scale), -2**31, 2**31 - 1).astype(np.int32)
        mult, shift = quantize_multiplier(acc_scale / s_y)
        args = [x.var, relax.const(pack_oihw4o4i(qw)), relax.const(pack_channels(bias_q)),
                relax.const(pack_channels(mult)), relax.const(pack_channels(shift, fill=1))]
        var = self.call(conv2d_nchw4c_int8(wl), "conv2d_nchw4c_int8", args,
                        (n, ceil4(o) // 4, wl.out_height, wl.out_width, 4), "int8")
        self.qenv[ly.output] = _QTensor(var, s_y, o)
        self.rows.append(dict(layer=ly.name, kind="conv2d" + ("+bias" if ly.bias is not None else "")
                              + ("+relu" if ly.relu else ""), kernel="conv2d_nchw4c_int8", dtype="int8",
                              shape=wl.describe(), in_scale=x.scale, out_scale=s_y))

    def emit_max_pool2d(self, ly):
        a = ly.call.attrs
        x = self.qenv[ly.inputs[0]]
        shape = static_shape(x.var.ty)
        prim = max_pool2d_nchw4c_int8(shape, tuple(map(int, a.pool_size)), tuple(map(int, a.strides)),
                                      tuple(map(int, a.padding)), tuple(map(int, a.dilation)), bool(a.ceil_mode))
        n, cc = shape[:2]
        oh, ow = static_shape(ly.output.ty)[2:]
        var = self.call(prim, "max_pool2d_nchw4c_int8", [x.var], (n, cc, oh, ow, 4), "int8")
        self.qenv[ly.output] = _QTensor(var, x.scale, x.channels)
        self.rows.append(dict(layer=ly.name, kind="max_pool2d", kernel="max_pool2d_nchw4c_int8", dtype="int8",
                              shape=f"{tuple(map(int, a.pool_size))} s{int(a.strides[0])}"))

    def emit_add(self, ly):
        qa, qb = (self.int8_of(v) for v in ly.inputs)
        s_y = self.scale(ly.output)
        mult_a, mult_b, shift = add_multipliers(qa.scale, qb.scale, s_y)
        shape = static_shape(qa.var.ty)
        var = self.call(add_nchw4c_int8(shape, mult_a, mult_b, shift, ly.relu), "add_nchw4c_int8",
                        [qa.var, qb.var], shape, "int8")
        self.qenv[ly.output] = _QTensor(var, s_y, qa.channels)
        self.rows.append(dict(layer=ly.name, kind="add" + ("+relu" if ly.relu else ""), kernel="add_nchw4c_int8",
                              dtype="int8", shape=str(shape)))

    def emit_dense(self, ly):
        x = self.float_of(ly.inputs[0])
        n, k = static_shape(x.ty)
        s_x = self.scale(ly.inputs[0])
        xq = self.call(quantize_rows((n, k), s_x), "quantize_rows", [x], (n, ceil4(k)), "int8")
        qw, s_w = quantize_weight_per_channel(ly.weight)
        o = qw.shape[0]
        wp = np.zeros((o, ceil4(k)), np.int8)
        wp[:, :k] = qw
        bias = np.zeros(o, np.float32) if ly.bias is None else ly.bias
        args = [xq, relax.const(wp), relax.const((s_x * s_w).astype(np.float32)), relax.const(bias)]
        self.fenv[ly.output] = self.call(dense_int8(n, ceil4(k), o, ly.relu), "dense_int8", args, (n, o), "float32")
        self.rows.append(dict(layer=ly.name, kind="dense" + ("+bias" if ly.bias is not None else "")
                              + ("+relu" if ly.relu else ""), kernel="dense_int8", dtype="int8",
                              shape=f"{k}->{o} b{n}", in_scale=s_x))
