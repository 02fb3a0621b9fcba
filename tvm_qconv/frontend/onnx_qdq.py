"""Q/DQ ONNX models in: explicit quantization with the scales the file carries, no calibration.

A quantized ONNX file (this project's ``deploy.py export-onnx``, ONNX Runtime's ``quantize_static``
in QDQ format, NVIDIA ModelOpt, a QAT export) is its float graph with ``QuantizeLinear`` /
``DequantizeLinear`` (Q/DQ) nodes that say where each tensor is int8 and at which scale.  Here the
file becomes what the pipeline takes from a calibrated float model:

1. :func:`strip_qdq`: the float graph with the Q/DQ nodes taken out, and what they said.
   - a weight ``DequantizeLinear`` (an int8 initializer, a per-output-channel or per-tensor scale,
     zero point 0) becomes the float initializer ``q * s`` (exact in float32), its integers and
     scales kept by the node that reads it (``weights``: the library quantizes with them, not
     with scales of its own: ``graph.Layer.given_weight``);
   - a ``QuantizeLinear -> DequantizeLinear`` pair on an activation is bypassed, its tensor's
     range kept (``ranges``: ``127 * s`` for int8 at zero point 0 or uint8 at 128, ``255 * s`` for
     an unsigned tensor: uint8 at 0, int8 at -128, which also clamps at 0: a ReLU where nothing
     before it is one);
   - an int32 bias ``DequantizeLinear`` (``quantize_static``'s) becomes its float bias.
2. :func:`point_ranges`: the pipeline's calibration points (``graph.points``) matched to the
   file's tensors by value -- the float graph and ONNX Runtime run on one image, each point takes
   the range of the tensor that holds its values -- so no naming convention of any exporter is
   assumed.  A point the file gives no range for keeps the layers that read it float, by name.

Storage types other than int8 are read with their own range (:data:`INTEGER_RANGES`,
:data:`FLOAT_MAX`): an int16 activation at zero point 0 spans ``+-32767 * s``, a uint16 one at
zero point ``z`` from ``-z * s`` to ``(65535 - z) * s``; a uint8 / int16 / int4 / uint4 / float8
weight is dequantized with its own zero point, its integers not the library's.

What the project's scheme cannot honour is reported by node name with what was done instead
(``notes``), never changed silently: a weight stored in another type than int8 or asymmetric
(zero point not 0: dequantized, then requantized symmetric per channel to int8 by the library),
an activation stored in another type than int8 (its range read in that type, requantized to
the int8 per-tensor scheme), a per-channel activation scale or an asymmetric activation zero
point (its range taken over all channels / both ends: requantized to the symmetric per-tensor
scheme), a Q/DQ pattern of another shape (kept float, as the file's float computation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ranges.calibrate import FloatPoints
from ..data import skimage_photos
from ..errors import InputError

_QDQ = ("QuantizeLinear", "DequantizeLinear")

# The integer storage types of Q/DQ nodes (ONNX opset 21+ adds the 16-, 4- and 2-bit ones), by
# NumPy / ml_dtypes name: the integers each holds.
INTEGER_RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535),
                  "int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3)}
# The float storage types (no zero point, levels not uniform): their largest finite value.
FLOAT_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0,
             "float8_e5m2fnuz": 57344.0, "float4_e2m1fn": 6.0}


@dataclass
class StrippedQdq:
    """The float model of a Q/DQ file and what its Q/DQ nodes said (module docstring)."""

    proto: object                                   # onnx.ModelProto, float, no Q/DQ node
    ranges: dict = field(default_factory=dict)      # activation tensor name -> amax
    unsigned: set = field(default_factory=set)      # activation tensors the file keeps unsigned
    weights: dict = field(default_factory=dict)     # weight-reading node name -> (int8 q, float32 scales)
    notes: list = field(default_factory=list)       # what could not be honoured, by node name
    qdq_nodes: int = 0


def is_qdq(proto) -> bool:
    return any(n.op_type in _QDQ for n in proto.graph.node)


def _const(name: str, inits: dict, consts: dict):
    if name in inits:
        return numpy_helper.to_array(inits[name])
    return consts.get(name)


# Ops whose output is never negative where their data inputs never are: pools, moves of the
# values, and the Q/DQ pairs themselves (rounding keeps the sign; an unsigned store has none).
_KEEP_NON_NEGATIVE = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose",
                      "Squeeze", "Unsqueeze", "Identity", "Concat", "QuantizeLinear", "DequantizeLinear")


def _non_negative(node, inits: dict, consts: dict, producer: dict | None = None, depth: int = 0) -> bool:
    """Whether ``node``'s output is never negative by construction: a Relu, a Clip with min >= 0,
    or (with ``producer``, output name -> node) one of ``_KEEP_NON_NEGATIVE`` over such tensors
    (the project's own export: a max pool's unsigned output after the ReLU before it)."""
    if node is None:
        return False
    if node.op_type == "Relu":
        return True
    if node.op_type == "Clip" and len(node.input) > 1 and node.input[1]:
        lo = _const(node.input[1], inits, consts)
        return lo is not None and float(np.asarray(lo).reshape(-1)[0]) >= 0
    if producer is not None and node.op_type in _KEEP_NON_NEGATIVE and depth < 64:
        data = node.input if node.op_type == "Concat" else node.input[:1]
        return all(_non_negative(producer.get(x), inits, consts, producer, depth + 1) for x in data)
    return False


def _storage(dtype, node) -> str:
    """The storage type's name (``int16``...) of a Q/DQ node's integers or zero point.

    Raises:
        InputError: a type that neither table has (the node and the type named).
    """
    name = np.dtype(dtype).name
    if name not in INTEGER_RANGES and name not in FLOAT_MAX:
        raise InputError(f"node {node.name} ({node.op_type}) stores {name}, a type this build cannot read a range "
                         f"from; export the model's Q/DQ nodes as int8 (or {', '.join(INTEGER_RANGES)}, float8)")
    return name


def _zero_points(z: np.ndarray) -> str:
    return str(int(z.reshape(-1)[0])) if np.all(z == z.reshape(-1)[0]) else "per channel"


def _activation_range(storage: str, s: np.ndarray, z: np.ndarray) -> tuple[float, bool, bool, str]:
    """``(amax, unsigned, asymmetric, its range in words)`` of an activation stored as ``storage``
    at scales ``s`` (float64) and zero points ``z``: unsigned where the zero point is the type's
    lowest value (``[0, (hi - lo) * s]``), symmetric where it sits at the middle of the type's
    range (0 for a signed type, ``(hi + 1) / 2`` for an unsigned one: ``(hi - z) * s`` either
    way), else asymmetric (the larger end)."""
    if storage in FLOAT_MAX:
        top = FLOAT_MAX[storage]
        return float(np.max(top * s)), False, False, f"+-{top:g} x scale"
    lo, hi = INTEGER_RANGES[storage]
    if np.all(z == lo):
        return float(np.max((hi - lo) * s)), True, False, f"0..{hi - lo} x scale"
    middle = 0 if lo < 0 else (hi + 1) // 2
    if np.all(z == middle):
        return float(np.max((hi - middle) * s)), False, False, f"+-{hi - middle} x scale"
    amax = float(np.max(np.maximum(np.abs((lo - z) * s), np.abs((hi - z) * s))))
    return amax, False, True, f"{int(np.min(lo - z))}..{int(np.max(hi - z))} x scale"


def strip_qdq(proto) -> StrippedQdq:
    """The float graph of ``proto`` (a Q/DQ model whose nodes have unique names:
    ``onnx_model.OnnxModel`` names them; changed in place) and its scales.

    Raises:
        InputError: a Q/DQ node whose scale is not a constant.
    """
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    consts = {}
    for n in graph.node:        # Constant nodes: scales and zero points may be written as them
        value = next((a for a in n.attribute if a.name == "value"), None) if n.op_type == "Constant" else None
        if value is not None and value.type == onnx.AttributeProto.TENSOR:
            consts[n.output[0]] = numpy_helper.to_array(value.t)
    readers: dict = {}
    for n in graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    out = StrippedQdq(proto)
    producer = {o: n for n in graph.node for o in n.output}
    inserted: dict = {}         # a Q node -> the Relu that keeps its clamp at 0
    relus: dict = {}            # a tensor -> that Relu
    rename: dict = {}           # a DQ's output -> the float tensor it stands for

    def resolve(name: str) -> str:
        while name in rename:
            name = rename[name]
        return name
    drop = set()
    new_inits = []

    def scale_zero(node):
        s = _const(node.input[1], inits, consts)
        if s is None:
            raise InputError(f"node {node.name} ({node.op_type}): its scale {node.input[1]} is not a constant; "
                             "a Q/DQ file's scales must be constants")
        z = _const(node.input[2], inits, consts) if len(node.input) > 2 and node.input[2] else None
        # ONNX: the zero point's type is the storage's; without one, opset 21's output_dtype, else uint8 at 0
        output_dtype = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
        zdtype = z.dtype if z is not None else \
            helper.tensor_dtype_to_np_dtype(output_dtype) if output_dtype else np.dtype(np.uint8)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        return np.asarray(s, np.float32), (np.zeros_like(s, np.int64) if z is None else np.asarray(z, np.int64)), \
            zdtype, axis

    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:     # a weight or a bias
            q = numpy_helper.to_array(inits[node.input[0]])
            s, z, _, axis = scale_zero(node)
            shape = [1] * q.ndim
            if s.size > 1:
                shape[axis % q.ndim] = s.size
            storage = np.dtype(q.dtype).name
            # float8 values are read as the floats they are (int64 would truncate them), integers less their zero point
            levels = q.astype(np.float64) if storage in FLOAT_MAX else \
                q.astype(np.int64) - z.reshape(shape if z.size > 1 else [])
            w = (levels * s.reshape(shape if s.size > 1 else [])).astype(np.float32)
            name = node.output[0]
            new_inits.append(numpy_helper.from_array(w, name + "_float"))
            rename[name] = name + "_float"
            drop.add(node.name)
            out.qdq_nodes += 1
            users = readers.get(name, [])
            is_weight = q.ndim >= 2 and bool(users) and all(u.op_type in ("Conv", "Gemm", "MatMul") and
                                                            list(u.input).index(name) == 1 for u in users)
            if is_weight and storage != "int8":
                _storage(q.dtype, node)     # (a type with no known range is refused, named)
                out.notes.append(f"{node.name}: {storage} weight (zero point {_zero_points(z)}) dequantized with its "
                                 f"own type's range; the library requantizes it to int8 per output channel")
            elif is_weight:
                if np.any(z != 0):
                    out.notes.append(f"{node.name}: asymmetric weight (zero point not 0) dequantized; the library "
                                     "requantizes it symmetric per output channel")
                elif any(u.op_type == "MatMul" for u in users):
                    out.notes.append(f"{node.name}: a MatMul's weight ([K, O]); the library requantizes it per output "
                                     "channel")
                elif s.size > 1 and axis % q.ndim != 0:
                    out.notes.append(f"{node.name}: weight scales not per output channel (axis {axis}); the library "
                                     "requantizes it per output channel")
                else:
                    for u in users:
                        out.weights[u.name] = (q, np.broadcast_to(s.reshape(-1), (q.shape[0],)).astype(np.float32))
        elif node.op_type == "QuantizeLinear":
            dqs = readers.get(node.output[0], [])
            if not dqs or any(d.op_type != "DequantizeLinear" for d in dqs):
                continue    # not a Q -> DQ pair: left as it is (a note below)
            s, z, zdtype, axis = scale_zero(node)
            s = s.astype(np.float64)    # 127 * s exact (float32 would round it: a scale 1 ulp off)
            x = resolve(node.input[0])   # (a Q of a DQ's output: the tensor that DQ stands for)
            if s.size > 1:
                out.notes.append(f"{node.name}: per-channel activation scales; requantized to one scale per tensor "
                                 "(their largest range)")
            # in the storage's own range: [0, 255 s] for uint8 at 0 or int8 at -128, 32767 s for int16 at 0
            storage = _storage(zdtype, node)
            amax, unsigned, asymmetric, span = _activation_range(storage, s, z)
            if unsigned:
                out.unsigned.add(x)
            if asymmetric:
                typed = "" if storage == "int8" else f", {storage}"
                out.notes.append(f"{node.name}: asymmetric activation (zero point {_zero_points(z)}{typed}); "
                                 f"requantized symmetric over its range ({span} = +-{amax:.6g})")
            elif storage != "int8":
                out.notes.append(f"{node.name}: {storage} activation (zero point {_zero_points(z)}): its range is "
                                 f"{span} = {'0..' if unsigned else '+-'}{amax:.6g}; requantized to the library's "
                                 "int8 per-tensor scheme")
            clamped = {r.output[0] for r in relus.values()}    # (a pair after a pair: already a ReLU's output)
            if x in out.unsigned and x not in clamped and not _non_negative(producer.get(x), inits, consts, producer):
                # the pair clamps at 0 (ONNX Runtime folds a ReLU into it this way): the float graph
                # keeps that clamp as the ReLU it stands for, which the conv before absorbs (one
                # ReLU a tensor, however many pairs read it)
                if x not in relus:
                    relus[x] = helper.make_node("Relu", [x], [x + "_qdq_relu"], name=f"{node.name}_relu")
                    inserted[node.name] = relus[x]
                    out.unsigned.add(relus[x].output[0])
                x = relus[x].output[0]
            out.ranges[x] = max(out.ranges.get(x, 0.0), amax)
            drop.add(node.name)
            out.qdq_nodes += 1
            for d in dqs:
                rename[d.output[0]] = x
                drop.add(d.name)
                out.qdq_nodes += 1
    leftover = [n for n in graph.node if n.op_type in _QDQ and n.name not in drop]
    for n in leftover:
        out.notes.append(f"{n.name}: a {n.op_type} of another pattern; kept as the file's float computation")
    keep = []
    for n in graph.node:
        if n.name in inserted:
            keep.append(inserted[n.name])
        elif n.name not in drop:
            keep.append(n)
    for n in keep:
        for i, x in enumerate(n.input):
            if x in rename:
                n.input[i] = resolve(x)
    for o in graph.output:
        if o.name in rename:    # an output that was a DQ: the float tensor, under the output's name
            keep.append(helper.make_node("Identity", [resolve(o.name)], [o.name], name=f"{o.name}_identity"))
    used = {x for n in keep for x in n.input}
    del graph.node[:]
    graph.node.extend(keep)
    kept_inits = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits + [i for i in new_inits if i.name in used])
    return out


# The range of a point the file gives none for: a placeholder the plan requires and no kernel
# reads (file_scales keeps every layer that makes or reads such a point float).
UNUSED_RANGE = 1.0

# A point matches a file tensor when their values agree to this, relative to the tensor's largest
# magnitude: two runs of one float computation (ONNX Runtime's kernels against the graph's on
# llvm) differ by float32 rounding, ~1e-6; two different tensors of one shape differ by O(1).
MATCH_REL = 1e-3


def point_ranges(graph, model, stripped: StrippedQdq, image: np.ndarray) -> tuple[dict, dict]:
    """The file's range for every calibration point of ``graph`` (the float graph at batch 1) that
    holds the values of a tensor the file quantizes (module docstring, step 2).

    Returns:
        ``({point: amax}, {point: file tensor})`` for the points matched; the others are missing.
    """
    import onnxruntime as ort   # (an ONNX Runtime session is made only for a Q/DQ file: ~0.4 s to import)

    _, values = next(FloatPoints(graph)(image[None].astype(np.float32)))
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    have = {o.name for o in proto.graph.output}
    names = [t for t in stripped.ranges if t not in have and t != model.input_name]
    proto.graph.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in names)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # every tensor as the file has it
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    outs = session.run(None, {model.input_name: image[None].astype(np.float32)})
    tensors = {o.name: v for o, v in zip(session.get_outputs(), outs) if o.name in stripped.ranges}
    if model.input_name in stripped.ranges:
        tensors[model.input_name] = image[None].astype(np.float32)
    flat = {name: np.asarray(u, np.float32).reshape(-1) for name, u in tensors.items()}
    peak = {name: max(float(np.max(np.abs(u))) if u.size else 0.0, 1e-12) for name, u in flat.items()}
    amax, source = {}, {}
    for point, v in values.items():
        v = np.asarray(v, np.float32).reshape(-1)
        best, err = None, np.inf
        for name, u in flat.items():
            if u.size != v.size:
                continue
            e = float(np.max(np.abs(u - v)) / peak[name])
            if e < err:
                best, err = name, e
        if best is not None and err <= MATCH_REL:
            amax[point], source[point] = stripped.ranges[best], best
    return amax, source


@dataclass(frozen=True)
class FileScales:
    """A range source (``ranges.RangeSource``): the ranges a Q/DQ file gives, by point."""

    amax: dict = field(compare=False)
    report: dict = field(compare=False)
    tensors: dict = field(default_factory=dict, compare=False)    # point -> the file tensor it matched

    def resolve(self, ctx) -> tuple[dict, dict]:
        # nothing is calibrated; the build's verification runs on the first few photos
        ctx.images = skimage_photos(int(ctx.input_shape[-1]))
        return dict(self.amax), dict(self.report)

    def describe(self) -> str:
        return f"the Q/DQ file's scales ({len(self.amax)} points, no calibration)"

    def plan_notes(self, plan, graph) -> list[str]:
        """One note per layer the plan keeps float although the file quantizes its input: the
        file's tensor, the layer, and why (an op the kernels cannot take in int8, a skip)."""
        notes = []
        for lp in plan.layers:
            if not lp.why_float or getattr(lp, "fused_into", None) is not None:
                continue
            quantized = [self.tensors[graph.points[x]] for x in lp.layer.inputs
                         if x in graph.points and graph.points[x] in self.tensors]
            if quantized:
                notes.append(f"{', '.join(quantized)}: quantized in the file for {lp.layer.name}, which the library "
                             f"keeps float ({lp.why_float})")
        return notes


def file_scales(model, exported, config):
    """``(FileScales, config)`` of a Q/DQ ``model`` (``onnx_model.OnnxModel``): its ranges by point
    (:func:`point_ranges`, on one of scikit-image's photos at the model's size), and ``config``
    with the layers that read or make a point the file gives no range for kept float (its
    ``skip``), each named in the report."""
    if model._file_scales is None:      # once a process: the match runs two float graphs
        graph = exported.at(1).graph
        size = int(exported.sample_shape[-1])
        model._file_scales = point_ranges(graph, model, model.qdq, skimage_photos(size)[0])
    amax, source = (dict(x) for x in model._file_scales)
    graph = exported.at(1).graph
    missing = {var: name for var, name in graph.points.items() if name not in amax}
    skip = [ly.name for ly in graph.layers
            if ly.output in missing or any(x in missing for x in ly.inputs)]
    for name in missing.values():   # never read: every layer that makes or reads it is kept float
        amax[name] = UNUSED_RANGE
    notes = list(model.qdq.notes)
    if missing:
        notes.append(f"{len(missing)} point(s) the file gives no scale for ({', '.join(sorted(missing.values())[:4])}"
                     f"{' ...' if len(missing) > 4 else ''}): kept float" +
                     (f", with the layers {', '.join(skip[:4])}{' ...' if len(skip) > 4 else ''}" if skip else ""))
    given = sum(1 for ly in graph.layers if ly.given_weight is not None)
    report = dict(source="file", file=model.path, points=len(amax) - len(missing), qdq_nodes=model.qdq.qdq_nodes,
                  given_weights=given, kept_float=skip, notes=notes, calibrated=False)
    if skip:
        config = dataclasses.replace(config, skip=tuple(config.skip) + tuple(s for s in skip if s not in config.skip))
    if config.unsigned_activations is None:     # the default: the file's own scheme (its unsigned tensors, if any)
        config = dataclasses.replace(config, unsigned_activations=bool(model.qdq.unsigned))
    return FileScales(amax, report, source), config
