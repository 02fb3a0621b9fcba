"""quantize_module: a float model in, its int8 Relax module out (weights still inline) -- the build
pipeline's steps ``prepare`` to ``lower`` (``pipeline.py``), for the callers that stop there (the
tests of the plan and the lowering, the tuner's task extraction).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm

from . import pipeline
from .config import QuantConfig
from .frontend import ExportedGraphs, as_frontend
from .graph import Graph
from .progress import as_phases
from .quantization import QuantizationPlan
from .ranges.sources import RangeSource
from .target import TargetInfo


@dataclass
class QuantizedModule:
    """``mod``: the int8 module; ``report``: the pass's report plus ``ranges`` (where they came
    from); ``amax``: the range of every point; ``names``: torch names of conv / linear layers;
    ``graph``: the float graph's analysis at the build shape (with GPTQ, of the rounded
    weights); ``images``: the calibration images (None when the ranges were not calibrated);
    ``model``: the model quantized (a ``frontend.Frontend``; ``QuantConfig.weight_rounding="gptq"``:
    one of a copy with the rounded weights, which a rebuild from the same ranges takes with
    nearest rounding);
    ``held_out``: images of the calibration source that calibration did not use (None: none), on
    which the build verifies; ``plan``: the quantization plan (``tvm_qconv/quantization``);
    ``exported``: ``model`` exported (``frontend.ExportedGraphs``), its graph at any batch."""

    mod: tvm.IRModule
    report: dict
    amax: dict
    names: dict
    graph: Graph | None = None
    images: np.ndarray | None = None
    model: object = None
    held_out: np.ndarray | None = None
    plan: QuantizationPlan | None = None
    exported: ExportedGraphs | None = None


def float_graph(model, input_shape: tuple) -> Graph:
    """The analysis of ``model``'s float graph at ``input_shape`` (exported, BatchNorms folded)."""
    return as_frontend(model).export(input_shape).at(input_shape[0]).graph


def quantize_module(model, input_shape: tuple[int, int, int, int], target: TargetInfo, *,
                    config: QuantConfig = QuantConfig(), ranges: RangeSource | None = None,
                    choices: dict | None = None, chooser=None, expose_activations: bool = False,
                    debug_dump: str | None = None, progress=True, require_int8: bool = False,
                    exported: ExportedGraphs | None = None, check_graph=None) -> QuantizedModule:
    """The int8 Relax module of ``model`` for ``target``.

    Args:
        model: a float ``torch.nn.Module`` (eval mode is set), or any ``frontend.Frontend`` (an
            ``OnnxModel``).
        input_shape: the static (N, C, H, W) to build for.
        target: which kernels exist (``TargetInfo.from_target``).
        config: the scheme.
        ranges: where the activation ranges come from; default :class:`Calibrate` on
            scikit-image's photos.
        choices: ``{layer: implementation}`` preferences (the user's).
        chooser: ``(op, workload, candidates) -> implementation name or None`` for the other
            layers (a tuning database's measured pick, ``tuning.apply.measured_chooser``).
        expose_activations, debug_dump: see ``compile_model``.
        require_int8: refuse a skip list that leaves no layer in int8 (``pipeline.check_skip``).
        progress: print each phase as it starts (a :class:`~tvm_qconv.progress.Phases` to share
            the build's, or a bool).
        exported: ``model`` already exported (``frontend.ExportedGraphs``): its graphs are reused
            (a build shares one between its library, its verification and the per-layer twin).
        check_graph: ``(Graph) -> None``, called on the float graph before any range is resolved:
            a caller's refusal (``onnx_export.check_exportable``) comes before the calibration it
            would waste.
    """
    state = pipeline.BuildState(model, tuple(input_shape), target, config=config, ranges=ranges, choices=choices,
                                chooser=chooser, expose_activations=expose_activations, debug_dump=debug_dump,
                                require_int8=require_int8, check_graph=check_graph, exported=exported,
                                phases=as_phases(progress))
    s = pipeline.run(state, until="lower")
    return QuantizedModule(s.mod, s.report, s.amax, s.names, s.graph, s.context.images, s.model, s.context.held_out,
                           s.plan, s.exported)
