"""export_onnx: the calibrated int8 model as ONNX, with explicit QuantizeLinear / DequantizeLinear
pairs carrying this project's own scales -- the "QDQ" form TensorRT and ONNX Runtime consume.

    torch model --quantize_module (quantize.py, llvm target)--> float graph + ranges + which layers are int8
      --one ONNX node (or a few) per Relax binding--> model.onnx

What the file holds mirrors the project's int8 model (``transform/quantize_int8.py``) tensor by tensor:

- every activation that is int8 there is quantized once, by one ``QuantizeLinear`` (int8, zero point
  0, scale ``max(amax, 1e-30) / 127``; zero point -128 and ``amax / 255`` for the tensors the
  library keeps unsigned, ``QuantConfig.unsigned_activations``) where it is made (or where its first int8 reader needs it,
  for a float tensor), and each node that reads it has its own ``DequantizeLinear`` of it;
- the weights of int8 conv / linear layers are int8 initializers (``quantize_weight_per_channel``:
  the project's own integers) dequantized per output channel (axis 0);
- a conv's bias stays float: TensorRT's parser refuses a DequantizeLinear of INT32 ("only
  activation types allowed as input to this layer", NVIDIA/TensorRT#3360, onnx/onnx-tensorrt#850),
  and ONNX Runtime quantizes a float bias itself to the same ``round(b / (s_x * s_w))`` the project
  uses (its results are identical with either form, measured on resnet18);
- a layer absorbs its bias and ReLU / clip (``graph.Layer.vars``): ``DQ -> Conv [-> Relu] -> Q``,
  TensorRT's explicit-quantization pattern for an int8 conv.  ONNX Runtime (CPU) makes a
  ``QLinearConv`` of the convs with no activation; with a ReLU between it keeps a float
  ``FusedConv`` (it folds a ReLU into ``QuantizeLinear`` only at zero point -128: the unsigned
  activations'), and on x86 it wants ``session.qdqisint8allowed=1`` (see README);
- a lookup-table activation (``lut``: SiLU, hardswish... after an int8 layer) is its float ops
  between a DequantizeLinear and a QuantizeLinear at its output's scale, what the table tabulates;
- everything the project runs in float (skipped layers, layers without an int8 kernel,
  LayerNorm, the classifier's flatten...) is float here too.

The two differ only in rounding: ONNX rounds half to even and requantizes in float, the project
rounds half up in fixed point; and ONNX's int8 saturates at -128 where the project clamps at -127
(only values beyond the calibrated range, which are clipped either way, can tell).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from . import model_check
from .config import QuantConfig
from .errors import InputError
from .fileio import atomic_path, check_output_file
from .graph import static_shape
from .observers import quantize_weight_per_channel
from .progress import as_phases
from .ranges import Calibrate, LearnedRanges
from .schedules.requantize import UNSIGNED_ZERO
from .transform.quantize_int8 import activation_scale

# Opsets this exporter writes: 17 has LayerNormalization and per-channel QDQ; from 18 ReduceMean
# takes its axes as an input; 21 is the newest whose ops here TensorRT 10 and ONNX Runtime both read.
MIN_OPSET, MAX_OPSET = 17, 21
BATCH = "batch"  # the dim_param of the batch dimension of a dynamic-batch file

# The Relax ops of a simplified float main that have an ONNX form here (the 16 torchvision
# classifiers of the zoo use these; subtract, silu and softmax come free).
EXPORTABLE_OPS = (
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.nn.conv2d", "relax.nn.relu",
    "relax.clip", "relax.sigmoid", "relax.nn.silu", "relax.nn.gelu", "relax.nn.softmax", "relax.reshape",
    "relax.permute_dims", "relax.concat", "relax.split", "relax.matmul", "relax.mean", "relax.nn.batch_norm",
    "relax.nn.layer_norm", "relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d",
    "Tuple", "TupleGetItem",
)


@dataclass
class ExportResult:
    """``path``: the file written; ``amax``: the range of every point (``{point: amax}``, as a
    build's ``meta["amax"]``: ``GivenRanges(amax)`` builds the TVM library of the same model);
    ``summary``: what the file holds (``qdq_activations``: int8 activations, one QuantizeLinear
    each; ``int8_weights``: int8 weight initializers; ``int8_layers`` of ``layers``;
    ``float_layers``; ``float_ops``: the ops left in float, by Relax name, as a build report's;
    ``opset``; ``dynamic_batch`` and, where the batch had to stay static, ``static_batch_reason``;
    ``ranges``: where the ranges came from, as a build report's)."""

    path: str
    amax: dict
    summary: dict = field(default_factory=dict)


def _op_name(expr) -> str:
    """The Relax op of a binding's value (``relax.nn.conv2d``), or ``Tuple`` / ``TupleGetItem``."""
    if isinstance(expr, relax.Call):
        return str(getattr(expr.op, "name", expr.op))
    return type(expr).__name__


def check_exportable(graph) -> None:
    """Refuse a graph with an op this exporter has no ONNX form for, naming it.

    Raises:
        InputError: naming the op(s) and saying the model cannot be exported yet.
    """
    unknown = sorted({_op_name(b.value) for b in graph.bindings} - set(EXPORTABLE_OPS))
    if unknown:
        raise InputError(f"this model cannot be exported to ONNX yet: the exporter has no ONNX form for "
                         f"{', '.join(unknown)} (tvm_qconv/onnx_export.py lists the ops it has); build a "
                         "TVM library instead (deploy.py build)")


@dataclass(frozen=True)
class _ExportableFirst:
    """A range source that first checks every op can be exported, then resolves as ``inner``:
    ``quantize_module`` hands it the float graph before anything is calibrated, so an
    unsupported op is refused in seconds, not after the calibration it would waste."""

    inner: object

    def resolve(self, ctx):
        check_exportable(ctx.graph)
        return self.inner.resolve(ctx)


def export_onnx(model, out_path: str, *, input_shape=(1, 3, 224, 224), config: QuantConfig = QuantConfig(),
                ranges=None, name: str | None = None, dynamic_batch: bool = True, opset: int = 17,
                progress=True, require_int8: bool = False) -> ExportResult:
    """Write the calibrated int8 model as ONNX with QuantizeLinear / DequantizeLinear pairs.

    Args:
        model: a torchvision classifier name (random init) or a float ``torch.nn.Module``, as
            :func:`tvm_qconv.build.compile_model` takes.
        out_path: the ``.onnx`` file to write (atomically: the old file or the whole new one).
        input_shape: (N, C, H, W) to trace and calibrate at.
        config: the quantization scheme (skip list, observer, ``quantize_dense``).
        ranges: a range source (``Calibrate``, ``GivenRanges``, ``LearnedRanges``); default:
            calibrate on scikit-image's photos.
        name: the model's name in the file's metadata (default: ``model`` if a name, else its class).
        dynamic_batch: name the batch dimension (``batch``) so the file runs at any batch; where
            a reshape moves the batch dimension the file keeps the static shape (the summary says why).
        opset: the ONNX opset, 17-21.
        progress: print each phase as it starts.
        require_int8: refuse a skip list that leaves no layer in int8 (``deploy.py export-onnx``).

    Returns:
        :class:`ExportResult`.

    Raises:
        InputError: an op with no ONNX form here, a path that cannot be written, a bad opset, or
            any bad input ``quantize_module`` refuses.

    Example:
        >>> export_onnx("resnet18", "build/resnet18.onnx", input_shape=(1, 3, 224, 224))
    """
    import onnx

    from .frontend import load_model
    from .quantize import quantize_module
    from .target import TargetInfo, make_target

    check_output_file(out_path, "ONNX file")
    if len(input_shape) != 4 or min(int(d) for d in input_shape) < 1:
        raise InputError(f"input shape {tuple(input_shape)}: give (batch, channels, height, width), each >= 1")
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise InputError(f"opset {opset}: the exporter writes opsets {MIN_OPSET} to {MAX_OPSET}; choose one of them")
    if isinstance(model, str):
        name, model = name or model, load_model(model)
    name = name or type(model).__name__.lower()
    input_shape = tuple(int(d) for d in input_shape)
    probe = model_check.probe(model, input_shape, name)
    model_check.check_memory(probe, input_shape, name)
    phases = as_phases(progress, "export-onnx")
    source = ranges if ranges is not None else Calibrate()
    # Exactly what a CPU build does: the same graph, ranges and int8 / float decision per layer.
    with model_check.single_output(model, probe):
        q = quantize_module(model, input_shape, TargetInfo.from_target(make_target("llvm")), config=config,
                            ranges=_ExportableFirst(source), progress=phases, require_int8=require_int8)
    phases.say(f"write: ONNX opset {opset} with QuantizeLinear / DequantizeLinear")
    emitter = _Emitter(q, input_shape, int(opset), dynamic_batch)
    graph = emitter.run()
    if emitter.static_reason is not None and dynamic_batch:
        # A reshape that moves the batch dimension: the whole file keeps the static shape.
        reason = emitter.static_reason
        emitter = _Emitter(q, input_shape, int(opset), False)
        graph = emitter.run()
        emitter.static_reason = reason
    opsets = [onnx.helper.make_opsetid("", int(opset))]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, producer_name="tvm_qconv",
                                   producer_version=_version(),
                                   # the oldest IR version of the opset: the widest choice of readers
                                   ir_version=onnx.helper.find_min_ir_version_for(opsets))
    proto.doc_string = (f"{name}: int8 (per-channel weights, per-tensor activations) as QuantizeLinear / "
                        "DequantizeLinear pairs, exported by tvm_qconv")
    summary = dict(emitter.summary(), ranges=q.report.get("ranges", {}))
    meta = {"producer": "tvm_qconv", "model": name, "scheme": json.dumps(config.to_dict(), sort_keys=True),
            "ranges": json.dumps(q.report.get("ranges", {}), sort_keys=True, default=str),
            "input_shape": json.dumps(list(input_shape)), "dynamic_batch": json.dumps(summary["dynamic_batch"]),
            # the range of every point: GivenRanges(json.loads(...)) rebuilds the same model as a TVM library
            "amax": json.dumps({k: float(v) for k, v in q.amax.items()}, sort_keys=True)}
    onnx.helper.set_model_props(proto, meta)
    onnx.checker.check_model(proto, full_check=True)  # before anything is written: a bad proto is never a file
    with atomic_path(out_path, suffix=".onnx") as tmp:
        onnx.save(proto, tmp)
    return ExportResult(out_path, dict(q.amax), summary)


def export_checkpoint(checkpoint: str, out_path: str, *, image_size: int | None = None, batch: int = 1,
                      config: QuantConfig = QuantConfig(), dynamic_batch: bool = True, opset: int = 17,
                      progress: bool = True) -> ExportResult:
    """:func:`export_onnx` of a QAT checkpoint (``train.py --qat --out CKPT``), as
    :func:`tvm_qconv.build.compile_checkpoint` builds it: the float architecture it was trained
    as, its weights, and its learned ranges (``LearnedRanges``; nothing is calibrated).

    Raises:
        InputError: not a QAT checkpoint (see ``load_float_model``), or another image size than
            the one it was trained at.
    """
    from .training.checkpoint import load_float_model

    model, ckpt, train_config = load_float_model(checkpoint, require_qat=True)
    size = train_config.image_size
    if image_size is not None and image_size != size:
        raise InputError(f"image size {image_size}: {checkpoint} was trained at {size}x{size}, and its "
                         "learned ranges (and the classifier's width) hold at that size only; export at its size")
    return export_onnx(model, out_path, input_shape=(batch, 3, size, size), config=config,
                       ranges=LearnedRanges(ckpt["amax"], checkpoint), name=train_config.model,
                       dynamic_batch=dynamic_batch, opset=opset, progress=progress)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("tvm_qconv")
    except Exception:  # a source tree that is not installed
        return "source"


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


class _Emitter:
    """One pass over the float graph's bindings, mirroring ``quantize_int8._Rewriter``: a tensor's
    int8 version is made where its first int8 consumer needs it (or by its int8 producer), float
    consumers read the float tensor (an int8 producer's dequantized output)."""

    def __init__(self, q, input_shape: tuple, opset: int, dynamic_batch: bool):
        self.g, self.amax, self.opset = q.graph, q.amax, opset
        self.input_shape, self.dynamic = input_shape, dynamic_batch
        rows = q.report["layers"]
        if [r["layer"] for r in rows] != [ly.name for ly in self.g.layers]:
            raise RuntimeError("the quantize pass's report does not list the analysis's layers in order")
        # The truth of which layers are int8: the quantize pass's own rows (skip list, quantize_dense,
        # pools of a float input, ops without a kernel on llvm all come with them).
        self.int8 = {ly.vars[0]: row["dtype"] == "int8" for ly, row in zip(self.g.layers, rows)}
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
        # the library's unsigned tensors (zero point -128, scale amax / 255): zero_points.py
        self.unsigned = set(q.report.get("unsigned", []))
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
        from onnx import numpy_helper
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs: list, hint: str, outputs: int = 1, **attrs):
        import onnx
        outs = [self.fresh(hint if outputs == 1 else f"{hint}_{i}") for i in range(outputs)]
        self.nodes.append(onnx.helper.make_node(op, list(inputs), outs, name=self.fresh(f"{op}_{hint}"), **attrs))
        return outs[0] if outputs == 1 else outs

    def zero_point(self, zero: int = 0) -> str:
        if zero not in self.zeros:
            self.zeros[zero] = self.const(np.int8(zero), "zero_point_int8" if zero == 0 else f"zero_point_int8_{-zero}")
        return self.zeros[zero]

    def zero(self, var) -> int:
        return UNSIGNED_ZERO if self.g.points.get(var) in self.unsigned else 0

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

    def scale(self, var) -> float:
        """The scale of a point, the library's (``activation_scale``)."""
        return activation_scale(self.amax[self.g.points[var]], self.g.points[var] in self.unsigned)

    def float_of(self, expr) -> str:
        if isinstance(expr, tvm.ir.expr.GenericConst):
            return self.const(expr.value.numpy(), "const")
        if expr in self.pending:
            self.emit_float(self.pending.pop(expr))
        if expr in self.fname:
            f = self.fname[expr]
            return self.dq(f) if isinstance(f, _QTensor) else f
        raise RuntimeError(f"{expr} is read before it is defined")

    def int8_of(self, var) -> str:
        """``var``'s int8 version, dequantized for one reader: as produced, or quantized from float
        at its point's scale (once; later int8 readers share the QuantizeLinear)."""
        if var not in self.qver:
            self.qver[var] = self.quantize(self.float_of(var), self.scale(var), var.name, self.zero(var))
        return self.dq(self.qver[var])

    def produce(self, var, out: str, scale: float, zero: int | None = None) -> None:
        """An int8 layer's output: requantized at ``scale`` and ``zero`` (default: its point's);
        every consumer reads the int8 tensor."""
        zero = self.zero(var) if zero is None else zero
        self.qver[var] = self.fname[var] = self.quantize(out, scale, var.name, zero)

    # ---- the walk -----------------------------------------------------------------------
    def run(self):
        import onnx
        func = self.g.func
        binding = {b.var: b for b in self.g.bindings}
        (param,) = func.params
        self.fname[param] = "input"
        self.used.add("input")
        self.batch[param] = (0, 1)
        for b in self.g.bindings:
            ly = self.g.layer_of_var.get(b.var)
            if ly is not None:
                if self.int8[b.var]:
                    getattr(self, f"layer_{ly.kind}")(ly)
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
                    int8_layers=sum(self.int8.values()), layers=len(self.int8), float_layers=list(self.float_layers),
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

    def weight(self, w: np.ndarray, hint: str) -> tuple[str, np.ndarray]:
        """The project's int8 weight, dequantized per output channel (axis 0)."""
        qw, s_w = quantize_weight_per_channel(w)
        s = self.const(s_w.astype(np.float32), f"{hint}_scale")
        zp = self.const(np.zeros(len(s_w), np.int8), f"{hint}_zero_point")
        self.int8_weights += 1
        return self.node("DequantizeLinear", [self.const(qw, f"{hint}_int8"), s, zp], f"{hint}_dq", axis=0), s_w

    def layer_conv2d(self, ly) -> None:
        x = self.int8_of(ly.inputs[0])
        s_x = self.qver[ly.inputs[0]].scale
        hint = ly.name
        w, s_w = self.weight(ly.weight, f"{hint}.weight")
        inputs = [x, w]
        if ly.bias is not None:  # float: the module docstring says why not the int32 bias
            inputs.append(self.const(ly.bias.astype(np.float32), f"{hint}.bias"))
        y = self.node("Conv", inputs, hint, **self.conv_attrs(ly.call))
        self.produce(ly.output, self.activation(ly, y, hint), self.scale(ly.output))

    def layer_dense(self, ly) -> None:
        # The project quantizes a linear layer's float input at its point's scale (quantize_rows),
        # whatever made it: reuse an int8 version only where it is that same quantization.
        var = ly.inputs[0]
        s_x, have, made = self.scale(var), self.qver.get(var), self.fname.get(var)
        if have is not None and have.scale == s_x and (made is have or made == have.source):
            x = self.dq(have)
        else:
            x = self.dq(self.quantize(self.float_of(var), s_x, f"{ly.name}.input", self.zero(var)))
        w, _ = self.weight(ly.weight, f"{ly.name}.weight")  # [O, K]: Gemm's transB
        inputs = [x, w] + ([self.const(ly.bias.astype(np.float32), f"{ly.name}.bias")] if ly.bias is not None else [])
        y = self.node("Gemm", inputs, ly.name, transB=1)
        self.fname[ly.output] = self.activation(ly, y, ly.name)  # float out: the project's dense epilogue

    def layer_add(self, ly) -> None:
        y = self.node("Add", [self.int8_of(v) for v in ly.inputs], ly.name)
        self.produce(ly.output, self.activation(ly, y, ly.name), self.scale(ly.output))

    def layer_concat(self, ly) -> None:
        xs = [self.int8_of(v) for v in ly.inputs]
        y = self.node("Concat", xs, ly.name, axis=1)
        self.produce(ly.output, y, self.scale(ly.output))

    def layer_channels(self, ly) -> None:
        x = self.qver[ly.inputs[0]]
        index = self.const(np.array(ly.channel_index, np.int64), ly.name + ".index")
        y = self.node("Gather", [self.dq(x), index], ly.name, axis=1)
        # values moved, not changed: requantized at the input's scale and zero point, exact (as the max-pool)
        self.produce(ly.output, y, x.scale, x.zero)

    def layer_lut(self, ly) -> None:
        # The table's definition: the region's float ops between the input's DequantizeLinear and a
        # QuantizeLinear at the output's scale (TensorRT and ONNX Runtime fuse such pointwise chains).
        value = {b.var: b.value for b in self.g.bindings}
        for v in ly.vars:
            self.fname[v] = getattr(self, "op_" + _op_name(value[v]).removeprefix("relax.").replace(".", "_"))(value[v], v)
        self.produce(ly.output, self.fname[ly.output], self.scale(ly.output))

    def layer_max_pool2d(self, ly) -> None:
        x = self.qver[ly.inputs[0]]
        y = self.node("MaxPool", [self.dq(x)], ly.name, **self.pool_attrs(ly.call, "max"))
        # No point of its own: the max of int8 values is int8 at the input's scale.  The pair is
        # numerically a no-op; it keeps the next conv's input a DequantizeLinear, so ONNX Runtime
        # and TensorRT run that conv in int8.
        self.produce(ly.output, y, x.scale, x.zero)

    def layer_avg_pool2d(self, ly) -> None:
        x = self.qver[ly.inputs[0]]
        if _op_name(ly.call) == "relax.mean":       # a classifier's global pool (graph.py)
            y = self.node("GlobalAveragePool", [self.dq(x)], ly.name)
        else:
            y = self.node("AveragePool", [self.dq(x)], ly.name, **self.pool_attrs(ly.call, "avg"))
        self.produce(ly.output, y, self.scale(ly.output))

    def layer_affine(self, ly) -> None:
        x = self.qver[ly.inputs[0]]
        y = self.batch_norm(ly.call, self.dq(x), ly.name)
        self.produce(ly.output, self.activation(ly, y, ly.name), self.scale(ly.output))

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
                    raise InputError(f"a dilated average pool needs opset 19 or later (AveragePool's dilations); "
                                     f"export with --opset 19")
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
        op = _op_name(value)
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
            out = getattr(self, "op_" + op.removeprefix("relax.").replace(".", "_"))(value, var)
            if isinstance(out, list):
                self.tuples[var] = out
            else:
                self.fname[var] = out
        self.track(b)

    def op_add(self, call, var):
        return self.node("Add", [self.float_of(a) for a in call.args], var.name)

    def op_subtract(self, call, var):
        return self.node("Sub", [self.float_of(a) for a in call.args], var.name)

    def op_multiply(self, call, var):
        return self.node("Mul", [self.float_of(a) for a in call.args], var.name)

    def op_divide(self, call, var):
        return self.node("Div", [self.float_of(a) for a in call.args], var.name)

    def op_nn_conv2d(self, call, var):
        return self.node("Conv", [self.float_of(a) for a in call.args[:2]], var.name, **self.conv_attrs(call))

    def op_nn_relu(self, call, var):
        return self.node("Relu", [self.float_of(call.args[0])], var.name)

    def op_clip(self, call, var):
        lo, hi = (float(getattr(a, "value", a)) for a in call.args[1:3])
        return self.clip(self.float_of(call.args[0]), lo, hi, var.name)

    def op_sigmoid(self, call, var):
        return self.node("Sigmoid", [self.float_of(call.args[0])], var.name)

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
        a = call.attrs
        rank = len(static_shape(call.args[0].ty))
        axes = sorted(int(v) % rank for v in a.axes)
        if axes != list(range(axes[0], rank)):
            raise InputError(f"a layer_norm over axes {list(a.axes)} (not the last ones) cannot be exported to "
                             "ONNX yet")
        width = int(np.prod(static_shape(call.args[0].ty)[axes[0]:]))
        norm_shape = static_shape(call.args[0].ty)[axes[0]:]
        gamma = call.args[1].value.numpy() if a.scale else np.ones(norm_shape, np.float32)
        beta = call.args[2].value.numpy() if a.center else np.zeros(norm_shape, np.float32)
        assert gamma.size == width and beta.size == width
        return self.node("LayerNormalization", [self.float_of(call.args[0]), self.const(gamma, f"{var.name}.gamma"),
                                                self.const(beta, f"{var.name}.beta")],
                         var.name, axis=axes[0], epsilon=float(a.epsilon))

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
        op = _op_name(value)
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
