"""Analysis of a float Relax ``main``: which bindings form the layers that become int8 kernels.

Calibration and the quantize pass both read this one analysis, so the tensors that get
calibrated are exactly the tensors that get quantized.  A *layer* is one of

- ``conv2d``: ``conv2d(x, W)`` [+ ``add(., bias)``] [+ ``relu``], W and bias constants (whether a
  kernel exists for its groups, stride... is the kernel registry's call, not this analysis');
- ``dense``: ``matmul(x, W)`` [+ ``add(bias, .)``] [+ ``relu``], x 2-D, W a constant [K, O];
- ``add``: ``add(a, b)`` of two activations of one shape (residual) [+ ``relu``];
- ``max_pool2d``: NCHW max pooling;
- ``concat``: ``concat((a, b, ...), axis=1)`` of 4-D activations (Inception, DenseNet branches);
- ``avg_pool2d``: NCHW average pooling dividing by the whole window (no padding, or
  ``count_include_pad``), and a global average pool: ``mean(x, axis=[2, 3], keepdims=True)`` (a
  classifier's, a squeeze-excite's; ``Layer.window`` holds the geometry of both);
- ``affine``: an inference ``batch_norm`` no conv absorbed (DenseNet's BN -> ReLU -> conv) [+ ``relu``];
  of a ``concat`` that nothing else reads, the concat's inputs are its inputs and the concat its
  ``Layer.joined`` (the kernel reads the joined tensor in place: it is never written).
- ``scale``: ``multiply(x, g)`` of a 4-D activation ``x`` [N, C, H, W] and a per-(image, channel) factor
  ``g`` [N, C, 1, 1] computed at run time (squeeze-excite's gate): ``x`` is its input, ``g`` its
  ``Layer.gate``; where ``g`` is an elementwise chain of one activation ``a`` [N, C, 1, 1] (a sigmoid
  or hardsigmoid of the block's second conv), ``a`` is its second input and the chain its
  ``Layer.gate_chain`` (read as a 256-entry table), else ``g`` is read in float;
- ``layer_norm``: ``layer_norm(x, gamma, beta, axes=[1])`` of a 4-D activation, gamma and beta
  constants: a LayerNorm over each pixel's channels (ConvNeXt's, after ``transform/channels_first.py``
  made its channels-last regions NCHW); ``Layer.weight`` / ``Layer.bias`` hold gamma and beta.  A
  LayerNorm of a 4-D activation over other axes is a layer kept float, with the reason;
- ``lut``: an elementwise function of one activation ``x``, as a lookup table: a chain of
  elementwise ops (``ELEMENTWISE``) whose only non-scalar operand is ``x`` or an earlier op of
  the chain, with one output read outside it -- SiLU (``x * sigmoid(x)``), hardswish
  (``x * clip(x + 3, 0, 6) / 6``), GELU, sigmoid.  Kept only where an int8 layer reads its output
  (a squeeze-excite gate, multiplied into another tensor, stays float).
- ``channels``: a pure channel gather, ``Layer.channel_index`` (output channel ``j`` is input
  channel ``index[j]``): piece ``i`` of ``split(x, axis=1)`` (its ``TupleGetItem``, named
  ``split_<k>.<i>``), or a channel
  shuffle ``reshape(x, [n, g, c/g, h, w]) -> permute_dims([0, 2, 1, 3, 4]) -> reshape(x, [n, c, h, w])``
  (ShuffleNet).  It moves int8 values and keeps the input's scale, so, like a max-pool, it has
  no calibration points of its own.

``relu`` stands for any activation that is a clamp: ``relu``, and ``clip(x, lo, hi)`` with constant
bounds (ReLU6, hardtanh), recorded as ``Layer.clip``; the kernel clamps in the integer domain.

Every other binding stays float.  The *points* are the activation tensors whose range is
calibrated: each layer's inputs and its output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import tvm
from tvm import relax

from .elementwise_ops import ELEMENTWISE  # the ops a lookup-table region (``lut`` layer) may hold
from .relax_utils import free_vars




@dataclass
class Layer:
    kind: str                      # conv2d | dense | add | max_pool2d | avg_pool2d | affine | concat | channels | lut
                                   # | scale | layer_norm
    name: str                      # torch module path where known (features.0), else kind_k
    inputs: list                   # activation inputs: relax.Var of the float graph
    output: relax.Var              # last var of the pattern (after bias / relu)
    vars: list                     # every var bound by the pattern, first to last
    call: relax.Call               # the anchor call (conv2d / matmul / add / max_pool2d)
    relu: bool = False
    clip: tuple[float, float] | None = None  # the activation's (lo, hi): relu (0, inf), ReLU6 (0, 6)
    weight: np.ndarray | None = None   # conv: OIHW float; dense: [O, K] float; layer_norm: gamma [C]
    given_weight: tuple | None = None  # conv / dense: (int8 q, float32 scales [O]) a Q/DQ file gives
    #                                    (onnx_qdq.py): the layer quantizes with them, weight == q * scales
    bias: np.ndarray | None = None     # [O] float; layer_norm: beta [C]
    reason_float: str | None = None    # set when the pattern cannot run in int8
    # avg_pool2d: (pool, stride, padding) -- of the pool call, or the whole map for a global mean
    window: tuple | None = None
    channel_index: tuple | None = None  # channels: output channel j reads input channel index[j]
    gate: relax.Var | None = None       # scale: the [N, C, 1, 1] factor, read in float
    # scale: the elementwise chain (a ``lut`` Layer: sigmoid, hardsigmoid) that computes the gate from the
    # activation ``inputs[1]``, which the int8 kernel reads as a table of its 256 values
    gate_chain: "Layer | None" = None
    joined: "Layer | None" = None       # affine: the concat it normalizes, read in place (its inputs are ours)

    @property
    def quantizable(self) -> bool:
        return self.reason_float is None


@dataclass
class Graph:
    """The analysis of one float ``main`` (:func:`analyze`): its bindings, the layers found in them
    and the calibration points.

    Indices, each computed once, on first use (after :func:`analyze` has finished: the layers are
    not changed after it returns, and ``bindings`` never are), then shared by every reader -- treat
    them as read-only:

    - ``binding``: ``{var: its relax.VarBinding}``;
    - ``value``: ``{var: the expression bound to it}`` (a lookup table's ops, a gate's producers);
    - ``binding_readers``: ``{var: the set of binding vars whose expression reads it}`` (a var no
      binding reads is absent): what a fusion asks before it drops a tensor (``epilogues.py``);
    - ``outputs``: the vars the function returns (a frozenset);
    - ``layer_readers``: ``{var: [the layers that take it as an input, in layer order]}``.
    """
    func: relax.Function
    bindings: list                          # relax.VarBinding in order
    layers: list = field(default_factory=list)
    layer_of_var: dict = field(default_factory=dict)   # first var of a pattern -> Layer
    consumed: set = field(default_factory=set)         # vars bound inside some pattern
    lazy: set = field(default_factory=set)             # consumed vars emitted in float only if a float reader needs them
    points: dict = field(default_factory=dict)         # relax.Var -> point name
    kernels: dict = field(default_factory=dict)        # the module's other functions (GlobalVar -> function:
    #                                                    an ONNX import's call_tir kernels), for modules made from func

    @cached_property
    def binding(self) -> dict:
        return {b.var: b for b in self.bindings}

    @cached_property
    def value(self) -> dict:
        return {b.var: b.value for b in self.bindings}

    @cached_property
    def binding_readers(self) -> dict:
        readers: dict = {}
        for b in self.bindings:
            for v in free_vars(b.value):
                readers.setdefault(v, set()).add(b.var)
        return readers

    @cached_property
    def outputs(self) -> frozenset:
        return frozenset(free_vars(self.func.body.body))

    @cached_property
    def layer_readers(self) -> dict:
        readers: dict = {}
        for ly in self.layers:
            for v in ly.inputs:
                readers.setdefault(v, []).append(ly)
        return readers


def _op(expr) -> str | None:
    """Name of a Relax operator call (``relax.nn.conv2d``), else None."""
    return getattr(expr.op, "name", None) if isinstance(expr, relax.Call) else None


def _const(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, tvm.ir.expr.GenericConst) else None


def _shape(expr) -> tuple | None:
    return static_shape(expr.ty)


def static_shape(ty) -> tuple | None:
    """Static shape of a Relax tensor type, or None (not a tensor / symbolic dims)."""
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            return tuple(int(d) for d in ty.shape.values)
        except (TypeError, AttributeError):
            return None
    return None


def _global_mean(call: relax.Call) -> bool:
    """``mean`` over both spatial axes of a static 4-D tensor, dimensions kept (``[N, C, 1, 1]``)."""
    shape = _shape(call.args[0])
    if shape is None or len(shape) != 4 or not call.attrs.keepdims or call.attrs.axis is None:
        return False
    return sorted(int(a) % 4 for a in call.attrs.axis) == [2, 3]


def analyze(func: relax.Function, names: dict | None = None) -> Graph:
    """Find the layers of ``func`` (its single dataflow block, after FoldConstant/Canonicalize).

    Args:
        func: the float ``main``.
        names: optional ``{"conv2d": [torch names in order], "dense": [...]}`` from the frontend.
    """
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError("expected main to hold one dataflow block (run ConvertToDataflow first)")
    bindings = list(blocks[0].bindings)
    g = Graph(func=func, bindings=bindings)
    value = g.value   # bindings are fixed: the index is final already (layers are not: layer_readers waits)
    uses: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1
        elif isinstance(expr, relax.Call):
            for a in expr.args:
                count(a)
        elif isinstance(expr, relax.Tuple):
            for f in expr.fields:
                count(f)
        elif isinstance(expr, relax.TupleGetItem):
            count(expr.tuple_value)

    for b in bindings:
        count(b.value)
    count(func.body.body)
    user: dict = {}
    for b in bindings:
        for a in free_vars(b.value):
            user.setdefault(a, []).append(b.var)
    returned = g.outputs
    position = {b.var: i for i, b in enumerate(bindings)}

    def sole_user(var, op):
        """The one binding that reads ``var``, if it is a call of ``op`` (a name or a tuple of names)."""
        if uses.get(var, 0) != 1 or len(user.get(var, [])) != 1:
            return None
        nxt = user[var][0]
        return nxt if _op(value[nxt]) in ((op,) if isinstance(op, str) else op) else None

    counters: dict = {}
    torch_names = {k: list(v) for k, v in (names or {}).items()}

    def name_for(kind):
        k = counters.get(kind, 0)
        counters[kind] = k + 1
        lst = torch_names.get(kind, [])
        return lst[k] if k < len(lst) else f"{kind}_{k}"

    splits: dict = {}  # split var -> (input, channel offset of each piece)
    for b in bindings:
        var, call = b.var, b.value
        if var in g.consumed:
            continue
        op = _op(call)
        layer = None
        if op == "relax.split":
            pieces = _channel_split(var, call, value, user)
            if pieces is not None:  # each TupleGetItem becomes a layer; the split itself only if a float reader needs it
                splits[var] = (call.args[0], pieces, name_for("split"))
                g.consumed.add(var)
                g.lazy.add(var)
            continue
        if isinstance(call, relax.TupleGetItem) and call.tuple_value in splits:
            x, offsets, split_name = splits[call.tuple_value]
            size = _shape(var)[1]
            layer = Layer("channels", f"{split_name}.{call.index}", [x], var, [var], call,
                          channel_index=tuple(range(offsets[call.index], offsets[call.index] + size)))
        elif op == "relax.reshape":
            layer = _shuffle_layer(var, call, value, sole_user, name_for)
        elif op == "relax.nn.conv2d":
            layer = _conv_layer(var, call, value, sole_user, name_for("conv2d"))
        elif op == "relax.matmul" and _const(call.args[1]) is not None and len(_shape(call.args[0]) or ()) == 2:
            layer = _dense_layer(var, call, value, sole_user, name_for("dense"))
        elif op == "relax.add" and all(isinstance(a, relax.Var) for a in call.args) \
                and _shape(call.args[0]) == _shape(call.args[1]) and len(_shape(call.args[0]) or ()) == 4:
            layer = Layer("add", name_for("add"), list(call.args), var, [var], call)
        elif op == "relax.nn.max_pool2d":
            layer = Layer("max_pool2d", name_for("max_pool2d"), [call.args[0]], var, [var], call)
            if call.attrs.layout != "NCHW" or call.attrs.out_layout != "NCHW":
                layer.reason_float = f"max_pool2d layout {call.attrs.layout}"
        elif op == "relax.nn.avg_pool2d" and call.attrs.layout == "NCHW" and not call.attrs.ceil_mode \
                and tuple(map(int, call.attrs.dilation)) == (1, 1) \
                and (call.attrs.count_include_pad or not any(map(int, call.attrs.padding))):
            layer = Layer("avg_pool2d", name_for("avg_pool2d"), [call.args[0]], var, [var], call,
                          window=(tuple(map(int, call.attrs.pool_size)), tuple(map(int, call.attrs.strides)),
                                  tuple(map(int, call.attrs.padding))))
        elif op == "relax.mean" and _global_mean(call):
            # a global pool (the classifier's, a squeeze-excite's) as an int8 average pool over the whole map
            h, w = _shape(call.args[0])[2:]
            layer = Layer("avg_pool2d", name_for("avg_pool2d"), [call.args[0]], var, [var], call,
                          window=((h, w), (1, 1), (0, 0, 0, 0)))
        elif op == "relax.nn.batch_norm" and len(_shape(call.args[0]) or ()) == 4 and not call.attrs.training:
            layer = _affine_layer(var, call, value, user, uses, name_for)
            if layer is not None:
                _absorb_activation(layer, layer.output, value, sole_user)
        elif op == "relax.concat" and isinstance(call.args[0], relax.Tuple) and len(_shape(var) or ()) == 4 \
                and int(call.attrs.axis) in (1, -3) and all(isinstance(f, relax.Var) for f in call.args[0].fields):
            layer = Layer("concat", name_for("concat"), list(call.args[0].fields), var, [var], call)
        elif op == "relax.nn.layer_norm" and len(_shape(call.args[0]) or ()) == 4:
            layer = _layer_norm_layer(var, call, name_for("layer_norm"))
        elif op == "relax.multiply" and _channel_scale(call) is not None:
            x, gate = _channel_scale(call)
            layer = Layer("scale", name_for("scale"), [x], var, [var], call, gate=gate)
        elif op in ELEMENTWISE:
            layer = _lut_layer(var, call, value, user, returned, position)
        if layer is None:
            continue
        if layer.kind in ("add",):
            _absorb_activation(layer, layer.output, value, sole_user)
        g.layers.append(layer)
        g.layer_of_var[layer.vars[0]] = layer
        g.consumed.update(layer.vars)

    _gate_chains(g)
    _concats_into_affines(g, user, uses, returned)
    _drop_luts_without_int8_reader(g)
    for ly in g.layers:
        if ly.kind in ("max_pool2d", "channels"):  # they commute with the quantizer: the output keeps the input's scale
            continue
        for i, x in enumerate(ly.inputs):
            g.points.setdefault(x, f"{ly.name}.in{i}")
        if ly.kind != "dense":
            g.points[ly.output] = f"{ly.name}.out"
    return g


def _layer_norm_layer(var, call, name) -> Layer:
    """A LayerNorm of a 4-D activation: int8-able over the channels (axis 1) with constant gamma and
    beta; any other is a float layer that says why."""
    layer = Layer("layer_norm", name, [call.args[0]], var, [var], call)
    channels = _shape(call.args[0])[1]
    axes = sorted(int(a) % 4 for a in call.attrs.axes)
    gamma = _const(call.args[1]) if call.attrs.scale else np.ones(channels, np.float32)
    beta = _const(call.args[2]) if call.attrs.center else np.zeros(channels, np.float32)
    if axes != [1]:
        layer.reason_float = f"LayerNorm over axes {axes}: the int8 kernel normalizes each pixel's channels (axis 1)"
    elif gamma is None or beta is None or gamma.size != channels or beta.size != channels:
        layer.reason_float = "LayerNorm whose gamma / beta are not constants of one value per channel"
    else:
        layer.weight, layer.bias = gamma.reshape(channels).astype(np.float32), beta.reshape(channels).astype(np.float32)
    return layer


def _concats_into_affines(g: Graph, user: dict, uses: dict, returned: set) -> None:
    """An ``affine`` layer (a BatchNorm) whose input is a ``concat`` that nothing else reads takes the
    concat's inputs as its own and the concat goes (DenseNet: each dense layer joins every earlier
    feature map only to normalize them): the affine kernel reads each byte where its input lies, and
    the joined tensor is never written.  The concat's bindings are emitted in float only where a float
    reader needs them (``Graph.lazy``: the ONNX export)."""
    concats = {ly.output: ly for ly in g.layers if ly.kind == "concat"}
    for ly in [ly for ly in g.layers if ly.kind == "affine"]:
        joined = concats.get(ly.inputs[0])
        if joined is None or joined.output in returned or uses.get(joined.output, 0) != 1 \
                or len(user.get(joined.output, [])) != 1:
            continue
        g.layers.remove(joined)
        del g.layer_of_var[joined.vars[0]]
        g.lazy.update(joined.vars)
        ly.inputs = list(joined.inputs)
        ly.joined = joined


def _gate_chains(g: Graph) -> None:
    """A scale layer whose gate is an elementwise chain (a ``lut`` region: sigmoid, hardsigmoid) of one
    activation ``[N, C, 1, 1]`` (the squeeze-excite's second conv) reads that activation as its second
    input, the chain its ``gate_chain``: the int8 kernel applies the chain as a table of the 256 values
    the activation's int8 holds.  The chain's bindings are emitted in float only if a float reader
    needs them (``Graph.lazy``: the kernel's float-gate fallback, the ONNX export)."""
    chains = {ly.output: ly for ly in g.layers if ly.kind == "lut"}
    for ly in [ly for ly in g.layers if ly.kind == "scale"]:
        chain = chains.get(ly.gate)
        if chain is None or _shape(chain.inputs[0]) != _shape(ly.gate):
            continue
        g.layers.remove(chain)
        del g.layer_of_var[chain.vars[0]]
        g.lazy.update(chain.vars)   # consumed (by the lut region) and emitted on demand
        ly.gate_chain = chain
        ly.inputs.append(chain.inputs[0])


def _channel_scale(call: relax.Call):
    """(x, gate) of ``multiply(x, gate)`` with x a 4-D activation [N, C, H, W] (H * W > 1) and gate a
    run-time factor of shape [N, C, 1, 1], in either order; else None."""
    a, b = call.args
    if not (isinstance(a, relax.Var) and isinstance(b, relax.Var)):
        return None
    for x, gate in ((a, b), (b, a)):
        xs, gs = _shape(x), _shape(gate)
        if xs and gs and len(xs) == 4 and gs == (xs[0], xs[1], 1, 1) and xs[2] * xs[3] > 1 \
                and str(x.ty.dtype) == "float32" and str(gate.ty.dtype) == "float32":
            return x, gate
    return None


def scalar_value(expr) -> float | None:
    """The number a constant of one element (``add(x, 3.0)``) or a prim value (``clip``'s bounds)
    holds, else None."""
    if isinstance(expr, (tvm.ir.prim.expr.FloatImm, tvm.ir.prim.expr.IntImm)):
        return float(expr.value)
    c = _const(expr)
    return float(c.reshape(())) if c is not None and c.size == 1 else None


def _scalar(expr) -> bool:
    return scalar_value(expr) is not None


def _lut_layer(var, call, value, user, returned, position):
    """The elementwise region that starts at ``var`` (see ``lut`` in the module docstring), or None.

    Grown from the region's input ``x`` (``call``'s one tensor operand): a binding joins when it
    is an ``ELEMENTWISE`` op of ``x``'s shape whose operands are scalars, ``x`` or region members.
    It is a layer when exactly one member is read outside the region (or returned)."""
    tensors = {a for a in call.args if not _scalar(a)}
    if len(tensors) != 1:
        return None
    (x,) = tensors
    shape = _shape(x) if isinstance(x, relax.Var) else None
    if shape is None or len(shape) != 4:
        return None
    inside: set = set()

    def fits(v) -> bool:
        c = value.get(v)
        return (_op(c) in ELEMENTWISE and _shape(v) == shape
                and all(_scalar(a) or (isinstance(a, relax.Var) and (a.same_as(x) or a in inside)) for a in c.args))

    grown = True
    while grown:
        grown = False
        for v in [x, *inside]:
            for u in user.get(v, []):
                if u not in inside and fits(u):
                    inside.add(u)
                    grown = True
    members = sorted(inside, key=position.get)
    outputs = [v for v in members if v in returned or any(u not in inside for u in user.get(v, []))]
    if not members or not members[0].same_as(var) or len(outputs) != 1:
        return None
    return Layer("lut", "lut", [x], outputs[0], members, call)  # named once kept (_drop_luts_without_int8_reader)


def lut_without_int8_reader(ly: Layer, layer_readers: dict, may_run_int8=lambda reader: True) -> bool:
    """Whether ``ly`` is a ``lut`` layer none of whose readers can take its int8 output (one rule, read
    twice: here, before any scheme, with every reading layer a possible int8 reader; by the planner,
    ``quantization/planner.py``, with the scheme's ``zero_points.may_run_int8``).  Such a table would
    only be dequantized again, a rounding its float reader does not have: it stays float ops."""
    return ly.kind == "lut" and not any(may_run_int8(r) for r in layer_readers.get(ly.output, []))


def _drop_luts_without_int8_reader(g: Graph) -> None:
    """The ``lut`` layers that no layer reads go back to float ops (:func:`lut_without_int8_reader`);
    the kept ones are named ``lut_<k>`` in graph order."""
    read = {}
    for ly in g.layers:
        for v in ly.inputs:
            read.setdefault(v, []).append(ly)
    for ly in [ly for ly in g.layers if lut_without_int8_reader(ly, read)]:
        g.layers.remove(ly)
        del g.layer_of_var[ly.vars[0]]
        g.consumed.difference_update(ly.vars)
    for k, ly in enumerate(ly for ly in g.layers if ly.kind == "lut"):
        ly.name = f"lut_{k}"


def _channel_split(var, call, value, user) -> list[int] | None:
    """The channel offset of each piece of ``split(x, axis=1)`` of a static 4-D ``x`` whose every
    reader takes one piece (``TupleGetItem``); else None (it stays a float op)."""
    shape = _shape(call.args[0])
    fields = getattr(var.ty, "fields", None)
    if (shape is None or len(shape) != 4 or int(call.attrs.axis) % 4 != 1 or not isinstance(call.args[0], relax.Var)
            or not fields or any(static_shape(f) is None for f in fields)):
        return None
    if not user.get(var) or not all(isinstance(value[u], relax.TupleGetItem) for u in user[var]):
        return None
    sizes = [static_shape(f)[1] for f in fields]
    return np.cumsum([0] + sizes[:-1]).tolist()


def _shuffle_layer(var, call, value, sole_user, name_for):
    """A channel shuffle: ``reshape`` [n, c, h, w] -> [n, g, c/g, h, w], ``permute_dims`` swapping the
    two channel axes, ``reshape`` back to [n, c, h, w]; else None."""
    src, mid = _shape(call.args[0]), _shape(var)
    if src is None or mid is None or len(src) != 4 or len(mid) != 5 or not isinstance(call.args[0], relax.Var):
        return None
    n, c, h, w = src
    g = mid[1]
    if mid != (n, g, c // g, h, w) or g * (c // g) != c:
        return None
    perm = sole_user(var, "relax.permute_dims")
    if perm is None or [int(a) for a in value[perm].attrs.axes] != [0, 2, 1, 3, 4]:
        return None
    back = sole_user(perm, "relax.reshape")
    if back is None or _shape(back) != src:
        return None
    # y[n, b*g + a] = x[n, a*(c/g) + b]: output channel j reads (j % g) * (c/g) + j // g
    return Layer("channels", name_for("shuffle"), [call.args[0]], back, [var, perm, back], value[perm],
                 channel_index=tuple((j % g) * (c // g) + j // g for j in range(c)))


def _affine_layer(var, call, value, user, uses, name_for):
    """An inference batch_norm whose only use is its normalized output (item 0): y = a * x + b."""
    gamma, beta, mean, var_ = (_const(a) for a in call.args[1:5])
    users = user.get(var, [])
    item = users[0] if len(users) == 1 and uses.get(var, 0) == 1 else None
    getitem = value.get(item) if item is not None else None
    if (any(c is None for c in (gamma, beta, mean, var_)) or int(call.attrs.axis) != 1
            or not isinstance(getitem, relax.TupleGetItem) or getitem.index != 0):
        return None
    layer = Layer("affine", name_for("affine"), [call.args[0]], item, [var, item], call)
    a = gamma.astype(np.float64) / np.sqrt(var_.astype(np.float64) + float(call.attrs.epsilon))
    if not call.attrs.scale:
        a = 1.0 / np.sqrt(var_.astype(np.float64) + float(call.attrs.epsilon))
    layer.weight = a
    layer.bias = (beta.astype(np.float64) if call.attrs.center else 0.0) - mean.astype(np.float64) * a
    return layer


def _clip_bounds(call) -> tuple[float, float] | None:
    """(lo, hi) of ``relu`` / ``clip`` with constant bounds, else None."""
    if _op(call) == "relax.nn.relu":
        return (0.0, float("inf"))
    if _op(call) == "relax.clip":
        try:
            lo, hi = (float(getattr(a, "value", a)) for a in call.args[1:3])
        except (TypeError, ValueError):  # a bound that is not a constant
            return None
        return (lo, hi) if lo < hi else None
    return None


def _absorb_activation(layer, var, value, sole_user) -> None:
    """Take a following relu / clip (ReLU6, hardtanh) into the layer: its epilogue clamps."""
    nxt = sole_user(var, ("relax.nn.relu", "relax.clip"))
    bounds = _clip_bounds(value[nxt]) if nxt is not None else None
    if bounds is None:
        return
    layer.relu, layer.clip = True, bounds
    layer.vars.append(nxt)
    layer.output = nxt


def _absorb_bias_relu(layer, var, value, sole_user, bias_shape_ok):
    nxt = sole_user(var, "relax.add")
    if nxt is not None:
        a, b = value[nxt].args
        other = b if a.same_as(var) else a
        bias = _const(other)
        if bias is not None and bias_shape_ok(bias.shape):
            layer.bias = bias.reshape(-1).astype(np.float32)
            layer.vars.append(nxt)
            layer.output = var = nxt
    _absorb_activation(layer, var, value, sole_user)
    return layer


def _conv_layer(var, call, value, sole_user, name):
    attrs = call.attrs
    w = _const(call.args[1])
    layer = Layer("conv2d", name, [call.args[0]], var, [var], call)
    oc = None if w is None else w.shape[0]
    if w is None:
        layer.reason_float = "weight is not a constant"
    elif attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW" or attrs.out_layout not in ("NCHW", ""):
        layer.reason_float = f"layout {attrs.data_layout}/{attrs.kernel_layout}"
    elif str(call.ty.dtype) != "float32":
        layer.reason_float = f"dtype {call.ty.dtype}"
    else:
        layer.weight = w.astype(np.float32)
    _absorb_bias_relu(layer, var, value, sole_user,
                      lambda s: oc is not None and int(np.prod(s)) == oc and s[-1 if len(s) == 1 else 1] == oc)
    return layer


def _dense_layer(var, call, value, sole_user, name):
    wt = _const(call.args[1])  # [K, O]
    layer = Layer("dense", name, [call.args[0]], var, [var], call)
    if str(call.ty.dtype) != "float32" or wt.ndim != 2:
        layer.reason_float = "not a float32 2-D matmul"
    else:
        layer.weight = np.ascontiguousarray(wt.T).astype(np.float32)
    o = wt.shape[-1]
    _absorb_bias_relu(layer, var, value, sole_user, lambda s: int(np.prod(s)) == o and s[-1] == o)
    return layer
