"""export_onnx: the calibrated int8 model as ONNX, with explicit QuantizeLinear / DequantizeLinear
pairs carrying this project's own scales -- the "QDQ" form TensorRT and ONNX Runtime consume.

    float model --the build pipeline up to its plan (pipeline.py: prepare .. plan, llvm target)--> float graph
      + ranges + which layers are int8 --one ONNX node (or a few) per Relax binding--> model.onnx

It stops before the Relax lowering: the ONNX file is written from the plan (``lowering/onnx.py``), as
the library is (``lowering/relax.py``).

What the file holds, tensor by tensor: ``lowering/onnx.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.metadata import version

import onnx

from . import pipeline
from .config import QuantConfig
from .errors import InputError
from .fileio import atomic_path, check_output_file
from .lowering.onnx import EXPORTABLE_OPS, ONNXEmitter, op_name
from .pipeline import BuildState
from .progress import as_phases
from .ranges.sources import GivenRanges, LearnedRanges
from .target import TargetInfo, make_target
from .training.checkpoint import load_float_model

PRODUCER = "tvm_qconv"  # the files this exporter writes say so (ModelProto.producer_name)
# Opsets this exporter writes: 17 has LayerNormalization and per-channel QDQ; from 18 ReduceMean
# takes its axes as an input; 21 is the newest whose ops here TensorRT 10 and ONNX Runtime both read.
MIN_OPSET, MAX_OPSET = 17, 21
@dataclass
class ExportResult:
    """``path``: the file written; ``amax``: the range of every point (``{point: amax}``, as a
    build's ``meta["amax"]``); ``config``: the scheme with its defaults decided
    (``QuantConfig.resolved``); ``channel_means``: the calibration's (bias correction), or None;
    ``equalization``: the factors the graph was equalized with (``ranges/equalize.py``), or None.
    ``compile_model(model, config=res.config, ranges=res.given_ranges())`` builds the TVM library
    of the same model;
    ``summary``: what the file holds (``qdq_activations``: int8 activations, one QuantizeLinear
    each; ``int8_weights``: int8 weight initializers; ``int8_layers`` of ``layers``;
    ``float_layers``; ``float_ops``: the ops left in float, by Relax name, as a build report's;
    ``opset``; ``dynamic_batch`` and, where the batch had to stay static, ``static_batch_reason``;
    ``ranges``: where the ranges came from, as a build report's)."""

    path: str
    amax: dict
    summary: dict = field(default_factory=dict)
    config: QuantConfig | None = None
    channel_means: dict | None = None
    equalization: dict | None = None

    def given_ranges(self) -> GivenRanges:
        """The export's ranges (with channel means and equalization factors) as a range source for
        ``compile_model``."""
        return GivenRanges(self.amax, self.channel_means, self.equalization)


def check_exportable(graph) -> None:
    """Refuse a graph with an op this exporter has no ONNX form for, naming it.

    Raises:
        InputError: naming the op(s) and saying the model cannot be exported yet.
    """
    unknown = sorted({op_name(b.value) for b in graph.bindings} - set(EXPORTABLE_OPS))
    if unknown:
        raise InputError(f"this model cannot be exported to ONNX yet: the exporter has no ONNX form for "
                         f"{', '.join(unknown)} (tvm_qconv/onnx_export.py lists the ops it has); build a "
                         "TVM library instead (deploy.py build)")


def not_our_onnx(path: str) -> str | None:
    """Why the file at ``path`` is not an ONNX file this project's exporter wrote, or None:
    what ``export-onnx -o`` replaces only with ``--force``."""
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - any parse failure: it is not an ONNX file at all
        return "not an ONNX file"
    if proto.producer_name != PRODUCER:
        return f"an ONNX file written by {proto.producer_name or 'another program'}"
    return None


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
            a Q/DQ file's own scales, else calibrate on scikit-image's photos (as ``quantize_module``).
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
    check_output_file(out_path, "ONNX file")
    if len(input_shape) != 4 or min(int(d) for d in input_shape) < 1:
        raise InputError(f"input shape {tuple(input_shape)}: give (batch, channels, height, width), each >= 1")
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise InputError(f"opset {opset}: the exporter writes opsets {MIN_OPSET} to {MAX_OPSET}; choose one of them")
    name = name or (model if isinstance(model, str) else None)
    input_shape = tuple(int(d) for d in input_shape)
    # Exactly what a CPU build does up to its plan: the same graph, ranges and int8 / float decision per
    # layer; an op with no ONNX form is refused before calibration (check_graph)
    llvm = make_target("llvm")
    q = pipeline.run(BuildState(model, input_shape, TargetInfo.from_target(llvm), config=config, ranges=ranges,
                                target=llvm, name=name, require_int8=require_int8, check_input=True,
                                check_graph=check_exportable, phases=as_phases(progress, "export-onnx")),
                     until="plan")
    name, phases = q.name, q.phases
    phases.say(f"write: ONNX opset {opset} with QuantizeLinear / DequantizeLinear")
    emitter = ONNXEmitter(q.plan, input_shape, int(opset), dynamic_batch)
    graph = emitter.run()
    if emitter.static_reason is not None and dynamic_batch:
        # A reshape that moves the batch dimension: the whole file keeps the static shape.
        reason = emitter.static_reason
        emitter = ONNXEmitter(q.plan, input_shape, int(opset), False)
        graph = emitter.run()
        emitter.static_reason = reason
    opsets = [onnx.helper.make_opsetid("", int(opset))]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, producer_name=PRODUCER,
                                   producer_version=_version(),
                                   # the oldest IR version of the opset: the widest choice of readers
                                   ir_version=onnx.helper.find_min_ir_version_for(opsets))
    proto.doc_string = (f"{name}: int8 (per-channel weights, per-tensor activations) as QuantizeLinear / "
                        "DequantizeLinear pairs, exported by tvm_qconv")
    summary = dict(emitter.summary(), ranges=q.ranges_report)
    meta = {"producer": "tvm_qconv", "model": name, "scheme": json.dumps(q.config.to_dict(), sort_keys=True),
            "ranges": json.dumps(q.ranges_report, sort_keys=True, default=str),
            "input_shape": json.dumps(list(input_shape)), "dynamic_batch": json.dumps(summary["dynamic_batch"]),
            # the range of every point: GivenRanges(json.loads(...)) rebuilds the same model as a TVM library
            "amax": json.dumps({k: float(v) for k, v in q.amax.items()}, sort_keys=True)}
    if q.context.equalization:     # the weights in the file are the equalized graph's (ranges/equalize.py)
        meta["equalization"] = json.dumps({k: [float(x) for x in v] for k, v in q.context.equalization.items()})
    onnx.helper.set_model_props(proto, meta)
    onnx.checker.check_model(proto, full_check=True)  # before anything is written: a bad proto is never a file
    with atomic_path(out_path, suffix=".onnx") as tmp:
        onnx.save(proto, tmp)
    return ExportResult(out_path, dict(q.amax), summary, q.config, q.context.channel_means, q.context.equalization)


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
        return version("tvm_qconv")
    except Exception:  # a source tree that is not installed
        return "source"
