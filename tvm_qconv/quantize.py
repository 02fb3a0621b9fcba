"""The quantize pipeline: a float torch model in, the int8 Relax module out (weights still inline).

    torch model --torch.export--> Relax (float) --fold BN / constants--> analysis (graph.py)
      --range source (ranges.py: calibrate | given | learned)--> [GPTQ weight rounding on the
      calibration images (weight_rounding.py), the model exported again] --> the quantization plan (kernel
      per layer from the registry, for the target: quantization/) --> LowerToRelax (lowering/relax.py)

``build.py`` takes it from there (lift weights, schedule, compile, save); the tuner uses it to
find the kernels a model calls.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import numpy as np
import tvm

from .config import QuantConfig
from .errors import InputError
from .frontend import ExportedGraphs, as_frontend
from .graph import Graph
from .lowering import LowerToRelax
from .observers import quantize_weight_per_channel
from .progress import as_phases
from .ranges import Calibrate, RangeContext, RangeSource
from .ranges import describe as describe_ranges
from .target import TargetInfo
from .weight_rounding import gptq_model
from .quantization import QuantizationPlan, plan_quantization
from .quantization.epilogues import fuse_tables
from .quantization.norm_epilogues import fuse_layer_norms
from .quantization.residuals import fuse_residuals
from .quantization.zero_points import may_run_int8


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


def dump_ir(debug_dump: str | None, step: str, mod) -> None:
    """Write the IR after a numbered phase (``--debug-dump DIR``): a wrong fusion or layout is
    found by reading files, not by guessing."""
    if debug_dump:
        os.makedirs(debug_dump, exist_ok=True)
        with open(os.path.join(debug_dump, f"{step}.py"), "w") as f:
            f.write(mod.script(show_meta=False))


def check_skip(graph: Graph, config: QuantConfig, require_int8: bool = False) -> None:
    """Refuse a skip entry that matches no layer, or (``require_int8``: the CLIs) a skip list that
    matches every conv and linear layer, nothing left in int8, before anything is calibrated.
    From Python, ``skip=("*",)`` is a float build on purpose (the "quantization off equals
    float" reference).

    Raises:
        InputError: naming the entries and the layers there are.
    """
    names = [ly.name for ly in graph.layers]
    unknown = [p for p in config.skip if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unknown:
        listed = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense")]
        raise InputError(f"skip list entry {', '.join(map(repr, unknown))} matches no layer of this model; its "
                         f"conv and linear layers are {listed[:12]}{' ...' if len(listed) > 12 else ''}")
    quantizable = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense")]
    if require_int8 and quantizable and all(any(fnmatch.fnmatchcase(n, p) for p in config.skip) for n in quantizable):
        raise InputError(f"skip list {', '.join(map(repr, config.skip))} keeps all {len(quantizable)} conv and linear "
                         "layers of this model in float: nothing would run in int8; name fewer layers (e.g. "
                         f"--skip {quantizable[-1]} for the classifier alone)")


def float_graph(model, input_shape: tuple) -> Graph:
    """The analysis of ``model``'s float graph at ``input_shape`` (exported, BatchNorms folded)."""
    return as_frontend(model).export(input_shape).at(input_shape[0]).graph


def check_rounded(graph: Graph, integers: dict) -> None:
    """The folded graph's weights, rounded to nearest as the pass will, give GPTQ's integers.

    Raises:
        RuntimeError: naming a layer whose rounding the export lost (a bug, not bad input).
    """
    weights = {ly.name: ly.weight for ly in graph.layers if ly.weight is not None and ly.kind in ("conv2d", "dense")}
    for name, q in integers.items():
        if name not in weights or weights[name].size != q.size:
            raise RuntimeError(f"GPTQ: {name}'s rounded weights were not found again after export and folding")
        # a Linear layer may have become a 1x1 conv ([O, K] -> [O, K, 1, 1]), and a layer scale folded
        # into it (transform/channels_first.py) scales each row: the same integers, a negative scale negates them
        rows = quantize_weight_per_channel(weights[name])[0].reshape(q.shape[0], -1).astype(np.int16)
        want = q.reshape(q.shape[0], -1).astype(np.int16)
        if not np.all(np.all(rows == want, axis=1) | np.all(rows == -want, axis=1)):
            raise RuntimeError(f"GPTQ: {name}'s rounded weights were not found again after export and folding")


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
        require_int8: refuse a skip list that leaves no layer in int8 (:func:`check_skip`).
        progress: print each phase as it starts (a :class:`~tvm_qconv.progress.Phases` to share
            the build's, or a bool).
        exported: ``model`` already exported (``frontend.ExportedGraphs``): its graphs are reused
            (a build shares one between its library, its verification and the per-layer twin).
        check_graph: ``(Graph) -> None``, called on the float graph before any range is resolved:
            a caller's refusal (``onnx_export.check_exportable``) comes before the calibration it
            would waste.
    """
    phases = as_phases(progress)
    model = as_frontend(model)
    exported = exported if exported is not None else model.export(input_shape)
    batch = int(input_shape[0])
    with phases("export", f"{model.exporter} at {tuple(input_shape)} -> Relax"):
        dump_ir(debug_dump, "01_imported", exported.imported(batch)[0])
    with phases("simplify", "fold batch norms and constants, find the layers"):
        fg = exported.at(batch)
        mod, graph = fg.mod, fg.graph
    dump_ir(debug_dump, "02_simplified", mod)
    check_skip(graph, config, require_int8)
    if check_graph is not None:
        check_graph(graph)

    # the ranges a model carries (a Q/DQ file's, unless given), and the layers it leaves float kept
    # float in every rebuild
    own, config = model.own_ranges(exported, config)
    ranges = ranges if ranges is not None else own if own is not None else Calibrate()
    ctx = RangeContext(graph, tuple(input_shape), config, lambda: exported.at(1).graph, phases.enabled)
    with phases("ranges", describe_ranges(ranges, config)):
        amax, ranges_report = ranges.resolve(ctx)
    if config.bias_correction and ctx.channel_means is None:
        raise InputError(f"bias correction needs the inputs' means from calibration images; these ranges come from "
                         f"{ranges_report.get('source')}: calibrate (drop --checkpoint / given ranges) or turn "
                         "bias correction off")
    rounding = None
    if config.weight_rounding == "gptq":
        if model.module is None:
            raise InputError(f"GPTQ weight rounding rounds a torch model's layers; {model.name} is not one: round "
                             "to nearest (drop --weight-rounding gptq)")
        if ctx.images is None:
            raise InputError(f"GPTQ weight rounding needs calibration images; these ranges come from "
                             f"{ranges_report.get('source')}: calibrate (drop --checkpoint / given ranges) or round "
                             "to nearest")
        layers = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense") and may_run_int8(ly, config)]
        with phases("gptq", f"round the weights of {len(layers)} layers on the calibration images"):
            rounded, rounding, integers = gptq_model(model.module, ctx.images[: config.num_calib_images], layers)
            # the weights changed: the one export this build makes again
            model = model.with_module(rounded)
            exported = model.export(input_shape)
            fg = exported.at(batch)
            mod, graph = fg.mod, fg.graph
        dump_ir(debug_dump, "02b_weights_rounded", mod)
        check_rounded(graph, integers)
    with phases("quantize", f"choose int8 kernels for {target.kind} {target.arch or ''}".rstrip()):
        plan = plan_quantization(graph, amax, config, target, choices=choices, chooser=chooser,
                                 channel_means=ctx.channel_means if config.bias_correction else None)
        # tables, LayerNorms and residual adds into their convs' kernels, except where every layer's
        # output must exist to compare
        lowered = plan if expose_activations else fuse_residuals(fuse_layer_norms(fuse_tables(plan)))
        lower = LowerToRelax(lowered, expose_activations)
        qmod = lower(mod)
    dump_ir(debug_dump, "03_quantized", qmod)
    planned = lowered.report()
    if hasattr(ranges, "plan_notes"):     # a Q/DQ file: where the library keeps float what the file quantizes
        ranges_report = dict(ranges_report, notes=list(ranges_report.get("notes", [])) + ranges.plan_notes(plan, graph))
    report = dict(layers=planned["layers"], float_ops=lower.report["float_ops"],
                  float_op_details=lower.report["float_op_details"],
                  conversions=lower.report["conversions"], relayouts=lower.report["relayouts"],
                  unsigned=planned["unsigned"], unsigned_fallback=planned["unsigned_fallback"],
                  exposed=lower.report["exposed"], ranges=ranges_report)
    if rounding is not None:
        report["weight_rounding"] = rounding
    return QuantizedModule(qmod, report, amax, fg.names, graph, ctx.images, model, ctx.held_out, plan, exported)
