"""The ONNX backend of a quantization plan: the plan's float graph as ONNX nodes, with explicit
QuantizeLinear / DequantizeLinear pairs at the plan's scales (``onnx_export.export_onnx`` writes
the file).

What the file holds is the TVM library's int8 model (``lowering/relax.py``) tensor by tensor: both
read one plan (``tvm_qconv/quantization``), so they agree on every layer's int8 / float choice,
scale and zero point.

- every activation that is int8 there is quantized once, by one ``QuantizeLinear`` at the plan's
  scale and zero point (0 and ``max(amax, 1e-30) / 127``; -128 and ``amax / 255`` for the tensors
  the library keeps unsigned, ``QuantConfig.unsigned_activations``) where it is made (or where its
  first int8 reader needs it, for a float tensor), and each node that reads it has its own
  ``DequantizeLinear`` of it;
- the weights of int8 conv / linear layers are int8 initializers (the plan's integers, per
  output channel) dequantized per output channel (axis 0);
- a conv's bias stays float: TensorRT's parser refuses a DequantizeLinear of INT32 ("only
  activation types allowed as input to this layer", NVIDIA/TensorRT#3360, onnx/onnx-tensorrt#850),
  and ONNX Runtime quantizes a float bias itself to the same ``round(b / (s_x * s_w))`` the project
  uses (its results are identical with either form, measured on resnet18);
- a layer absorbs its bias and ReLU / clip (``graph.Layer.vars``): ``DQ -> Conv [-> Relu] -> Q``,
  TensorRT's explicit-quantization pattern for an int8 conv.  ONNX Runtime (CPU) makes a
  ``QLinearConv`` of the convs with no activation; with a ReLU between it keeps a float
  ``FusedConv`` (it folds a ReLU into ``QuantizeLinear`` only at zero point -128: the unsigned
  activations'), and on x86 it wants ``session.qdqisint8allowed=1`` (docs/usage.md, "Export to ONNX");
- a lookup-table activation (``lut``: SiLU, hardswish... after an int8 layer) is its float ops
  between a DequantizeLinear and a QuantizeLinear at its output's scale, what the table tabulates;
- everything the project runs in float (skipped layers, layers without an int8 kernel,
  LayerNorm, the classifier's flatten...) is float here too.

The two differ only in rounding: ONNX rounds half to even and requantizes in float, the project
rounds half up in fixed point; and ONNX's int8 saturates at -128 where the project clamps at -127
(only values beyond the calibrated range, which are clipped either way, can tell).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
import tvm
from onnx import numpy_helper
from tvm import relax

from ..elementwise_ops import ELEMENTWISE, OPS
from ..errors import InputError
from ..graph import static_shape
from ..quantization.plan import QuantizationPlan, TensorQuant, TensorRead

BATCH = "batch"  # the dim_param of the batch dimension of a dynamic-batch file

# The Relax ops of a simplified float main that have an ONNX form here: every elementwise op a table
# region may hold (``elementwise_ops.OPS``, one table for the analysis, the table builder and this
# lowering), and the others the 16 torchvision classifiers of the zoo use.
EXPORTABLE_OPS = (
    *ELEMENTWISE, "relax.nn.conv2d", "relax.nn.softmax", "relax.reshape", "relax.permute_dims", "relax.concat",
    "relax.split", "relax.matmul", "relax.mean", "relax.nn.batch_norm", "relax.nn.layer_norm", "relax.nn.max_pool2d",
    "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d", "Tuple", "TupleGetItem",
)


def op_name(expr) -> str:
    """The Relax op of a binding's value (``relax.nn.conv2d``), or ``Tuple`` / ``TupleGetItem``."""
    if isinstance(expr, relax.Call):
        return str(getattr(expr.op, "name", expr.op))
    return type(expr).__name__


@dataclass
class _QTensor:
    """An int8 tensor of the ONNX graph: its QuantizeLinear output, its scale (and the scale's
    initializer), the float tensor it quantized, and its zero point's initializer."""

    q: str
    scale: float
    scale_name: str
    source: str
    zero_name: str
    zero: int = 0


class ONNXEmitter:
    """One pass over the float graph's bindings: each layer as the plan says (int8 between Q/DQ
    at the plan's scales, or float); a tensor's int8 version is made where its first int8 reader
    needs it (or by its int8 producer), float readers read the float tensor (an int8 producer's
    dequantized output)."""

    def __init__(self, plan: QuantizationPlan, input_shape: tuple, opset: int, dynamic_batch: bool):
        self.plan, self.g, self.opset = plan, plan.graph, opset
        self.input_shape, self.dynamic = input_shape, dynamic_batch
        self.nodes: list = []
        self.inits: list = []
        self.used: set = set()
        self.fname: dict = {}     # relax var -> ONNX name of its float value
        self.qver: dict = {}      # relax var -> _QTensor
        self.tuples: dict = {}    # relax var of a tuple -> [ONNX names]
        self.batch: dict = {}     # relax var -> (axis, k): that axis holds batch * k (dynamic batch)
        self.static_reason: str | None = None
        self.float_ops: dict = {}
        self.float_layers: list = []
        self.qdq_pairs = 0
        self.int8_weights = 0
        self.zeros: dict = {}     # zero point -> its initializer
        self.pending: dict = {}   # graph.lazy var -> its binding, emitted at the first float read

    # ---- names, constants, Q/DQ ---------------------------------------------------------
    def fresh(self, hint: str) -> str:
        base = "".join(c if c.isalnum() or c in "._" else "_" for c in hint) or "t"
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name

    def const(self, array, hint: str) -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs: list, hint: str, outputs: int = 1, **attrs):
        outs = [self.fresh(hint if outputs == 1 else f"{hint}_{i}") for i in range(outputs)]
        self.nodes.append(onnx.helper.make_node(op, list(inputs), outs, name=self.fresh(f"{op}_{hint}"), **attrs))
        return outs[0] if outputs == 1 else outs

    def zero_point(self, zero: int = 0) -> str:
        if zero not in self.zeros:
            self.zeros[zero] = self.const(np.int8(zero), "zero_point_int8" if zero == 0 else f"zero_point_int8_{-zero}")
        return self.zeros[zero]

    def quantize(self, src: str, scale: float, hint: str, zero: int = 0) -> _QTensor:
        """``QuantizeLinear(src)`` at ``scale`` (int8, zero point 0, or -128 for an unsigned
        tensor): one per int8 tensor."""
        s = self.const(np.float32(scale), f"{hint}_scale")
        self.qdq_pairs += 1
        z = self.zero_point(zero)
        return _QTensor(self.node("QuantizeLinear", [src, s, z], f"{hint}_q"), scale, s, src, z, zero)

    def dq(self, t: _QTensor) -> str:
        """A DequantizeLinear of ``t`` for one reading node.  One per reader rather than one shared
        by all: each ``DQ... -> op -> Q`` group is then a self-contained "node unit" that a runtime
        fuses without touching its neighbours (ONNX Runtime makes these copies itself before
        fusing, EnsureUniqueDQForNodeUnit; measured the same QLinearConv count either way)."""
        return self.node("DequantizeLinear", [t.q, t.scale_name, t.zero_name], f"{t.q.removesuffix('_q')}_dq")

    def float_of(self, expr) -> str:
        if isinstance(expr, tvm.ir.expr.GenericConst):
            return self.const(expr.value.numpy(), "const")
        if expr in self.pending:
            self.emit_float(self.pending.pop(expr))
        if expr in self.fname:
            f = self.fname[expr]
            return self.dq(f) if isinstance(f, _QTensor) else f
        raise RuntimeError(f"{expr} is read before it is defined")

    def int8_of(self, read: TensorRead) -> str:
        """``read.var``'s int8 version, dequantized for one reader: as produced, or quantized from
        float at the plan's scale and zero point (once; later int8 readers share the QuantizeLinear)."""
        var = read.var
        if var not in self.qver:
            self.qver[var] = self.quantize(self.float_of(var), read.quant.scale, var.name, read.quant.zero)
        return self.dq(self.qver[var])

    def produce(self, var, out: str, quant: TensorQuant) -> None:
        """An int8 layer's output, requantized as the plan says; every consumer reads the int8 tensor."""
        self.qver[var] = self.fname[var] = self.quantize(out, quant.scale, var.name, quant.zero)

    # ---- the walk -----------------------------------------------------------------------
    def run(self):
        func = self.g.func
        binding = self.g.binding
        (param,) = func.params
        self.fname[param] = "input"
        self.used.add("input")
        self.batch[param] = (0, 1)
        for b in self.g.bindings:
            ly = self.g.layer_of_var.get(b.var)
            if ly is not None:
                lp = self.plan.of(ly)
                if lp.int8:
                    getattr(self, f"layer_{ly.kind}")(lp)
                    for v in ly.vars:
                        self.track(binding[v])
                    continue
                self.float_layers.append(ly.name)
                for v in ly.vars:
                    self.emit_float(binding[v])
            elif b.var in self.g.lazy:  # a split whose pieces are int8 layers: ONNX needs it only for a float piece
                self.pending[b.var] = b
                self.track(b)
            elif b.var not in self.g.consumed:
                self.emit_float(b)
        body = func.body.body
        if body in self.pending:  # a split returned whole
            self.emit_float(self.pending.pop(body))
        outs = self.tuples[body] if body in self.tuples else [self.float_of(body)]
        out_batch = self.batch.get(body) if body not in self.tuples else self.batch.get(("tuple", body))
        if self.dynamic and out_batch != (0, 1):
            self.no_dynamic("the output's first dimension is not the batch")
        dyn = self.dynamic and self.static_reason is None
        names = ["logits"] if len(outs) == 1 else [f"output{i}" for i in range(len(outs))]
        out_types = body.ty.fields if isinstance(body.ty, relax.TupleType) else [body.ty]
        outputs = []
        for out, name, ty in zip(outs, names, out_types):
            self.nodes.append(onnx.helper.make_node("Identity", [out], [name], name=self.fresh(f"Identity_{name}")))
            shape = list(static_shape(ty))
            if dyn:
                shape[0] = BATCH
            outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
        in_shape = list(static_shape(param.ty))
        if dyn:
            in_shape[0] = BATCH
        inputs = [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, in_shape)]
        return onnx.helper.make_graph(self.nodes, "tvm_qconv_int8", inputs, outputs, initializer=self.inits)

    def summary(self) -> dict:
        return dict(opset=self.opset, qdq_activations=self.qdq_pairs, int8_weights=self.int8_weights,
                    int8_layers=sum(lp.int8 for lp in self.plan.layers), layers=len(self.plan.layers), float_layers=list(self.float_layers),
                    float_ops=dict(self.float_ops), dynamic_batch=self.dynamic and self.static_reason is None,
                    static_batch_reason=self.static_reason, nodes=len(self.nodes))

    # ---- int8 layers --------------------------------------------------------------------
    def activation(self, ly, x: str, hint: str) -> str:
        """The layer's absorbed ReLU / clip, in float (the Q after it then matches the int8 clamp)."""
        if not ly.relu:
            return x
        lo, hi = ly.clip or (0.0, math.inf)
        if (lo, hi) == (0.0, math.inf):
            return self.node("Relu", [x], f"{hint}_relu")
        return self.clip(x, lo, hi, hint)

    def clip(self, x: str, lo: float, hi: float, hint: str) -> str:
        bounds = [self.const(np.float32(v), f"{hint}_{n}") if np.isfinite(v) else ""
                  for v, n in ((lo, "min"), (hi, "max"))]
        while bounds and bounds[-1] == "":
            bounds.pop()
        return self.node("Clip", [x, *bounds], f"{hint}_clip")

    def weight(self, lp, hint: str) -> str:
        """The layer's int8 weight (the plan's integers), dequantized per output channel (axis 0)."""
        qw, s_w = lp.weight
        s = self.const(s_w.astype(np.float32), f"{hint}_scale")
        zp = self.const(np.zeros(len(s_w), np.int8), f"{hint}_zero_point")
        self.int8_weights += 1
        return self.node("DequantizeLinear", [self.const(qw, f"{hint}_int8"), s, zp], f"{hint}_dq", axis=0)

    def layer_conv2d(self, lp) -> None:
        ly = lp.layer
        hint = ly.name
        inputs = [self.int8_of(lp.reads[0]), self.weight(lp, f"{hint}.weight")]
        if lp.bias is not None:  # the plan's (corrected or not); float: the module docstring says why not int32
            inputs.append(self.const(lp.bias.astype(np.float32), f"{hint}.bias"))
        y = self.node("Conv", inputs, hint, **self.conv_attrs(ly.call))
        self.produce(ly.output, self.activation(ly, y, hint), lp.output)

    def layer_dense(self, lp) -> None:
        # The plan quantizes a linear layer's float input at its point's scale (quantize_rows),
        # whatever made it: reuse an int8 version only where it is that same quantization.
        ly, read = lp.layer, lp.reads[0]
        var = read.var
        have, made = self.qver.get(var), self.fname.get(var)
        if have is not None and have.scale == read.quant.scale and (made is have or made == have.source):
            x = self.dq(have)
        else:
            x = self.dq(self.quantize(self.float_of(var), read.quant.scale, f"{ly.name}.input", read.quant.zero))
        w = self.weight(lp, f"{ly.name}.weight")  # [O, K]: Gemm's transB
        inputs = [x, w] + ([self.const(lp.bias.astype(np.float32), f"{ly.name}.bias")] if lp.bias is not None else [])
        y = self.node("Gemm", inputs, ly.name, transB=1)
        self.fname[ly.output] = self.activation(ly, y, ly.name)  # float out: the project's dense epilogue

    def layer_add(self, lp) -> None:
        ly = lp.layer
        y = self.node("Add", [self.int8_of(r) for r in lp.reads], ly.name)
        self.produce(ly.output, self.activation(ly, y, ly.name), lp.output)

    def layer_concat(self, lp) -> None:
        ly = lp.layer
        y = self.node("Concat", [self.int8_of(r) for r in lp.reads], ly.name, axis=1)
        self.produce(ly.output, y, lp.output)

    def layer_channels(self, lp) -> None:
        # the gather of its own input (the plan's kernel reads a gather's source through it: one
        # index, the same values)
        ly = lp.layer
        index = self.const(np.array(ly.channel_index, np.int64), ly.name + ".index")
        y = self.node("Gather", [self.dq(self.qver[ly.inputs[0]]), index], ly.name, axis=1)
        # values moved, not changed: requantized at the input's scale and zero point, exact (as the max-pool)
        self.produce(ly.output, y, lp.output)

    def layer_lut(self, lp) -> None:
        # The table's definition: the region's float ops between the input's DequantizeLinear and a
        # QuantizeLinear at the output's scale (TensorRT and ONNX Runtime fuse such pointwise chains).
        ly = lp.layer
        for v in ly.vars:
            self.fname[v] = self.op(self.g.value[v], v)
        self.produce(ly.output, self.fname[ly.output], lp.output)

    def layer_scale(self, lp) -> None:
        # squeeze-excite's gated multiply: the int8 map times the float gate, requantized
        ly = lp.layer
        y = self.node("Mul", [self.int8_of(lp.reads[0]), self.float_of(ly.gate)], ly.name)
        self.produce(ly.output, y, lp.output)

    def layer_layer_norm(self, lp) -> None:
        ly = lp.layer
        self.produce(ly.output, self.layer_norm(ly.call, self.int8_of(lp.reads[0]), ly.name), lp.output)

    def layer_max_pool2d(self, lp) -> None:
        ly = lp.layer
        y = self.node("MaxPool", [self.dq(self.qver[ly.inputs[0]])], ly.name, **self.pool_attrs(ly.call, "max"))
        # No point of its own: the max of int8 values is int8 at the input's scale.  The pair is
        # numerically a no-op; it keeps the next conv's input a DequantizeLinear, so ONNX Runtime
        # and TensorRT run that conv in int8.
        self.produce(ly.output, y, lp.output)

    def layer_avg_pool2d(self, lp) -> None:
        ly = lp.layer
        x = self.qver[ly.inputs[0]]
        if op_name(ly.call) == "relax.mean":       # a classifier's global pool (graph.py)
            y = self.node("GlobalAveragePool", [self.dq(x)], ly.name)
        else:
            y = self.node("AveragePool", [self.dq(x)], ly.name, **self.pool_attrs(ly.call, "avg"))
        self.produce(ly.output, y, lp.output)

    def layer_affine(self, lp) -> None:
        ly = lp.layer
        x = self.dq(self.qver[ly.inputs[0]]) if ly.joined is None else \
            self.node("Concat", [self.int8_of(r) for r in lp.reads], ly.joined.name, axis=1)  # read in place
        y = self.batch_norm(ly.call, x, ly.name)
        self.produce(ly.output, self.activation(ly, y, ly.name), lp.output)

    # ---- attributes ---------------------------------------------------------------------
    @staticmethod
    def pads(padding) -> list:
        p = [int(v) for v in padding]
        if len(p) == 1:
            p = p * 4
        elif len(p) == 2:
            p = p * 2
        return p  # Relax's (top, left, bottom, right) is ONNX's (x1_begin, x2_begin, x1_end, x2_end)

    def conv_attrs(self, call) -> dict:
        a = call.attrs
        if a.data_layout != "NCHW" or a.kernel_layout != "OIHW" or a.out_layout not in ("NCHW", ""):
            raise InputError(f"a conv2d of layout {a.data_layout}/{a.kernel_layout} cannot be exported to ONNX "
                             "yet (NCHW / OIHW only)")
        kh, kw = static_shape(call.args[1].ty)[2:]
        return dict(kernel_shape=[kh, kw], strides=[int(v) for v in a.strides], pads=self.pads(a.padding),
                    dilations=[int(v) for v in a.dilation], group=int(a.groups))

    def pool_attrs(self, call, kind: str) -> dict:
        a = call.attrs
        if a.layout != "NCHW" or a.out_layout not in ("NCHW", ""):
            raise InputError(f"a {kind} pool of layout {a.layout} cannot be exported to ONNX yet (NCHW only)")
        attrs = dict(kernel_shape=[int(v) for v in a.pool_size], strides=[int(v) for v in a.strides],
                     pads=self.pads(a.padding), ceil_mode=int(bool(a.ceil_mode)))
        dilation = [int(v) for v in a.dilation]
        if kind == "max":
            attrs["dilations"] = dilation
        else:
            attrs["count_include_pad"] = int(bool(a.count_include_pad))
            if dilation != [1, 1]:
                if self.opset < 19:
                    raise InputError("a dilated average pool needs opset 19 or later (AveragePool's dilations); "
                                     "export with --opset 19")
                attrs["dilations"] = dilation
        return attrs

    def batch_norm(self, call, x: str, hint: str) -> str:
        a = call.attrs
        if a.training or int(a.axis) != 1:
            raise InputError("a batch_norm in training mode or over another axis than 1 cannot be exported to "
                             "ONNX yet")
        gamma, beta, mean, var = (c.value.numpy().astype(np.float32) for c in call.args[1:5])
        gamma = gamma if a.scale else np.ones_like(gamma)
        beta = beta if a.center else np.zeros_like(beta)
        args = [self.const(v, f"{hint}.{n}") for v, n in ((gamma, "gamma"), (beta, "beta"), (mean, "mean"),
                                                          (var, "var"))]
        return self.node("BatchNormalization", [x, *args], hint, epsilon=float(a.epsilon))

    # ---- float ops ----------------------------------------------------------------------
    def emit_float(self, b) -> None:
        value, var = b.value, b.var
        op = op_name(value)
        if op not in EXPORTABLE_OPS:
            raise InputError(f"this model cannot be exported to ONNX yet: the exporter has no ONNX form for {op}")
        if isinstance(value, relax.Call):
            self.float_ops[op] = self.float_ops.get(op, 0) + 1
        if op == "Tuple":
            self.tuples[var] = [self.float_of(f) for f in value.fields]
        elif op == "TupleGetItem":
            if value.tuple_value in self.pending:
                self.emit_float(self.pending.pop(value.tuple_value))
            items = self.tuples[value.tuple_value]
            if items[value.index] is None:
                raise InputError("a batch_norm's running statistics are read: this model cannot be exported to "
                                 "ONNX yet")
            self.fname[var] = items[value.index]
        else:
            out = self.op(value, var)
            if isinstance(out, list):
                self.tuples[var] = out
            else:
                self.fname[var] = out
        self.track(b)

    def op(self, call, var):
        """The ONNX form of a float op: an elementwise op's node of the same operands
        (``elementwise_ops.OPS``), else the composite ``op_<name>`` writes."""
        name = op_name(call)
        row = OPS.get(name)
        if row is not None and row.onnx is not None:
            return self.node(row.onnx, [self.float_of(a) for a in call.args[:row.operands]], var.name)
        return getattr(self, "op_" + name.removeprefix("relax.").replace(".", "_"))(call, var)

    def op_nn_conv2d(self, call, var):
        return self.node("Conv", [self.float_of(a) for a in call.args[:2]], var.name, **self.conv_attrs(call))

    def op_clip(self, call, var):
        lo, hi = (float(getattr(a, "value", a)) for a in call.args[1:3])
        return self.clip(self.float_of(call.args[0]), lo, hi, var.name)

    def op_nn_silu(self, call, var):
        x = self.float_of(call.args[0])
        return self.node("Mul", [x, self.node("Sigmoid", [x], f"{var.name}_sigmoid")], var.name)

    def op_nn_gelu(self, call, var):
        # 0.5 x (1 + erf(x / sqrt 2)): ONNX's Gelu is opset 20; ONNX Runtime and TensorRT fuse this form.
        x = self.float_of(call.args[0])
        h = var.name
        e = self.node("Erf", [self.node("Div", [x, self.const(np.float32(math.sqrt(2.0)), f"{h}_sqrt2")],
                                        f"{h}_div")], f"{h}_erf")
        one = self.node("Add", [e, self.const(np.float32(1.0), f"{h}_one")], f"{h}_add")
        return self.node("Mul", [self.node("Mul", [x, one], f"{h}_mul"), self.const(np.float32(0.5), f"{h}_half")], h)

    def op_nn_gelu_tanh(self, call, var):
        # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): ONNX's Gelu(approximate="tanh") is opset 20
        x = self.float_of(call.args[0])
        h = var.name
        cube = self.node("Mul", [self.node("Mul", [x, x], f"{h}_sq"), x], f"{h}_cube")
        inner = self.node("Add", [x, self.node("Mul", [cube, self.const(np.float32(0.044715), f"{h}_c")],
                                                f"{h}_cube_c")], f"{h}_inner")
        t = self.node("Tanh", [self.node("Mul", [inner, self.const(np.float32(math.sqrt(2.0 / math.pi)), f"{h}_k")],
                                         f"{h}_scaled")], f"{h}_tanh")
        one = self.node("Add", [t, self.const(np.float32(1.0), f"{h}_one")], f"{h}_add")
        return self.node("Mul", [self.node("Mul", [x, one], f"{h}_mul"), self.const(np.float32(0.5), f"{h}_half")], h)

    def op_nn_softmax(self, call, var):
        return self.node("Softmax", [self.float_of(call.args[0])], var.name, axis=int(call.attrs.axis))

    def op_reshape(self, call, var):
        x = call.args[0]
        target = list(static_shape(var.ty))
        if self.dynamic and self.static_reason is None:
            target = self.batch_reshape(x, target) or target
        return self.node("Reshape", [self.float_of(x), self.const(np.array(target, np.int64), f"{var.name}_shape")],
                         var.name)

    def op_permute_dims(self, call, var):
        rank = len(static_shape(call.args[0].ty))
        axes = list(range(rank))[::-1] if call.attrs.axes is None else [int(a) % rank for a in call.attrs.axes]
        return self.node("Transpose", [self.float_of(call.args[0])], var.name, perm=axes)

    def op_concat(self, call, var):
        fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
        xs = [self.float_of(f) for f in fields] if fields is not None else list(self.tuples[call.args[0]])
        return self.node("Concat", xs, var.name, axis=int(call.attrs.axis))

    def op_split(self, call, var):
        x = call.args[0]
        shape = static_shape(x.ty)
        axis = int(call.attrs.axis) % len(shape)
        ios = call.attrs.indices_or_sections
        if isinstance(ios, (list, tuple)) or hasattr(ios, "__len__"):
            cuts = [0] + [int(i) for i in ios] + [shape[axis]]
            sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        else:
            n = int(ios)
            sizes = [shape[axis] // n] * n
        split = self.const(np.array(sizes, np.int64), f"{var.name}_sizes")
        outs = self.node("Split", [self.float_of(x), split], var.name, outputs=len(sizes), axis=axis)
        return list(outs) if isinstance(outs, list) else [outs]

    def op_matmul(self, call, var):
        return self.node("MatMul", [self.float_of(a) for a in call.args], var.name)

    def op_mean(self, call, var):
        rank = len(static_shape(call.args[0].ty))
        axes = list(range(rank)) if call.attrs.axis is None else sorted(int(a) % rank for a in call.attrs.axis)
        keep = int(bool(call.attrs.keepdims))
        x = self.float_of(call.args[0])
        if self.opset >= 18:  # axes became an input
            return self.node("ReduceMean", [x, self.const(np.array(axes, np.int64), f"{var.name}_axes")], var.name,
                             keepdims=keep)
        return self.node("ReduceMean", [x], var.name, axes=axes, keepdims=keep)

    def op_nn_batch_norm(self, call, var):
        return [self.batch_norm(call, self.float_of(call.args[0]), var.name), None, None]

    def op_nn_layer_norm(self, call, var):
        return self.layer_norm(call, self.float_of(call.args[0]), var.name)

    def layer_norm(self, call, x: str, name: str) -> str:
        """ONNX's LayerNormalization normalizes the axes from ``axis`` to the last: a LayerNorm over
        the channels of NCHW (``transform/channels_first.py``) goes there between two Transposes."""
        a = call.attrs
        shape = static_shape(call.args[0].ty)
        rank = len(shape)
        axes = sorted(int(v) % rank for v in a.axes)
        channels_first = rank == 4 and axes == [1]
        if axes != list(range(axes[0], rank)) and not channels_first:
            raise InputError(f"a layer_norm over axes {list(a.axes)} (not the last ones) cannot be exported to "
                             "ONNX yet")
        norm_shape = (shape[1],) if channels_first else shape[axes[0]:]
        gamma = call.args[1].value.numpy() if a.scale else np.ones(norm_shape, np.float32)
        beta = call.args[2].value.numpy() if a.center else np.zeros(norm_shape, np.float32)
        assert gamma.size == beta.size == int(np.prod(norm_shape))
        if channels_first:
            x = self.node("Transpose", [x], f"{name}_nhwc", perm=[0, 2, 3, 1])
        y = self.node("LayerNormalization", [x, self.const(gamma.reshape(norm_shape), f"{name}.gamma"),
                                             self.const(beta.reshape(norm_shape), f"{name}.beta")],
                      name if not channels_first else f"{name}_ln", axis=-1 if channels_first else axes[0],
                      epsilon=float(a.epsilon))
        return self.node("Transpose", [y], name, perm=[0, 3, 1, 2]) if channels_first else y

    def op_nn_max_pool2d(self, call, var):
        return self.node("MaxPool", [self.float_of(call.args[0])], var.name, **self.pool_attrs(call, "max"))

    def op_nn_avg_pool2d(self, call, var):
        return self.node("AveragePool", [self.float_of(call.args[0])], var.name, **self.pool_attrs(call, "avg"))

    def op_nn_adaptive_avg_pool2d(self, call, var):
        a = call.attrs
        if a.layout != "NCHW" or a.out_layout not in ("NCHW", ""):
            raise InputError(f"an adaptive average pool of layout {a.layout} cannot be exported to ONNX yet")
        x = self.float_of(call.args[0])
        h, w = static_shape(call.args[0].ty)[2:]
        oh, ow = static_shape(var.ty)[2:]
        if (oh, ow) == (1, 1):
            return self.node("GlobalAveragePool", [x], var.name)
        if h % oh == 0 and w % ow == 0:
            kh, kw = h // oh, w // ow
            return self.node("AveragePool", [x], var.name, kernel_shape=[kh, kw], strides=[kh, kw])
        # Bins of unequal size, or more bins than pixels (VGG's 7x7 over a 2x2 map at 64 px): the
        # pool is linear and separable, A_h @ x @ A_w^T with PyTorch's bins -- two MatMuls, exact.
        rows = self.node("MatMul", [x, self.const(_adaptive_matrix(w, ow).T.copy(), f"{var.name}_cols")],
                         f"{var.name}_w")
        return self.node("MatMul", [self.const(_adaptive_matrix(h, oh), f"{var.name}_rows"), rows], var.name)

    # ---- dynamic batch ------------------------------------------------------------------
    def no_dynamic(self, why: str) -> None:
        if self.static_reason is None:
            self.static_reason = why

    def batch_reshape(self, x, target: list) -> list | None:
        """``target`` with its batch dimension symbolic (0: as the input's, -1: inferred), if the
        reshape keeps each sample's elements in dim 0 (flatten; ConvNeXt's tokens [N*H*W, C])."""
        where = self.batch.get(x)
        in_shape = static_shape(x.ty)
        if where is None or where[0] != 0:
            return None
        per_sample = int(np.prod(in_shape)) // self.input_shape[0]
        rest = int(np.prod(target[1:]))
        if rest == 0 or per_sample % rest or target[0] != self.input_shape[0] * (per_sample // rest):
            return None
        return [0 if per_sample // rest == where[1] else -1] + target[1:]

    def track(self, b) -> None:
        """Where the batch dimension of ``b.var`` is: ``(axis, k)``, that axis is batch * k."""
        if not self.dynamic or self.static_reason is not None:
            return
        value, var = b.value, b.var
        op = op_name(value)
        vin = [a for a in (value.args if isinstance(value, relax.Call) else []) if isinstance(a, relax.Var)]
        first = self.batch.get(vin[0]) if vin else None
        rank = len(static_shape(var.ty) or ()) if isinstance(var.ty, relax.TensorType) else None
        where = first
        if op == "Tuple":
            fields = [self.batch.get(f) for f in value.fields if isinstance(f, relax.Var)]
            self.batch[("tuple", var)] = fields[0] if fields and all(f == fields[0] for f in fields) else None
            return
        if op == "TupleGetItem":
            src = value.tuple_value
            where = self.batch.get(("tuple", src), self.batch.get(src))
        elif op == "relax.concat":
            if isinstance(value.args[0], relax.Tuple):
                fields = [self.batch.get(f) for f in value.args[0].fields if isinstance(f, relax.Var)]
                where = fields[0] if fields and all(f == fields[0] for f in fields) else None
            else:
                where = self.batch.get(("tuple", value.args[0]))
            if where is not None and int(value.attrs.axis) % rank == where[0]:
                return self.no_dynamic(f"{var.name} concatenates along the batch dimension")
        elif op == "relax.split":
            if first is not None and int(value.attrs.axis) % len(static_shape(vin[0].ty)) == first[0]:
                return self.no_dynamic(f"{var.name} splits the batch dimension")
            self.batch[("tuple", var)] = first
            return
        elif op == "relax.reshape":
            target = self.batch_reshape(vin[0], list(static_shape(var.ty)))
            if target is None:
                return self.no_dynamic(f"a reshape {static_shape(vin[0].ty)} -> {static_shape(var.ty)} moves the "
                                       "batch dimension")
            in_rest = int(np.prod(static_shape(vin[0].ty))) // self.input_shape[0]
            where = (0, in_rest // int(np.prod(target[1:])))
        elif op == "relax.permute_dims" and first is not None:
            r = len(static_shape(vin[0].ty))
            axes = list(range(r))[::-1] if value.attrs.axes is None else [int(a) % r for a in value.attrs.axes]
            where = (axes.index(first[0]), first[1])
        elif op == "relax.mean" and first is not None:
            r = len(static_shape(vin[0].ty))
            axes = list(range(r)) if value.attrs.axis is None else [int(a) % r for a in value.attrs.axis]
            if first[0] in axes:
                return self.no_dynamic(f"{var.name} averages over the batch dimension")
            where = first if value.attrs.keepdims else (first[0] - sum(a < first[0] for a in axes), first[1])
        elif op == "relax.nn.layer_norm" and first is not None:
            r = len(static_shape(vin[0].ty))
            if first[0] in [int(a) % r for a in value.attrs.axes]:
                return self.no_dynamic(f"{var.name} normalizes over the batch dimension")
        elif op == "relax.nn.softmax" and first is not None:
            if int(value.attrs.axis) % rank == first[0]:
                return self.no_dynamic(f"{var.name} is a softmax over the batch dimension")
        elif op == "relax.matmul" and first is not None:
            a, w = value.args
            if not (isinstance(a, relax.Var) and first[0] < len(static_shape(a.ty)) - 1
                    and not isinstance(w, relax.Var) and len(static_shape(w.ty)) == 2):
                return self.no_dynamic(f"{var.name} is a matmul whose batch dimension is not a row of x @ W")
        elif op in ("relax.add", "relax.subtract", "relax.multiply", "relax.divide"):
            wheres = {self.batch.get(v) for v in vin} - {None}
            if len(wheres) > 1:
                return self.no_dynamic(f"{var.name} combines tensors whose batch dimensions differ")
            where = next(iter(wheres), None)
            for arg in value.args:  # a constant must broadcast along the batch dimension
                shape = static_shape(arg.ty) if not isinstance(arg, relax.Var) else None
                if where is not None and shape is not None:
                    pos = where[0] - (rank - len(shape))
                    if pos >= 0 and shape[pos] != 1:
                        return self.no_dynamic(f"{var.name} reads a constant along the batch dimension")
        elif op in ("relax.nn.conv2d", "relax.nn.max_pool2d", "relax.nn.avg_pool2d",
                    "relax.nn.adaptive_avg_pool2d", "relax.nn.batch_norm") and first is not None and first[0] != 0:
            return self.no_dynamic(f"{var.name}'s NCHW input has its batch dimension elsewhere")
        if op == "relax.nn.batch_norm":
            self.batch[("tuple", var)] = first
            return
        self.batch[var] = where


def _adaptive_matrix(size: int, out: int) -> np.ndarray:
    """[out, size]: row i averages PyTorch's adaptive bin i, [floor(i*size/out), ceil((i+1)*size/out))."""
    m = np.zeros((out, size), np.float32)
    for i in range(out):
        lo, hi = (i * size) // out, -(-((i + 1) * size) // out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m
