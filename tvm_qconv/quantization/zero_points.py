"""Which int8 tensors are unsigned (``QuantConfig.unsigned_activations``).

A tensor that is never negative -- a ReLU / ReLU6 output, a pool or channel gather of one -- uses
only 0..127 of symmetric int8: 7 bits.  Unsigned, it is 0..255 at scale ``amax / 255``, stored in
int8 as ``value - 128`` (zero point -128): half the rounding step, +6 dB on that tensor, and the
same int8 buffers and dp4a / mma.sync / wgmma kernels as before, because the zero point folds
into the reader's bias (a conv reads ``q + 128``: its accumulator gains ``128 * sum(w)`` per output
channel, a constant).

A padded conv's padding must read the zero point (a padded tap is a real zero): every conv kernel
pads with ``ConvWorkload.in_zero`` -- dp4a's and the CPU's padding stage, the depthwise kernels,
the mma.sync gather's predicated copy (its fill word, ``tensorcore/pipeline.py``) -- except the
wgmma family's TMA gather, whose out-of-bounds fill is 0: its bias is then a table per border
class that adds what -128 in the padding would have (``schedules/border_bias.py``).  So a tensor
is unsigned when every layer that reads it can take it:

- a conv (any padding, groups, stride);
- a max / average pool, a channel gather (ShuffleNet's shuffle and split);
- a residual add, a concatenation, an affine layer (DenseNet's BatchNorm), a lookup table, a channel
  scale (squeeze-excite), a LayerNorm (its statistics do not see the zero point): each
  subtracts the zero point from its input (or folds it into its offset, or its table);
- a linear layer (it quantizes its float input itself, and folds the zero point into its bias),
  or any float op (they read the dequantized tensor, ``(q - zero) * s``).

A max pool or channel gather passes its input's zero point through (its output is the same
integers), so the rule holds for those outputs' readers too.
"""
from __future__ import annotations

from tvm import relax

from ..graph import Graph

# Layers whose output can be unsigned: a conv whose activation is a ReLU / ReLU6 (clip at >= 0),
# and the ops that keep a never-negative input never negative.
PASS_THROUGH = ("max_pool2d", "channels")     # the same integers, zero point and scale as the input
READERS = ("conv2d", "max_pool2d", "avg_pool2d", "channels", "dense", "add", "concat", "affine", "lut", "scale",
           "layer_norm")
# float ops that keep a never-negative tensor so: shapes, and the pools a model leaves float (VGG16's
# and AlexNet's adaptive average pool before the classifier, ShuffleNet's global mean)
NONNEG_FLOAT_OPS = ("relax.reshape", "relax.flatten", "relax.nn.adaptive_avg_pool2d", "relax.mean",
                    "relax.nn.avg_pool2d", "relax.nn.max_pool2d")


def never_negative_activation(ly) -> bool:
    """The layer's fused activation clamps at or above 0 (ReLU, ReLU6, hardtanh(0, x))."""
    return bool(ly.relu) and (ly.clip is None or ly.clip[0] >= 0)


def reads_unsigned(ly) -> bool:
    """``ly``'s int8 kernel can read an unsigned input (the module docstring's list)."""
    if ly.reason_float:   # kept float by the analysis (e.g. a weight computed at run time): reads the dequantized tensor
        return True
    return ly.kind in READERS


def scheme_float_reason(ly, config) -> str | None:
    """Why the analysis or the scheme ``config`` keeps ``ly`` float, before any kernel is chosen, or
    None: the planner's first rule (``planner.Planner.why_float``), and what the steps before the plan
    (unsigned points, GPTQ's layers) know of it through :func:`may_run_int8`."""
    if ly.reason_float:
        return ly.reason_float
    if config.skips(ly.name):
        return "in the skip list"
    if ly.kind == "dense" and not config.quantize_dense:
        return "quantize_dense=False"
    return None


def may_run_int8(ly, config) -> bool:
    """Whether ``ly`` is not kept float by the analysis or the scheme ``config`` (whether a kernel
    exists is known only when the plan picks one): :func:`scheme_float_reason` is None."""
    return scheme_float_reason(ly, config) is None


def planned_unsigned(graph: Graph, config) -> set:
    """:func:`unsigned_points` under ``config`` (none unless ``config.unsigned_activations``)."""
    if not config.unsigned_activations:
        return set()
    return unsigned_points(graph, lambda ly: may_run_int8(ly, config))


def planned_unsigned_names(graph: Graph, config) -> set:
    """The point names of :func:`planned_unsigned` (the tensors calibrated on the 255-step grid)."""
    return {graph.points[v] for v in planned_unsigned(graph, config) if v in graph.points}


def unsigned_points(graph: Graph, may_run_int8) -> set:
    """The float graph's vars whose int8 tensor is unsigned: never negative by construction and
    read only by layers that take an unsigned tensor.

    Never negative: a conv's, linear layer's, add's or affine layer's output after a ReLU / ReLU6,
    a pool, channel gather or concatenation of such tensors, a reshape / flatten or float pool of
    one (the classifier's input).

    Args:
        graph: the analysis (``graph.analyze``).
        may_run_int8: ``layer -> bool``: whether the scheme may run it in int8 (only those tie
            a pass-through layer's input and output together).
    """
    readers = graph.layer_readers      # var -> the layers that read it (built once per graph)
    made_by = {ly.output: ly for ly in graph.layers}
    inside = {v for ly in graph.layers for v in ly.vars[:-1]}   # a layer's intermediate vars

    nonneg: set = set()
    for b in graph.bindings:
        var, ly = b.var, made_by.get(b.var)
        if ly is not None:
            if ly.kind in ("conv2d", "dense", "add", "affine"):
                positive = never_negative_activation(ly)
            elif ly.kind in PASS_THROUGH or ly.kind == "avg_pool2d":
                positive = ly.inputs[0] in nonneg
            elif ly.kind == "concat":
                positive = all(v in nonneg for v in ly.inputs)
            else:
                positive = False
        elif var in inside:
            positive = False
        else:
            op = getattr(b.value.op, "name", None) if isinstance(b.value, relax.Call) else None
            positive = op in NONNEG_FLOAT_OPS and b.value.args[0] in nonneg
        if positive:
            nonneg.add(var)
    # A tensor with no int8 point of its own is one a gather reads through (a channel shuffle whose
    # readers are its split pieces: one gather from the shuffle's input) or a float intermediate;
    # it is kept here so that the chain through it holds, and is in no report (not a point).
    unsigned = {v for v in nonneg if all(reads_unsigned(r) for r in readers.get(v, []))}
    # A pass-through layer's input and output are one tensor: both unsigned or neither.
    through = [ly for ly in graph.layers if ly.kind in PASS_THROUGH and may_run_int8(ly)]
    changed = True
    while changed:
        changed = False
        for ly in through:
            if (ly.inputs[0] in unsigned) != (ly.output in unsigned):
                unsigned.discard(ly.inputs[0])
                unsigned.discard(ly.output)
                changed = True
    return unsigned
