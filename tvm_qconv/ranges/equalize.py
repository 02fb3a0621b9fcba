"""Activation equalization: rescale the channels between two convs so that one per-tensor int8
scale fits them all (``QuantConfig.equalization``).

A per-tensor int8 activation gives every channel the same step, set by the widest channel.  After
a depthwise conv (MobileNet's, EfficientNet's) the channels' ranges differ by 10-100x, and a narrow
channel is left a handful of levels.  Where conv ``A``'s output is read by conv ``B`` alone, through
nothing but a ReLU / ReLU6 (positively homogeneous: ``relu(g x) = g relu(x)`` for ``g > 0``), the
float model is unchanged when ``A``'s output channel ``c`` is multiplied by ``g_c`` (its weight row
and its bias) and ``B``'s input channel ``c`` divided by it (its weight column): Nagel et al.,
"Data-Free Quantization Through Weight Equalization and Bias Correction" (ICCV 2019), applied here
to the activation's ranges, as SmoothQuant (Xiao et al., 2023) does for transformers' matmuls.

- ``g_c >= 1`` only (a narrow channel widened toward the widest).  A ReLU6 then still clips where
  the int8 tensor does: the calibrated range of the tensor is at most 6, so a value the widened
  channel would carry past 6 is clipped by the int8 grid anyway (the float graph's clip at 6 and the
  int8 kernel's clip at the range agree).
- ``A``'s rows are quantized per output channel: scaling a row changes none of its integers.
- Where ``B`` reads each input channel in its own group (depthwise: MobileNet's expand -> depthwise
  pair), ``B``'s per-output-channel weight scale absorbs ``1 / g_c`` too: equalizing costs nothing,
  and ``g_c = r_max / r_c`` (``r``: the channel's calibrated max |x|).  Where ``B`` mixes channels
  (a 1x1 projection), a column divided by ``g_c`` shares its row's scale with the others and loses
  weight precision: ``g_c = (r_max / r_c) ** ALPHA``, the two errors balanced.

The factors come from one calibration pass (its per-channel maxima); the build then calibrates
the equalized graph again.  They are applied to the simplified float module
(:class:`EqualizedGraphs`, every batch alike), so the int8 kernels, the float ops kept beside them,
the verification's twin and an ONNX export all read the same weights.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..graph import Graph, _const
from ..relax_utils import emit_like, rebuild_main, substitute
from ..frontend.exported import ExportedGraphs, FloatGraph

ALPHA = 0.5     # the share of a channel's range moved into a channel-mixing reader's weights
G_MAX = 256.0   # a dead channel (max 0) is widened this much at most: past it, it is zero in int8 either way


def pairs(graph: Graph) -> list[tuple]:
    """The (A, B) conv pairs that can be equalized: ``A``'s output (after a ReLU / ReLU6 or
    nothing) is read by ``B`` alone, both convs the analysis found with constant weights, ``A``'s
    activation clipping at 0 below (a hardtanh's negative bound does not scale)."""
    out = []
    for a in graph.layers:
        if a.kind != "conv2d" or a.weight is None or a.output in graph.outputs:
            continue
        if a.clip is not None and a.clip[0] != 0.0:
            continue
        readers = graph.layer_readers.get(a.output, [])
        if len(readers) != 1 or len(graph.binding_readers.get(a.output, ())) != 1:
            continue
        b = readers[0]
        if b.kind == "conv2d" and b.weight is not None and b.inputs[0].same_as(a.output) and len(b.inputs) == 1:
            out.append((a, b))
    return out


def _clip_headroom(graph: Graph, a) -> np.ndarray | None:
    """For ``a`` ending in a clip at a finite ``hi`` (ReLU6): the widest factor per output channel
    that never reaches ``hi``, from a bound on the channel's input (the clip of the layer that
    writes it, ``[0, hi_in]``): ``hi / (hi_in * sum(max(W_c, 0)) + b_c)``, 1 where that bound
    reaches ``hi`` or the input has none.  ``None``: ``a`` does not clip above (ReLU, none)."""
    if a.clip is None or not np.isfinite(a.clip[1]):
        return None
    hi = a.clip[1]
    producer = next((ly for ly in graph.layers if ly.output.same_as(a.inputs[0])), None)
    if producer is None or producer.clip is None or producer.clip[0] != 0.0 or not np.isfinite(producer.clip[1]):
        return np.ones(a.weight.shape[0], np.float64)
    w = a.weight.reshape(a.weight.shape[0], -1).astype(np.float64)
    bound = producer.clip[1] * np.maximum(w, 0).sum(axis=1) + (0.0 if a.bias is None else a.bias.astype(np.float64))
    return np.where(bound > 0, hi / np.maximum(bound, 1e-30), G_MAX).clip(1.0, G_MAX)


def factors(graph: Graph, channel_amax: dict, alpha: float = ALPHA) -> dict[str, np.ndarray]:
    """``{A's name: g [A's output channels]}`` for every pair of :func:`pairs`, from the calibrated
    per-channel max |x| of ``A``'s output (``channel_amax``, by point name).  Under a clip at a
    finite bound (ReLU6), a channel is widened only as far as its input's bound proves it never
    reaches the clip (:func:`_clip_headroom`): the calibration images' maxima do not (on held-out
    photos, a channel widened past its calibrated max would be clipped where the float model is not)."""
    out = {}
    for a, b in pairs(graph):
        r = np.asarray(channel_amax.get(graph.points.get(a.output), ()), dtype=np.float64)
        if r.size != a.weight.shape[0] or not np.all(np.isfinite(r)) or r.max() <= 0:
            continue
        channel_wise = b.weight.shape[1] == 1   # B reads each input channel in its own group (depthwise)
        g = (r.max() / np.maximum(r, r.max() / G_MAX)) ** (1.0 if channel_wise else alpha)
        headroom = _clip_headroom(graph, a)
        g = np.clip(g, 1.0, G_MAX if headroom is None else headroom)
        if np.any(g > 1.0):
            out[a.name] = g.astype(np.float32)
    return out


def _scaled(graph: Graph, g: dict) -> dict:
    """``{binding var: new expression}``: each pair's A conv and bias add, and B conv, with their
    constants rescaled (a conv both a B and an A gets both)."""
    rows: dict = {}    # layer name -> factor per output channel
    cols: dict = {}    # layer name -> divisor per input channel
    for a, b in pairs(graph):
        if a.name in g:
            rows[a.name] = g[a.name]
            cols[b.name] = g[a.name]
    new = {}
    for ly in graph.layers:
        if ly.name not in rows and ly.name not in cols:
            continue
        w = np.asarray(_const(ly.call.args[1]), dtype=np.float32)
        if ly.name in rows:
            w = w * rows[ly.name].reshape(-1, *([1] * (w.ndim - 1)))
        if ly.name in cols:
            groups = int(ly.call.attrs.groups)
            per_group = w.shape[1]
            c = cols[ly.name]        # [C_in] = groups * per_group; output o reads group o // (O / groups)
            col = c.reshape(groups, per_group)[np.arange(w.shape[0]) // (w.shape[0] // groups)]
            w = w / col.reshape(w.shape[0], per_group, *([1] * (w.ndim - 2)))
        call = ly.call
        new[ly.vars[0]] = tvm.ir.Call(call.op, [call.args[0], relax.const(w.astype(np.float32))], call.attrs,
                                      call.ty_args)
        if ly.name in rows and ly.bias is not None:
            add_var = ly.vars[1]
            add = graph.value[add_var]
            args = [relax.const((np.asarray(_const(x)) * rows[ly.name].reshape(_const(x).shape)).astype(np.float32))
                    if _const(x) is not None else x for x in add.args]
            new[add_var] = tvm.ir.Call(add.op, args, add.attrs, add.ty_args)
    return new


def equalized_module(mod, graph: Graph, g: dict):
    """``mod`` (whose ``main`` ``graph`` analysed) with the factors ``g`` applied."""
    new = _scaled(graph, g)

    def rewrite(bb, binding, vmap, is_output):
        expr = new.get(binding.var, binding.value)
        return emit_like(bb, binding, substitute(expr, vmap), is_output)
    return rebuild_main(mod, rewrite)


class EqualizedGraphs(ExportedGraphs):
    """``base``'s float graphs with the equalization factors ``g`` applied at every batch."""

    def __init__(self, base: ExportedGraphs, g: dict):
        self.base, self.factors = base, dict(g)
        self.frontend, self.sample_shape = base.frontend, base.sample_shape
        self._imported, self._simplified, self._at = {}, {}, {}

    @property
    def exports(self):
        return self.base.exports

    @property
    def export_seconds(self):
        return self.base.export_seconds

    def imported(self, batch: int):
        return self.base.imported(batch)

    def simplified(self, batch: int):
        batch = int(batch)
        if batch not in self._simplified:
            imported, mod, names = self.base.simplified(batch)
            self._simplified[batch] = (imported, equalized_module(mod, self.base.at(batch).graph, self.factors), names)
        return self._simplified[batch]

    def annotate(self, fg: FloatGraph) -> FloatGraph:
        return self.base.annotate(fg)


def summary(graph: Graph, g: dict) -> dict:
    """The build report's entry: each equalized pair and how far its channels were widened."""
    return dict(pairs=[dict(layer=a.name, reader=b.name, channels=int(g[a.name].size),
                            widest_factor=round(float(g[a.name].max()), 2),
                            median_factor=round(float(np.median(g[a.name])), 2))
                       for a, b in pairs(graph) if a.name in g])
