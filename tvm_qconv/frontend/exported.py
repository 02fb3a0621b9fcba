"""A model's float graph at every batch a build needs, the same for every frontend: imported once a
batch (the frontend's part: :meth:`ExportedGraphs.imported`), then folded (:func:`simplify`), its
channels-last regions rewritten as NCHW ops, analysed (``graph.analyze``).

    frontend --imported(batch)--> Relax as imported --simplify, channels_first,
      identity reshapes--> FloatGraph(mod, names, graph)
"""
from __future__ import annotations

import time

from tvm import relax

from ..graph import Graph, analyze
from ..transform.channels_first import channels_first
from ..transform.conv_bias_batch_norms import move_conv_biases_into_batch_norms
from ..transform.fold_pads import fold_pads_into_convs
from ..transform.global_means import keep_global_mean_dims
from ..transform.identity_reshapes import drop_identity_reshapes


class FloatGraph:
    """One batch's float graph: ``imported`` (as the importer gave it), ``mod`` (simplified),
    ``names`` (the model's names of its conv / linear layers) and ``graph`` (its analysis)."""

    def __init__(self, imported, mod, names: dict, graph: Graph):
        self.imported, self.mod, self.names, self.graph = imported, mod, names, graph


class ExportedGraphs:
    """A float model exported once, its float graph at every batch a build needs (its own batch,
    and batch 1 for calibration and the verification's per-layer twin).  A frontend subclasses it
    with :meth:`imported`; every batch is then folded and analysed once (:meth:`at`).

    Attributes:
        frontend: the model (``frontend.Frontend``).
        sample_shape: (C, H, W) of one image.
        exports, export_seconds: the exports made, and their time.
    """

    def __init__(self, frontend, input_shape):
        self.frontend = frontend
        self.sample_shape = tuple(int(d) for d in input_shape[1:])
        self.exports, self.export_seconds = 0, 0.0
        self._imported: dict = {}     # batch -> (imported Relax module, layer names)
        self._simplified: dict = {}   # batch -> (imported, simplified module, layer names)
        self._at: dict = {}           # batch -> FloatGraph

    def imported(self, batch: int):
        """(Relax module as imported, layer names) at ``batch``."""
        raise NotImplementedError

    def simplified(self, batch: int):
        """(Relax module as imported, simplified Relax module, layer names) at ``batch``: folded
        (:func:`simplify`), its channels-last regions as NCHW ops (``transform/channels_first.py``)
        and the identity reshapes that leaves dropped (``transform/identity_reshapes.py``); made
        once per batch."""
        batch = int(batch)
        if batch not in self._simplified:
            imported, names = self.imported(batch)
            mod, names = channels_first(simplify(imported), names)
            self._simplified[batch] = (imported, drop_identity_reshapes(mod), names)
        return self._simplified[batch]

    def at(self, batch: int) -> FloatGraph:
        """The float graph at ``batch``: :meth:`simplified`, then analysed (made once per batch)."""
        batch = int(batch)
        if batch not in self._at:
            imported, mod, names = self.simplified(batch)
            graph = analyze(mod["main"], names)
            graph.kernels = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}
            self._at[batch] = self.annotate(FloatGraph(imported, mod, names, graph))
        return self._at[batch]

    def annotate(self, fg: FloatGraph) -> FloatGraph:
        """What a frontend adds to a batch's fresh graph (a Q/DQ file: the weights' integers)."""
        return fg

    def _timed(self, export):
        t = time.perf_counter()
        try:
            return export()
        finally:
            self.exports += 1
            self.export_seconds += time.perf_counter() - t


def simplify(mod):
    """Fold batch norm into convs (a conv with a bias too: ``transform/conv_bias_batch_norms.py``),
    fold constants (bias reshapes, weight transposes), drop dead code; a spatial mean that drops its
    axes as the global pool it is (``transform/global_means.py``); an explicit zero pad before a
    conv as the conv's padding (``transform/fold_pads.py``)."""
    # constants folded first: a conv's bias is imported as a reshape of a constant, which the
    # bias move reads as the constant it is
    seq = [relax.transform.FoldConstant(), move_conv_biases_into_batch_norms,
           relax.transform.FoldBatchnormToConv2D(), relax.transform.FoldConstant(),
           relax.transform.CanonicalizeBindings(), relax.transform.DeadCodeElimination(["main"])]
    for p in seq:
        mod = p(mod)
    return fold_pads_into_convs(keep_global_mean_dims(mod))
