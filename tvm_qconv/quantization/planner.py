"""plan_quantization: the float graph, its ranges, the scheme and the target in; the
:class:`~tvm_qconv.quantization.plan.QuantizationPlan` out.

One walk over the float graph's bindings in order, as the int8 graph will be built.  Each layer
the analysis found asks its family's rule (``RULES``: ``conv.py``, ``pools.py``,
``elementwise.py``, ``norms.py``, ``channels.py``) for its plan; the rule picks the kernel from the registry
(the user's choice, else a tuning database's measured pick, else the registry's order), and
computes what the kernel reads: scales and zero points, packed weights, folded biases,
multipliers.  The walk keeps what a backend will have at each step -- which int8 versions of a
tensor exist, in which layouts -- because decisions depend on it: a pool runs in int8 only on
an int8 input, a depthwise conv (or a grouped one, or one of few channels) follows its input's
layout, an add or concat takes the layout
most of its channels are in.

The unsigned-zero-point policy is decided here and only here: ``zero_points.planned_unsigned``
says which tensors may be unsigned before any range exists (calibration rounds them on the
255-step grid), and a conv whose zero point would not fit its bias takes its output back to
symmetric (``conv.output_zero_fits``) with the pass-through layers that share it.
"""
from __future__ import annotations

from .. import registry
from ..config import QuantConfig
from ..graph import Graph, lut_without_int8_reader, static_shape
from ..schedules.requantize import UNSIGNED_ZERO
from ..target import TargetInfo
from . import channels, conv, elementwise, norms, pools
from .plan import LayerPlan, QuantizationPlan, TensorQuant, TensorRead
from .scales import activation_scale
from .zero_points import PASS_THROUGH, may_run_int8, planned_unsigned, scheme_float_reason

# One planning rule per int8 operator: (planner, layer) -> LayerPlan, or the reason it stays float.
RULES = {
    "conv2d": conv.plan_conv2d,
    "dense": conv.plan_dense,
    "max_pool2d": pools.plan_max_pool2d,
    "avg_pool2d": pools.plan_avg_pool2d,
    "add": elementwise.plan_add,
    "affine": elementwise.plan_affine,
    "lut": elementwise.plan_lut,
    "scale": elementwise.plan_scale,
    "layer_norm": norms.plan_layer_norm,
    "concat": channels.plan_concat,
    "channels": channels.plan_channels,
}


def plan_quantization(graph: Graph, amax: dict, config: QuantConfig, target: TargetInfo, *,
                      choices: dict | None = None, chooser=None, channel_means: dict | None = None) -> QuantizationPlan:
    """The plan of ``graph`` in int8 for ``target``.

    Args:
        graph: the float graph's analysis (``graph.analyze``), at the build's shape.
        amax: ``{point name: amax}`` from a range source (calibration, given, learned in QAT).
        config: the scheme (skip list, dense on/off, unsigned activations).
        target: which kernels exist.
        choices: ``{layer name: implementation name}`` to prefer over the registry's order;
            ignored where it does not apply.
        chooser: ``(op, workload, candidates) -> implementation name or None``, asked for a layer
            ``choices`` does not name (a tuning database's measured pick).
        channel_means: ``{point name: mean per channel}`` of the calibration images: given, each
            conv / linear layer's bias is corrected for its int8 weights' mean error
            (``scales.weight_error_mean``); None: no correction.

    Raises:
        ValueError: a point of the graph has no range (ranges of another model or shape).
    """
    missing = sorted(set(graph.points.values()) - set(amax))
    if missing:
        raise ValueError(f"no calibrated range for {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                         "calibrate this model (or this checkpoint) again")
    return Planner(graph, amax, config, target, choices, chooser, channel_means).run()


class Planner:
    """The walk's state, and what every rule asks of it."""

    def __init__(self, graph: Graph, amax: dict, config: QuantConfig, target: TargetInfo, choices, chooser,
                 channel_means):
        self.g, self.amax, self.config, self.target = graph, dict(amax), config, target
        self.choices, self.chooser, self.channel_means = dict(choices or {}), chooser, channel_means
        self.versions: dict = {}     # var -> {layout: TensorQuant}: the int8 versions a backend will have made
        self.gathered: dict = {}     # channel gather output -> (var it reads, channel index from it)
        self.concats: dict = {}      # concatenation output -> its LayerPlan (gathers of it read its inputs)
        self.value = graph.value     # the float graph's expressions (lut tables)
        self.readers = graph.layer_readers   # var -> the layers that read it, in layer order
        # the tensors stored unsigned (zero point -128, scale amax / 255), decided before any is made
        self.unsigned = planned_unsigned(graph, config)
        self.fallback: list = []     # planned unsigned, made symmetric (conv.output_zero_fits)

    def run(self) -> QuantizationPlan:
        layers = []
        for b in self.g.bindings:
            ly = self.g.layer_of_var.get(b.var)
            if ly is None:
                continue
            why = self.why_float(ly)
            plan = why if why is not None else RULES[ly.kind](self, ly)
            if isinstance(plan, str):
                plan = LayerPlan(ly, why_float=plan, out_dtype="float32",
                                 row=dict(layer=ly.name, kind=ly.kind, kernel=f"float ({plan})", dtype="float32"))
            layers.append(plan)
        unsigned = sorted(self.g.points[v] for v in self.unsigned if v in self.g.points)
        return QuantizationPlan(self.g, self.target, layers, unsigned, self.fallback)

    # ---- tensors ------------------------------------------------------------------------
    def scale(self, var) -> float:
        return activation_scale(self.amax[self.g.points[var]], var in self.unsigned)

    def zero(self, var) -> int:
        return UNSIGNED_ZERO if var in self.unsigned else 0

    def quantized(self, var) -> TensorQuant | None:
        """The int8 tensor ``var``'s producer wrote (its first version), if any."""
        versions = self.versions.get(var)
        return next(iter(versions.values())) if versions else None

    def read(self, var, layout: str) -> TensorRead:
        """``var`` read as int8 in ``layout``: as produced, relayouted (the same integers), or
        quantized from float at its point's scale and zero point."""
        versions = self.versions.setdefault(var, {})
        if layout not in versions:
            n, c, h, w = static_shape(var.ty)
            src = next(iter(versions.values()), None)
            if src is not None:
                packed = registry.layout(layout).packed_shape((n, src.channels, h, w))
                versions[layout] = TensorQuant(src.scale, src.zero, src.channels, layout, packed)
            else:
                packed = registry.layout(layout).packed_shape((n, c, h, w))
                versions[layout] = TensorQuant(self.scale(var), self.zero(var), c, layout, packed)
        return TensorRead(var, versions[layout])

    def produce(self, var, quant: TensorQuant) -> None:
        """``var``'s int8 tensor, as its layer writes it."""
        if quant.zero != self.zero(var):
            raise RuntimeError(f"{var.name}: made with zero point {quant.zero}, planned {self.zero(var)}")
        self.versions[var] = {quant.layout: quant}

    def produce_output(self, ly, impl) -> TensorQuant:
        """``ly``'s output as ``impl`` writes it: the layer's own shape packed in the kernel's layout, at the
        output's planned scale and zero point (the memory-bound kernels that keep their input's shape)."""
        n, c, h, w = static_shape(ly.output.ty)
        shape = registry.layout(impl.layout).packed_shape((n, c, h, w))
        out = TensorQuant(self.scale(ly.output), self.zero(ly.output), c, impl.layout, shape)
        self.produce(ly.output, out)
        return out

    def make_symmetric(self, var) -> None:
        """Take ``var`` out of the unsigned plan, with the max pools and gathers that pass its
        integers on (their outputs are the same tensor); none of its readers is planned yet."""
        self.unsigned.discard(var)
        self.fallback.append(self.g.points.get(var, var.name))
        for r in self.readers.get(var, []):
            if r.kind in PASS_THROUGH and r.output in self.unsigned:
                self.make_symmetric(r.output)

    # ---- layers -------------------------------------------------------------------------
    def why_float(self, ly) -> str | None:
        reason = scheme_float_reason(ly, self.config)   # what the steps before the plan predicted from
        if reason is not None:
            return reason
        if ly.kind in ("max_pool2d", "avg_pool2d", "affine", "channels", "lut", "scale", "layer_norm") \
                and self.quantized(ly.inputs[0]) is None:
            return "input is float"  # quantizing a float tensor only to pool or scale it gains nothing
        if ly.kind in ("add", "concat") and all(self.quantized(v) is None for v in ly.inputs):
            return "inputs are float"  # likewise to add or join float tensors (layers kept float around it)
        if lut_without_int8_reader(ly, self.readers, lambda r: may_run_int8(r, self.config)):
            return "no int8 reader"
        return None

    def pick(self, op: str, wl, layer: str, follow: str | None = None):
        """The implementation of ``op`` for ``wl``: the user's choice for the layer, else the
        chooser's (measured), else the registry's pick where it reads the layout ``follow`` (the
        layer's int8 input's, if one is given), else the first that ``follows_input`` and reads
        ``follow``, else the registry's pick.  (Grouped convs of 16 channels and more: the registry
        picks the tensor-core GEMM, which reads NHWC32 as the dp4a grouped kernel does.)"""
        prefer = self.choices.get(layer)
        if prefer is None and self.chooser is not None:
            prefer = self.chooser(op, wl, registry.candidates(op, wl, self.target))
        if prefer is None and follow is not None:
            first = registry.select(op, wl, self.target)
            if first is None or first.input_layout() != follow:
                prefer = next((impl.name for impl in registry.candidates(op, wl, self.target)
                               if impl.follows_input and impl.input_layout() == follow), None)
        return registry.select(op, wl, self.target, prefer=prefer)

    def select(self, op: str, wl, layout: str | None = None):
        """The registry's implementation of ``op`` for ``wl`` on the target (in ``layout``)."""
        return registry.select(op, wl, self.target, layout=layout)

    def first(self, op: str, layout: str | None):
        """The first implementation of ``op`` in ``layout`` for any workload (gathers, tables, adds)."""
        return next(iter(registry.candidates(op, None, self.target, layout=layout)), None)

    def majority_layout(self, inputs) -> str | None:
        """The layout most of ``inputs``' int8 channels are in (ties: the latest input's), so that
        the fewest relayouts run: DenseNet concatenates a dp4a stem's NCHW4c features with every
        tensor-core layer's NHWC32 ones, and each input is relayouted once."""
        weight: dict[str, int] = {}
        for q in (self.quantized(v) for v in inputs):
            if q is not None:
                weight[q.layout] = weight.pop(q.layout, 0) + q.channels  # re-insert: latest last
        return max(reversed(weight), key=weight.get) if weight else None

    def no_kernel(self, op, wl) -> str:
        return f"no int8 {op} kernel for {wl.describe() if hasattr(wl, 'describe') else wl} on {self.target.kind}" \
               + (f" {self.target.arch}" if self.target.arch else "")

    def input_mean(self, ly):
        """The calibration images' per-channel mean of ``ly``'s input (None: no bias correction)."""
        means = self.channel_means
        if means is None:
            return None
        point = self.g.points.get(ly.inputs[0])
        if point not in means:
            raise ValueError(f"bias correction: no calibrated mean for {ly.name}'s input {point}: calibrate again")
        return means[point]

