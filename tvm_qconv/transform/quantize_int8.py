"""QuantizeInt8: float Relax main -> int8 main calling one TensorIR kernel per layer.

Each layer found by the analysis (``tvm_qconv/graph.py``) asks the kernel registry
(``tvm_qconv/registry.py``) for an implementation that runs it on the build's target; the
chosen implementation's compute definition becomes one ``call_tir``, and its layout is the
layout of the layer's int8 output.  A conv(+bias)(+activation) becomes one fused kernel with its
weights packed for that kernel, the bias in int32 at scale ``s_x * s_w[c]`` and the requantize
multiplier ``s_x * s_w[c] / s_y`` in fixed point.

Activations stay int8 from one int8 layer to the next (max-pool and residual adds included).
Three kinds of conversion kernels appear, and only where needed; the report lists each:

- ``quantize``: a float tensor feeds an int8 layer (the model input), into that layer's layout;
- ``dequantize``: an int8 tensor feeds a float op (the classifier's flatten, an op with no kernel);
- ``relayout``: an int8 tensor feeds a kernel of another layout (a family boundary).

Each conversion is made once per tensor and layout and shared by every consumer.
Everything the pass could not put in int8 is listed in ``self.report``.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import tvm
from tvm import relax

from .. import registry
from ..config import QuantConfig
from ..graph import Graph, analyze, static_shape
from ..observers import quantize_weight_per_channel
from ..relax_utils import bindings_of, free_vars, substitute
from ..schedules.dense_int8 import DenseWorkload, quantize_rows
from ..schedules.relayout import relayout_int8
from ..schedules.requantize import QMIN, UNSIGNED_ZERO, add_multipliers, affine_params, quantize_multiplier
from ..lut_table import lut_table
from ..schedules.workload import (AddWorkload, AffineWorkload, AvgPoolWorkload, ChannelsWorkload, ConcatWorkload,
                                  ConvWorkload, LutWorkload, PoolWorkload)
from ..target import TargetInfo
from ..zero_points import PASS_THROUGH, may_run_int8, planned_unsigned

# Keeps amax / 127 a normal float32.  Not a range limit: int8 is scale-invariant, so a tensor whose
# values are all ~1e-9 (deep random-init networks) is quantized as well as one of ~1.  (It was
# 1e-6, which left such tensors a few int8 levels and made MobileNet's logits noise.)
AMAX_FLOOR = 1e-30


def activation_scale(amax: float, unsigned: bool = False) -> float:
    """The int8 scale of an activation of range ``amax``: ``amax / 127`` (symmetric), or
    ``amax / 255`` for an unsigned tensor (``zero_points.py``), floored at ``AMAX_FLOOR``; a dead
    (all-zero or NaN) tensor gets 1/127, as any positive scale holds it."""
    amax = float(amax)
    if not (np.isfinite(amax) and amax > 0):
        amax = 1.0
    return max(amax, AMAX_FLOOR) / (255.0 if unsigned else 127.0)


def int8_clamp(ly, s_y: float, zero: int = 0) -> tuple[str, int, int]:
    """The activation of ``ly`` as an int8 clamp at output scale ``s_y`` and zero point ``zero``:
    (name, lo, hi).

    ``clip(x, lo, hi)`` then quantizing is ``clamp(round(x / s), round(lo / s), round(hi / s))``
    (rounding is monotonic), so ReLU6 costs nothing in the epilogue; a bound beyond the int8
    range is the range's end.  A clamp equal to ReLU's or to none is named so, and its kernel
    is then the one ReLU / no-activation layers share (one tuning task, not two).  An unsigned
    output (``zero`` -128) stores ``round(x / s) - 128``: ReLU is the clamp [-128, 127].
    """
    if not ly.relu:
        return "none", QMIN, 127
    lo, hi = ly.clip or (0.0, float("inf"))
    least = QMIN if zero == 0 else -128
    q_lo = least if not np.isfinite(lo) else int(np.clip(np.round(lo / s_y) + zero, least, 127))
    q_hi = 127 if not np.isfinite(hi) else int(np.clip(np.round(hi / s_y) + zero, least, 127))
    name = {(0, 127): "relu", (QMIN, 127): "none"}.get((q_lo, q_hi), "clip")
    return name, q_lo, q_hi


def weight_error_mean(weight: np.ndarray, qw: np.ndarray, s_w: np.ndarray, mean: np.ndarray,
                      groups: int = 1) -> np.ndarray:
    """``E[(W_q - W) x]`` per output channel: the mean error int8 weights add to a conv's (4-D
    ``weight``, ``[O, C / groups, kh, kw]``) or a linear layer's (``[O, K]``) output, for an input
    whose per-channel mean is ``mean`` (``[C]``; padding's zeros are not counted).  Subtracted
    from the bias, it is bias correction (``QuantConfig.bias_correction``)."""
    err = qw.astype(np.float64) * s_w.astype(np.float64).reshape((-1,) + (1,) * (weight.ndim - 1)) \
        - weight.astype(np.float64)
    per_input = err.reshape(err.shape[0], err.shape[1], -1).sum(axis=2)   # [O, C / groups]
    o, cg = per_input.shape
    group_mean = np.asarray(mean, np.float64).reshape(groups, cg)[np.arange(o) // (o // groups)]
    return (per_input * group_mean).sum(axis=1)


def constant(array: np.ndarray) -> relax.Constant:
    """A Relax constant of ``array``'s own dtype (``relax.const`` turns int64 NumPy data into int32)."""
    return relax.const(array, str(array.dtype))


def block_diagonal(weight: np.ndarray, groups: int) -> np.ndarray:
    """A grouped conv's [O, I/G, KH, KW] weight as the equivalent groups=1 weight [O, I, KH, KW]
    (zeros off the diagonal blocks: the same sums, G times the multiply-adds)."""
    o, cg, kh, kw = weight.shape
    og = o // groups
    dense = np.zeros((o, cg * groups, kh, kw), weight.dtype)
    for g in range(groups):
        dense[g * og:(g + 1) * og, g * cg:(g + 1) * cg] = weight[g * og:(g + 1) * og]
    return dense


class _QTensor:
    """An int8 tensor of the new graph: its var, scale, real channel count, layout and zero point
    (0, or -128 for an unsigned tensor: ``zero_points.py``)."""

    def __init__(self, var, scale: float, channels: int, layout, zero: int = 0):
        self.var, self.scale, self.channels, self.layout, self.zero = var, scale, channels, layout, zero


@tvm.transform.module_pass(opt_level=0, name="QuantizeInt8")
class QuantizeInt8:
    """Rewrite ``main`` to int8.

    Args:
        amax: ``{point name: amax}`` from a range source (calibration, given, learned in QAT).
        config: the scheme (skip list, dense on/off).
        target: the build's target; the registry picks each layer's kernel for it.
        names: torch layer names from the frontend (``{"conv2d": [...], "dense": [...]}``).
        choices: ``{layer name: implementation name}`` to prefer over the registry's default
            order; ignored where it does not apply.
        chooser: ``(op, workload, candidates) -> implementation name or None``, asked for a
            layer ``choices`` does not name (a tuning database's measured pick).
        expose_activations: make main return ``(outputs, *int8 activations)``, in layer order,
            to compare builds layer by layer (the report's ``exposed`` describes each).
        channel_means: ``{point name: mean per channel}`` of the calibration images: given,
            each conv / linear layer's bias is corrected for its int8 weights' mean error
            (:func:`weight_error_mean`); None: no correction.
    After the pass, ``self.report`` holds one row per layer, the float ops that remain and every
    conversion kernel.
    """

    def __init__(self, amax: dict, config: QuantConfig, target: TargetInfo, names: dict | None = None,
                 choices: dict | None = None, expose_activations: bool = False, chooser=None,
                 channel_means: dict | None = None):
        self.amax, self.config, self.target, self.names = dict(amax), config, target, names
        self.channel_means = channel_means
        self.choices = dict(choices or {})
        self.chooser = chooser
        self.expose_activations = expose_activations
        self.report: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        graph = analyze(mod["main"], self.names)
        missing = sorted(set(graph.points.values()) - set(self.amax))
        if missing:
            raise ValueError(f"no calibrated range for {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                             "calibrate this model (or this checkpoint) again")
        return _Rewriter(graph, self).run(mod)


class _Rewriter:
    def __init__(self, graph: Graph, qpass: QuantizeInt8):
        self.g, self.p = graph, qpass
        self.bb = relax.BlockBuilder()
        self.fenv: dict = {}   # old var -> new float var
        self.qenv: dict = {}   # old var -> {layout name: _QTensor}
        self.rows: list = []
        self.float_ops: Counter = Counter()
        self.conversions: list = []   # (kind, tensor) of every conversion kernel emitted
        self.pending: dict = {}       # graph.lazy var -> its binding, emitted in float at the first float read
        self.gathered: dict = {}      # channels layer output -> (int8 source var, channel index from it)
        self.value = {b.var: b.value for b in graph.bindings}  # the float graph's expressions (lut tables)
        self.readers: dict = {}       # var -> the layers that read it
        for ly in graph.layers:
            for v in ly.inputs:
                self.readers.setdefault(v, []).append(ly)
        # the tensors stored unsigned (zero point -128, scale amax / 255), decided before any is made
        self.unsigned = planned_unsigned(graph, qpass.config)
        self.symmetric_fallback: list = []   # planned unsigned, made symmetric (output_zero_fits)

    # ---- values -------------------------------------------------------------------------
    def scale(self, var) -> float:
        return activation_scale(self.p.amax[self.g.points[var]], var in self.unsigned)

    def zero(self, var) -> int:
        return UNSIGNED_ZERO if var in self.unsigned else 0

    def quantized(self, expr) -> _QTensor | None:
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
            shape = static_shape(q.var.ty)
            n, _, h, w = static_shape(expr.ty)
            out = (n, q.channels, h, w)
            f = q.layout.dequantize(shape, q.channels, q.scale, q.zero)
            self.fenv[expr] = self.call(f, "dequantize_unpack", [q.var], out, "float32")
            self.conversions.append(("dequantize", f"{expr.name} ({q.layout.name})"))
            return self.fenv[expr]
        return expr  # a function parameter

    def int8_of(self, expr, layout_name: str) -> _QTensor:
        """``expr`` as int8 in ``layout_name``: as produced, relayouted, or quantized from float."""
        versions = self.qenv.setdefault(expr, {})
        if layout_name in versions:
            return versions[layout_name]
        layout = registry.layout(layout_name)
        src = next(iter(versions.values()), None)
        if src is not None:  # int8 already, in another family's layout
            shape = (*static_shape(expr.ty)[:1], src.channels, *static_shape(expr.ty)[2:])
            var = self.call(relayout_int8(src.layout, layout, shape), "relayout_int8", [src.var],
                            layout.packed_shape(shape), "int8")
            self.conversions.append(("relayout", f"{expr.name} ({src.layout.name}->{layout.name})"))
            versions[layout_name] = _QTensor(var, src.scale, src.channels, layout, src.zero)
            return versions[layout_name]
        x = self.float_of(expr)
        shape = static_shape(x.ty)
        s, zero = self.scale(expr), self.zero(expr)
        var = self.call(layout.quantize(shape, s, zero), "quantize_pack", [x], layout.packed_shape(shape), "int8")
        self.conversions.append(("quantize", f"{expr.name} ({layout.name})"))
        versions[layout_name] = _QTensor(var, s, shape[1], layout, zero)
        return versions[layout_name]

    def produce(self, old_var, var, scale: float, channels: int, layout_name: str, zero: int = 0) -> None:
        if zero != self.zero(old_var):
            raise RuntimeError(f"{old_var.name}: made with zero point {zero}, planned {self.zero(old_var)}")
        self.qenv[old_var] = {layout_name: _QTensor(var, scale, channels, registry.layout(layout_name), zero)}

    def call(self, prim, name, args, shape, dtype):
        if "global_symbol" in prim.attrs:
            prim = prim.without_attr("global_symbol")  # add_func names it; te's default "main" would clash
        gv = self.bb.add_func(prim.with_attr("op_pattern", 8), name)  # 8 = kOpaque: FuseOps leaves it alone
        return self.bb.emit(relax.call_tir(gv, args, relax.TensorType(shape, dtype)), name_hint=name)

    def emit_float(self, binding):
        value = substitute(binding.value, {})
        # Every Var the value reads, inside a Tuple argument too (R.concat((a, b))): an int8
        # producer's output must be dequantized, a float one renamed.  Looking at direct
        # arguments only left concat's inputs undefined ("Var lv403 is not defined").
        vmap = {a: self.float_of(a) for a in free_vars(value)}
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
                        why = self.why_float(ly) or getattr(self, f"emit_{ly.kind}")(ly)
                        if why is None:
                            continue
                        self.rows.append(dict(layer=ly.name, kind=ly.kind, kernel="float (" + why + ")",
                                              dtype="float32"))
                        for v in ly.vars:
                            self.emit_float(value[v])
                    elif b.var in self.g.lazy:
                        self.pending[b.var] = b
                    elif b.var not in self.g.consumed:
                        self.emit_float(b)
                result = self._output(func.body.body)
                exposed = []
                if self.p.expose_activations:
                    made_by = {ly.output: ly.name for ly in self.g.layers}
                    for ly in self.g.layers:
                        q = self.quantized(ly.output)
                        if q is not None:
                            # inputs: the layers whose outputs it reads (none: the image, or float ops)
                            exposed.append((dict(layer=ly.name, point=self.g.points.get(ly.output), layout=q.layout.name,
                                                 channels=q.channels, scale=q.scale, zero=q.zero,
                                                 inputs=[made_by[v] for v in ly.inputs if v in made_by]), q.var))
                    result = relax.Tuple([result] + [v for _, v in exposed])
                out = self.bb.emit_output(result)
            self.bb.emit_func_output(out)
        new_mod = self.bb.get()
        for gv, f in mod.functions.items():
            if gv.name_hint != "main" and gv.name_hint not in [g.name_hint for g in new_mod.get_global_vars()]:
                new_mod[gv] = f
        kinds = Counter(kind for kind, _ in self.conversions)
        self.p.report = {"layers": self.rows, "float_ops": dict(self.float_ops),
                         "conversions": [f"{kind} {at}" for kind, at in self.conversions],
                         "relayouts": kinds.get("relayout", 0),
                         "unsigned": sorted(self.g.points[v] for v in self.unsigned if v in self.g.points),
                         "unsigned_fallback": self.symmetric_fallback,
                         "exposed": [e for e, _ in exposed]}
        return relax.transform.DeadCodeElimination(["main"])(new_mod)

    def _output(self, body):
        if isinstance(body, relax.Tuple):
            return relax.Tuple([self.float_of(f) for f in body.fields])
        return self.float_of(body)

    def why_float(self, ly) -> str | None:
        if ly.reason_float:
            return ly.reason_float
        if self.p.config.skips(ly.name):
            return "in the skip list"
        if ly.kind == "dense" and not self.p.config.quantize_dense:
            return "quantize_dense=False"
        if ly.kind in ("max_pool2d", "avg_pool2d", "affine", "channels", "lut") and self.quantized(ly.inputs[0]) is None:
            return "input is float"  # quantizing a float tensor only to pool or scale it gains nothing
        if ly.kind == "lut" and not any(self.may_run_int8(r) for r in self.readers.get(ly.output, [])):
            # its int8 output would be dequantized at once, a rounding the float path does not have
            return "no int8 reader"
        return None

    def may_run_int8(self, ly) -> bool:
        return may_run_int8(ly, self.p.config)

    def pick(self, op: str, wl, layer: str, follow: str | None = None):
        """The implementation of ``op`` for ``wl``: the user's choice for the layer, else the
        chooser's (measured), else the first of the registry's that applies, in the layout
        ``follow`` if one is given and has a kernel preferred for ``wl``."""
        prefer = self.p.choices.get(layer)
        if prefer is None and self.p.chooser is not None:
            prefer = self.p.chooser(op, wl, registry.candidates(op, wl, self.p.target))
        if prefer is None and follow is not None:
            prefer = next((impl.name for impl in registry.candidates(op, wl, self.p.target, layout=follow)
                           if impl.preferred(wl, self.p.target)), None)
        return registry.select(op, wl, self.p.target, prefer=prefer)

    def no_kernel(self, op, wl) -> str:
        return f"no int8 {op} kernel for {wl.describe() if hasattr(wl, 'describe') else wl} on {self.p.target.kind}" \
               + (f" {self.p.target.arch}" if self.p.target.arch else "")

    def input_mean(self, ly) -> np.ndarray | None:
        """The calibration images' per-channel mean of ``ly``'s input (None: no bias correction)."""
        means = self.p.channel_means
        if means is None:
            return None
        point = self.g.points.get(ly.inputs[0])
        if point not in means:
            raise ValueError(f"bias correction: no calibrated mean for {ly.name}'s input {point}: calibrate again")
        return means[point]

    def emit_conv2d(self, ly) -> str | None:
        a = ly.call.attrs
        n, c, h, w = static_shape(ly.inputs[0].ty)
        weight = ly.weight
        o, _, kh, kw = weight.shape
        groups = int(a.groups)
        qw, s_w = quantize_weight_per_channel(weight)   # per output channel: block-diagonal or not
        if self.zero(ly.output) and not self.output_zero_fits(ly, s_w):
            self.make_symmetric(ly.output)
        s_y, z_y = self.scale(ly.output), self.zero(ly.output)
        activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
        shape = dict(batch=n, in_channels=c, height=h, width=w, out_channels=o, kernel=(kh, kw),
                     stride=tuple(map(int, a.strides)), padding=tuple(map(int, a.padding)),
                     dilation=tuple(map(int, a.dilation)), in_zero=self.zero(ly.inputs[0]))
        wl = ConvWorkload.with_activation(activation, act_min, act_max, groups=groups, **shape)
        # a depthwise conv (memory-bound, a kernel in each layout) takes its int8 input's layout:
        # no relayout before it, whichever family ran the conv before (dp4a's NCHW4c at small
        # maps, the tensor cores' NHWC32)
        x_in = self.quantized(ly.inputs[0]) if wl.is_depthwise else None
        impl = self.pick("conv2d", wl, ly.name, follow=x_in.layout.name if x_in else None)
        note = ""
        if impl is None and groups > 1:
            # Groups no kernel takes as they are (channels per group not a multiple of 4):
            # the same conv with a block-diagonal weight, groups=1.
            dense = ConvWorkload.with_activation(activation, act_min, act_max, **shape)
            impl = self.pick("conv2d", dense, ly.name)
            if impl is not None:
                wl, weight, note = dense, block_diagonal(weight, groups), f" (groups={groups} as block-diagonal)"
        if impl is None:
            return self.no_kernel("conv2d", wl)
        x = self.int8_of(ly.inputs[0], impl.input_layout())
        if note:
            qw, s_w = quantize_weight_per_channel(weight)
        acc_scale = x.scale * s_w.astype(np.float64)
        bias = np.zeros(o) if ly.bias is None else ly.bias.astype(np.float64)
        mean = self.input_mean(ly)
        if mean is not None:  # weight is groups=1 here when it was made block-diagonal
            bias = bias - weight_error_mean(weight, qw, s_w, mean, 1 if note else groups)
        bias_q = np.round(bias / acc_scale)
        # zero points: the kernel reads q_x = x / s_x + z_x, so its sum holds z_x * sum(w) too; and
        # adds z_y to the output as z_y / M in the accumulator (off by at most M / 2 of a step)
        bias_q = bias_q - x.zero * qw.reshape(o, -1).astype(np.float64).sum(axis=1) \
            + np.round(z_y * s_y / acc_scale)
        clipped = int(np.count_nonzero(np.abs(bias_q) > 2**31 - 1))
        bias_q = np.clip(bias_q, -2**31, 2**31 - 1).astype(np.int32)
        mult, shift = quantize_multiplier(acc_scale / s_y)
        args = [x.var] + [constant(p) for p in impl.pack_params(wl, qw, bias_q, mult, shift)]
        prim = impl.compute(wl)
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), args, impl.out_shape(wl), "int8")
        self.produce(ly.output, var, s_y, o, impl.layout, z_y)
        act = {"relu": "+relu", "none": ""}.get(activation, f"+clip[{act_min},{act_max}]")
        row = dict(layer=ly.name, kind="conv2d" + ("+bias" if ly.bias is not None else "") + act,
                   kernel=impl.name, dtype="int8", shape=wl.describe() + note, in_scale=x.scale, out_scale=s_y)
        if clipped:  # a bias beyond int32 at scale s_x * s_w: saturated, and the report says so
            row["bias_saturated"] = clipped
        if mean is not None:
            row["bias_corrected"] = True
        self.rows.append(row)
        return None

    def output_zero_fits(self, ly, s_w: np.ndarray) -> bool:
        """Whether a conv's unsigned output zero point, folded into its int32 bias as ``-128 / M``
        (``M = s_x * s_w / s_y`` per channel), fits there with the bias itself: not where a
        channel's ``M`` is under ~1e-7 (a dead filter, a BatchNorm's zero gamma folded in), whose
        output would then saturate instead of reading the real zero."""
        x = self.quantized(ly.inputs[0])   # a max pool's or gather's output: its source's scale
        s_x = x.scale if x is not None else self.scale(ly.inputs[0])
        m = s_x * s_w.astype(np.float64) / self.scale(ly.output)
        bias = np.zeros(len(m)) if ly.bias is None else np.abs(ly.bias.astype(np.float64))
        fold = np.where(m > 0, (-UNSIGNED_ZERO + bias / self.scale(ly.output)) / np.maximum(m, 1e-300), np.inf)
        headroom = 2**30   # |bias_q| <= 2**30 also keeps the 32-bit requantize (I32_MAX_BIAS) usable
        return bool(np.all(fold < headroom) and np.all(quantize_multiplier(np.maximum(m, 1e-300))[0] > 0))

    def make_symmetric(self, var) -> None:
        """Take ``var`` out of the unsigned plan, with the max pools and gathers that pass its
        integers on (their outputs are the same tensor); none of its readers is made yet."""
        self.unsigned.discard(var)
        self.symmetric_fallback.append(self.g.points.get(var, var.name))
        for r in self.readers.get(var, []):
            if r.kind in PASS_THROUGH and r.output in self.unsigned:
                self.make_symmetric(r.output)

    def emit_max_pool2d(self, ly) -> str | None:
        a = ly.call.attrs
        x = self.quantized(ly.inputs[0])
        shape = static_shape(x.var.ty)
        wl = PoolWorkload(shape, tuple(map(int, a.pool_size)), tuple(map(int, a.strides)),
                          tuple(map(int, a.padding)), tuple(map(int, a.dilation)), bool(a.ceil_mode))
        impl = registry.select("max_pool2d", wl, self.p.target, layout=x.layout.name)
        if impl is None:
            return self.no_kernel("max_pool2d", f"{x.layout.name} tensor")
        n, _, oh, ow = static_shape(ly.output.ty)
        out_shape = x.layout.packed_shape((n, x.channels, oh, ow))
        prim = impl.compute(wl)
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), [x.var], out_shape, "int8")
        self.produce(ly.output, var, x.scale, x.channels, impl.layout, x.zero)  # the same integers
        self.rows.append(dict(layer=ly.name, kind="max_pool2d", kernel=impl.name, dtype="int8",
                              shape=f"{wl.pool} s{wl.stride[0]}"))
        return None

    def emit_channels(self, ly) -> str | None:
        # A gather of a gather reads the first one's source with the two indices composed (a
        # shuffle then a split is one kernel per piece; the shuffle's own kernel is then dead).
        src, index = ly.inputs[0], list(ly.channel_index)
        while src in self.gathered:
            src, inner = self.gathered[src]
            index = [inner[i] for i in index]
        x = self.quantized(src)
        impl = next(iter(registry.candidates("channels", None, self.p.target, layout=x.layout.name)), None)
        if impl is None:
            return self.no_kernel("channels", f"{x.layout.name} tensor")
        n, c, h, w = static_shape(ly.output.ty)
        wl = ChannelsWorkload((n, h, w), x.channels, c)
        prim = impl.compute(wl)
        args = [x.var] + [constant(p) for p in impl.pack_params(wl, np.array(index, np.int32))]
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), args, x.layout.packed_shape((n, c, h, w)), "int8")
        self.produce(ly.output, var, x.scale, c, impl.layout, x.zero)  # values moved, not changed: the input's scale
        self.gathered[ly.output] = (src, index)
        self.rows.append(dict(layer=ly.name, kind="channels", kernel=impl.name, dtype="int8",
                              shape=f"{x.channels}->{c} channels"))
        return None

    def emit_lut(self, ly) -> str | None:
        x = self.quantized(ly.inputs[0])
        impl = next(iter(registry.candidates("lut", None, self.p.target, layout=x.layout.name)), None)
        if impl is None:
            return self.no_kernel("lut", f"{x.layout.name} tensor")
        n, c, h, w = static_shape(ly.output.ty)
        wl = LutWorkload((n, h, w), c)
        s_y = self.scale(ly.output)
        table = lut_table(ly, self.value, x.scale, s_y, x.zero)
        prim = impl.compute(wl)
        args = [x.var] + [constant(p) for p in impl.pack_params(wl, table)]
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), args, x.layout.packed_shape((n, c, h, w)), "int8")
        self.produce(ly.output, var, s_y, c, impl.layout)
        ops = " ".join(str(self.value[v].op.name).removeprefix("relax.") for v in ly.vars)
        self.rows.append(dict(layer=ly.name, kind="lut", kernel=impl.name, dtype="int8", shape=f"table of {ops}"))
        return None

    def emit_avg_pool2d(self, ly) -> str | None:
        x = self.quantized(ly.inputs[0])
        pool, stride, padding = ly.window
        s_y, z_y = self.scale(ly.output), self.zero(ly.output)
        mult, shift = quantize_multiplier(np.array([x.scale / (pool[0] * pool[1] * s_y)]))
        wl = AvgPoolWorkload(static_shape(x.var.ty), pool, stride, padding, int(mult[0]), int(shift[0]), x.zero, z_y)
        impl = registry.select("avg_pool2d", wl, self.p.target, layout=x.layout.name)
        if impl is None:
            return self.no_kernel("avg_pool2d", f"{x.layout.name} tensor")
        n, _, oh, ow = static_shape(ly.output.ty)
        prim = impl.compute(wl)
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), [x.var],
                        x.layout.packed_shape((n, x.channels, oh, ow)), "int8")
        self.produce(ly.output, var, s_y, x.channels, impl.layout, z_y)
        self.rows.append(dict(layer=ly.name, kind="avg_pool2d", kernel=impl.name, dtype="int8",
                              shape=f"{pool} s{wl.stride[0]}"))
        return None

    def emit_affine(self, ly) -> str | None:
        x = self.quantized(ly.inputs[0])
        s_y, z_y = self.scale(ly.output), self.zero(ly.output)
        activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
        wl = AffineWorkload(static_shape(x.var.ty), act_min, act_max, z_y)
        impl = registry.select("affine", wl, self.p.target, layout=x.layout.name)
        if impl is None:
            return self.no_kernel("affine", f"{x.layout.name} tensor")
        mult, shift, bias = affine_params(ly.weight, ly.bias, x.scale, s_y, x.zero)
        prim = impl.compute(wl)
        args = [x.var] + [constant(p) for p in impl.pack_params(wl, mult, shift, bias)]
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), args, static_shape(x.var.ty), "int8")
        self.produce(ly.output, var, s_y, x.channels, impl.layout, z_y)
        act = {"relu": "+relu", "none": ""}.get(activation, f"+clip[{act_min},{act_max}]")
        self.rows.append(dict(layer=ly.name, kind="batch_norm" + act, kernel=impl.name, dtype="int8",
                              shape=str(static_shape(ly.output.ty))))
        return None

    def emit_add(self, ly) -> str | None:
        # The inputs' layout: the first int8 one's (a float input is quantized into it).
        # The layout most of the input channels are in (ties: the latest input's), so that the
        # fewest relayouts run: DenseNet concatenates a dp4a stem's NCHW4c features with every
        # tensor-core layer's NHWC32 ones, and each input is relayouted once (``int8_of`` keeps it).
        weight: dict[str, int] = {}
        for q in (self.quantized(v) for v in ly.inputs):
            if q is not None:
                weight[q.layout.name] = weight.pop(q.layout.name, 0) + q.channels  # re-insert: latest last
        layout_name = max(reversed(weight), key=weight.get) if weight else None
        for name in ([layout_name] if layout_name else list(registry.LAYOUTS)):
            impls = registry.candidates("add", None, self.p.target, layout=name)
            if impls:
                impl = impls[0]
                break
        else:
            return self.no_kernel("add", "these inputs")
        qa, qb = (self.int8_of(v, impl.layout) for v in ly.inputs)
        s_y, z_y = self.scale(ly.output), self.zero(ly.output)
        mult_a, mult_b, shift = add_multipliers(qa.scale, qb.scale, s_y)
        activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
        shape = static_shape(qa.var.ty)
        prim = impl.compute(AddWorkload(shape, mult_a, mult_b, shift, act_min, act_max, qa.zero, qb.zero, z_y))
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), [qa.var, qb.var], shape, "int8")
        self.produce(ly.output, var, s_y, qa.channels, impl.layout, z_y)
        act = {"relu": "+relu", "none": ""}.get(activation, f"+clip[{act_min},{act_max}]")
        self.rows.append(dict(layer=ly.name, kind="add" + act, kernel=impl.name, dtype="int8",
                              shape=str(static_shape(ly.output.ty))))
        return None

    def emit_concat(self, ly) -> str | None:
        # The layout most of the input channels are in (ties: the latest input's), so that the
        # fewest relayouts run: DenseNet concatenates a dp4a stem's NCHW4c features with every
        # tensor-core layer's NHWC32 ones, and each input is relayouted once (``int8_of`` keeps it).
        weight: dict[str, int] = {}
        for q in (self.quantized(v) for v in ly.inputs):
            if q is not None:
                weight[q.layout.name] = weight.pop(q.layout.name, 0) + q.channels  # re-insert: latest last
        layout_name = max(reversed(weight), key=weight.get) if weight else None
        impl = next(iter(registry.candidates("concat", None, self.p.target, layout=layout_name)), None) \
            if layout_name else registry.select("concat", None, self.p.target)
        if impl is None:
            return self.no_kernel("concat", "these inputs")
        qs = [self.int8_of(v, impl.layout) for v in ly.inputs]
        s_y, z_y = self.scale(ly.output), self.zero(ly.output)
        mult, shift = quantize_multiplier(np.array([q.scale / s_y for q in qs]))
        n, c, h, w = static_shape(ly.output.ty)
        zeros = tuple(q.zero for q in qs) if any(q.zero for q in qs) else ()
        wl = ConcatWorkload((n, h, w), tuple(q.channels for q in qs), tuple(map(int, mult)), tuple(map(int, shift)),
                            zeros, z_y)
        prim = impl.compute(wl)
        layout = registry.layout(impl.layout)
        var = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), [q.var for q in qs],
                        layout.packed_shape((n, c, h, w)), "int8")
        self.produce(ly.output, var, s_y, c, impl.layout, z_y)
        self.rows.append(dict(layer=ly.name, kind=f"concat x{len(qs)}", kernel=impl.name, dtype="int8",
                              shape=str((n, c, h, w))))
        return None

    def emit_dense(self, ly) -> str | None:
        x = self.float_of(ly.inputs[0])
        n, k = static_shape(x.ty)
        o = ly.weight.shape[0]
        wl = DenseWorkload(n, k, o, (ly.clip or (0.0, float("inf"))) if ly.relu else None)
        impl = registry.select("dense", wl, self.p.target)
        if impl is None:
            return self.no_kernel("dense", f"{k}->{o}")
        s_x, z_x = self.scale(ly.inputs[0]), self.zero(ly.inputs[0])
        kp = impl.in_features_padded(wl)
        xq = self.call(quantize_rows((n, k), s_x, kp, z_x), "quantize_rows", [x], (n, kp), "int8")
        qw, s_w = quantize_weight_per_channel(ly.weight)
        bias = np.zeros(o, np.float32) if ly.bias is None else ly.bias
        mean = self.input_mean(ly)
        if mean is not None:
            bias = bias - weight_error_mean(ly.weight, qw, s_w, mean)
        if z_x:  # the kernel sums q_x = x / s_x + z_x: z_x * sum(w), at scale s_x * s_w, comes off the bias
            bias = bias - z_x * qw.astype(np.float64).sum(axis=1) * s_x * s_w
        args = [xq, *map(constant, impl.pack_params(wl, qw, (s_x * s_w).astype(np.float32), bias.astype(np.float32)))]
        prim = impl.compute(wl)
        self.fenv[ly.output] = self.call(prim, str(prim.attrs["tvm_qconv.kernel"]), args, (n, o), "float32")
        self.rows.append(dict(layer=ly.name, kind="dense" + ("+bias" if ly.bias is not None else "")
                              + ("+relu" if ly.relu else ""), kernel=impl.name, dtype="int8",
                              shape=f"{k}->{o} b{n}", in_scale=s_x))
        return None
