"""ONNX classifiers in: a float (or Q/DQ) ``.onnx`` file as a :class:`~tvm_qconv.frontend.base.Frontend`,
through TVM's Relax ONNX frontend.

    model.onnx --onnx.load + checks--> OnnxModel --relax.frontend.onnx.from_onnx at the build's
      shape--> Relax (float) --the same steps as a torch model's (exported.ExportedGraphs.at:
      fold, channels first, analysis)--> calibration, plan, kernels, verification, report

What the build asks of a model, :class:`OnnxModel` answers from the file:

- its float graph at a batch (:class:`OnnxExported`), imported with the batch bound where the
  file leaves it symbolic;
- the float logits the library is verified against (:meth:`OnnxModel.reference`): ONNX Runtime's
  CPU result, the file's own runtime, not TVM's reading of it;
- the probe before any long work (:meth:`OnnxModel.probe`: the output, the largest activation,
  from the imported graph) and a digest of its weights;
- a Q/DQ file's own ranges (:meth:`OnnxModel.own_ranges`, ``onnx_qdq.py``).

Layer names are the ONNX nodes' (``/layer1/layer1.0/conv1/Conv``), in the order the frontend
emits the convs and matrix products, which is the file's node order.

Bad input gets one line (:class:`~tvm_qconv.errors.InputError`): a file that is not an ONNX model,
one larger than the memory that is free, an op the frontend has no converter for (named, with
its nodes), an input that is not one float32 NCHW image tensor, a static shape other than the
build's, a file in ONNX's QOperator format (``QLinearConv``...).  A Q/DQ file (``QuantizeLinear`` /
``DequantizeLinear``) is built with its own scales: ``onnx_qdq.py``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os

import numpy as np
import psutil
import torch
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from ..errors import InputError, message_line
from ..graph import static_shape
from ..transform.clips import clips_from_min_max
from .base import Probe, unchanged_output
from .exported import ExportedGraphs
from .onnx_qdq import file_scales, is_qdq, strip_qdq

# ONNX's TensorProto.FLOAT
_FLOAT = 1
# ops of ONNX's other quantized format (QOperator): integer ops with their scales inside
_QOPERATOR_OPS = {"QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QLinearAdd", "QGemm"}
# A file loads into memory once as protobuf, once as the Relax constants: refuse one whose size
# times this does not fit the memory that is free.
_LOAD_COPIES = 3


def is_onnx_path(name: str) -> bool:
    """Whether a ``--model`` names an ONNX file (by its extension)."""
    return isinstance(name, str) and name.lower().endswith(".onnx")


accepts = is_onnx_path


def load(name: str, weights: str | None = None, num_classes: int | None = None) -> "OnnxModel":
    """The ONNX file ``name`` (the file holds its weights and classifier: neither can be given)."""
    if weights is not None or num_classes is not None:
        raise InputError(f"--model {name}: an ONNX file holds its weights and classifier; drop "
                         f"{'--weights' if weights is not None else '--num-classes'}")
    return OnnxModel(name)


class OnnxModel:
    """A float ONNX classifier: one float32 NCHW image input, logits out (the first output).

    Attributes:
        path: the file; name: its file name.
        proto: the loaded ``onnx.ModelProto`` (its outputs cut to the first).
        input_name: the image input's name.
        input_dims: the file's input dimensions, ints where static, names where symbolic.
        outputs_note: the report's line when the file has several outputs (None: one).
    """

    exporter = "TVM's ONNX frontend"
    module = None       # no torch module: GPTQ and PyTorch's timings do not apply
    first_output = staticmethod(unchanged_output)   # the first output is kept at load

    def __init__(self, path: str):
        import onnx

        self.path = path
        self.name = os.path.basename(path)
        if not os.path.isfile(path):
            raise InputError(f"--model {path}: no such file")
        size = _file_bytes(path)
        free = psutil.virtual_memory().available
        if size * _LOAD_COPIES > free:
            raise InputError(f"--model {path}: the file holds {size / 1e9:.1f} GB of weights; loading and importing it "
                             f"needs about {size * _LOAD_COPIES / 1e9:.1f} GB, this machine has {free / 1e9:.1f} GB free")
        try:
            proto = onnx.load(path)
        except Exception as err:
            raise InputError(f"--model {path} is not an ONNX model: {type(err).__name__}: {message_line(err)}") from None
        if not proto.graph.node:
            raise InputError(f"--model {path} is not an ONNX model with a graph (it has no nodes)")
        _name_nodes(proto)
        self.proto = proto
        self.qdq = None     # a Q/DQ file: its float graph's scales (onnx_qdq.StrippedQdq)
        self._file_scales = None    # onnx_qdq.file_scales's match, once
        if is_qdq(proto):
            self.qdq = strip_qdq(proto)
        self._check_ops()
        self.input_name, self.input_dims = self._image_input()
        outputs = list(proto.graph.output)
        self.outputs_note = None
        if len(outputs) > 1:
            self.outputs_note = (f"the file has {len(outputs)} outputs ({', '.join(o.name for o in outputs[:4])}"
                                 f"{' ...' if len(outputs) > 4 else ''}): the library computes the first, "
                                 f"{outputs[0].name}; the rest is dropped")
            del proto.graph.output[1:]
        self._imported: dict = {}   # input shape -> Relax module as imported
        self._last_shape = None     # the input shape of the latest import: the build's
        self._session = None
        self._folded_proto = None   # the graph with its constants folded, where the plain one did not import
        self._names_from = self.proto   # the graph the imported modules came from (names its layers)

    # -- what the build asks of a model (frontend.base.Frontend) -----------------------------------

    @property
    def has_own_ranges(self) -> bool:
        return self.qdq is not None

    @property
    def fixed_size(self) -> int | None:
        h, w = self.input_dims[2:]
        return h if isinstance(h, int) and h == w else None

    def export(self, input_shape) -> "OnnxExported":
        return OnnxExported(self, input_shape)

    def own_ranges(self, exported, config):
        """A Q/DQ file's ranges by point and the config that keeps what it leaves float
        (``onnx_qdq.file_scales``); a float file carries none."""
        return file_scales(self, exported, config) if self.qdq is not None else (None, config)

    def report_note(self, probe: Probe) -> str | None:
        return self.output_note

    def input_notes(self, input_shape) -> list[str]:
        """The lines a build starts with where the file leaves the batch or the image size open."""
        notes = []
        if isinstance(self.input_dims[0], str):
            notes.append(f"{self.path} has a dynamic batch ({self.input_dims[0]}): the library is built for batch "
                         f"{input_shape[0]} (--batch sets it)")
        if any(isinstance(d, str) for d in self.input_dims[2:]):
            notes.append(f"{self.path} has a dynamic height and width: the library is built at {input_shape[2]} x "
                         f"{input_shape[3]} (--image-size sets it)")
        return notes

    def with_module(self, module):
        raise TypeError(f"{self.path} is an ONNX file: it has no torch module to take weights from")

    def eval(self) -> "OnnxModel":
        """Itself (a torch module's ``eval()``, which callers holding either may call)."""
        return self

    def reference(self, x: np.ndarray, device: str = "cpu", chunk: int | None = None) -> np.ndarray:
        """The float logits of ``x`` (NCHW float32), by ONNX Runtime on the CPU (whatever
        ``device``), ``chunk`` images at a time (None: all at once)."""
        x = np.ascontiguousarray(x, np.float32)
        step = chunk or max(len(x), 1)
        return np.concatenate([np.asarray(self(torch.from_numpy(x[i:i + step])), np.float32)
                               for i in range(0, len(x), step)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The float logits of ``x`` (NCHW float32), by ONNX Runtime on the CPU."""
        if self._session is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3      # its warnings about unused initializers are not the user's
            self._session = ort.InferenceSession(self.proto.SerializeToString(), options,
                                                 providers=["CPUExecutionProvider"])
        arr = np.ascontiguousarray(x.detach().cpu().numpy(), np.float32)
        if not len(arr):
            raise ValueError("no images to run")
        fixed = self.input_dims[0] if isinstance(self.input_dims[0], int) and self.input_dims[0] > 0 else len(arr)
        outs = []
        for start in range(0, len(arr), fixed):     # a file that fixes its batch runs in batches of that size
            part = arr[start:start + fixed]
            pad = fixed - len(part)
            if pad:
                part = np.concatenate([part, np.zeros((pad, *part.shape[1:]), np.float32)])
            outs.append(self._session.run(None, {self.input_name: part})[0][:fixed - pad])
        return torch.from_numpy(np.concatenate(outs))

    def digest(self) -> str:
        """A short hash of the file's weights (names, types, shapes, bytes): ``frontend.weights_digest``."""
        from onnx import numpy_helper

        h = hashlib.blake2b(digest_size=10)
        for init in self.proto.graph.initializer:
            a = numpy_helper.to_array(init)
            h.update(f"{init.name}:{a.dtype}:{a.shape};".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    @property
    def input_note(self) -> str | None:
        """``input: ...``, the report's line when the file leaves the image's height or width
        dynamic: the size the library was built at, which the file did not fix (None: it fixes
        both, or nothing was imported yet)."""
        dynamic = {axis: d for axis, d in zip(("height", "width"), self.input_dims[2:]) if not isinstance(d, int)}
        if not dynamic or self._last_shape is None:
            return None
        h, w = self._last_shape[2:]
        return (f"input: {os.path.basename(self.path)} has a dynamic {' and '.join(dynamic)} "
                f"({', '.join(str(d) for d in dynamic.values())}): the library is built at {h} x {w} "
                "(--image-size sets it)")

    @property
    def output_note(self) -> str | None:
        """The report's lines about the file's interface (``report["output"]``, which
        ``report.format_report`` prints): :attr:`input_note`, then :attr:`outputs_note`."""
        return "\n".join(n for n in (self.input_note, self.outputs_note) if n) or None

    def image_size(self, requested: int | None) -> int:
        """The build's input height = width: the file's where it fixes them, else ``requested``
        (default 224, what ImageNet classifiers are made for; the build's report says so:
        :attr:`input_note`).

        Raises:
            InputError: a requested size the file's static one contradicts, or a non-square input.
        """
        h, w = self.input_dims[2:]
        if isinstance(h, int) and isinstance(w, int):
            if h != w:
                raise InputError(f"{self.path}: input {self.input_name} is {h}x{w}; builds take square images "
                                 f"(height = width)")
            if requested is not None and requested != h:
                raise InputError(f"{self.path} fixes its input at {h}x{w}; drop --image-size {requested} or give "
                                 f"--image-size {h} (or export the model with a dynamic height and width)")
            return h
        return requested or 224

    def shape_at(self, input_shape) -> tuple[int, int, int, int]:
        """``input_shape`` checked against the file's static dimensions.

        Raises:
            InputError: a dimension the file fixes to another value, naming it and what to do.
        """
        shape = tuple(int(d) for d in input_shape)
        for axis, (want, have) in enumerate(zip(shape, self.input_dims)):
            if isinstance(have, int) and have != want:
                what = ("batch", "channels", "height", "width")[axis]
                fix = (f"build with --batch {have}, or export the model with a dynamic batch" if axis == 0
                       else f"give --image-size {have}" if axis >= 2 else "the calibration images are RGB")
                raise InputError(f"{self.path} fixes its input's {what} at {have}, the build asks for {want}: {fix}")
        return shape

    def relax(self, input_shape):
        """The float Relax module at ``input_shape`` (TVM's ONNX frontend, weights as constants), made once a shape."""

        shape = self.shape_at(input_shape)
        self._last_shape = shape
        if shape not in self._imported:
            try:
                # the frontend prints a failing op's inputs before it raises: the error below says it in a line
                with contextlib.redirect_stdout(io.StringIO()):
                    mod = from_onnx(self.proto, shape_dict={self.input_name: list(shape)}, keep_params_in_input=False)
            except Exception as err:
                # The frontend wants some inputs constant (Pad's pads, Reshape's shape) that an
                # exporter may leave as a small computation on constants (torch's opset-13 Pad):
                # once more with the graph's constants folded by ONNX Runtime
                if self._folded_proto is None:
                    self._folded_proto = self._folded()
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        mod = from_onnx(self._folded_proto, shape_dict={self.input_name: list(shape)},
                                        keep_params_in_input=False)
                    self._names_from = self._folded_proto
                except Exception:
                    raise InputError(f"TVM's ONNX frontend cannot import {self.path} at input {shape}: "
                                     f"{type(err).__name__}: {message_line(err)}") from None
            # Clip's bounds folded to constants, then read as the clip it is (transform/clips.py)
            self._imported[shape] = clips_from_min_max(relax.transform.FoldConstant()(mod))
        return self._imported[shape]

    def _folded(self):
        """The model with its constant subgraphs folded (ONNX Runtime's basic graph optimizations:
        constant folding and redundant nodes; the same values)."""
        import tempfile

        import onnx
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as tmp:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.optimized_model_filepath = os.path.join(tmp, "folded.onnx")
            ort.InferenceSession(self.proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
            folded = onnx.load(options.optimized_model_filepath)
        _name_nodes(folded)
        return folded

    def layer_names(self) -> dict:
        """``{"conv2d": [...], "dense": [...]}``: the conv and matrix-product nodes' names in the order
        of the graph the modules were imported from; a matrix product counts where its weight is
        a constant, as ``graph.py``'s dense layers (the convs' weights may be computed, their ops
        are layers all the same)."""
        graph = self._names_from.graph
        weights = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                          for o in n.output}
        names: dict = {"conv2d": [], "dense": []}
        for node in graph.node:
            if node.op_type == "Conv":
                names["conv2d"].append(node.name)
            elif node.op_type in ("Gemm", "MatMul") and len(node.input) > 1 and node.input[1] in weights:
                names["dense"].append(node.name)
        return names

    def probe(self, input_shape, name: str | None = None) -> Probe:
        """The output and the largest activation, from the graph imported at ``input_shape``."""
        name = name or self.path

        mod = self.relax(input_shape)
        largest = [0, ""]
        for block in mod["main"].body.blocks:
            for b in block.bindings:
                shape = static_shape(b.var.ty)
                if shape is not None and int(np.prod(shape)) * 4 > largest[0]:
                    largest[:] = [int(np.prod(shape)) * 4, str(b.var.name)]
        ret = static_shape(mod["main"].body.body.ty)
        if ret is None:
            raise InputError(f"{name}'s first output is not one tensor of a static shape: the build needs the "
                             "logits as a tensor")
        out = f"a tensor {ret}"
        return Probe(out, (), largest[0], largest[1])

    # -- checks at load ---------------------------------------------------------------------------

    def _check_ops(self) -> None:
        from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

        nodes: dict = {}
        for node in self.proto.graph.node:
            nodes.setdefault(node.op_type, []).append(node.name or "(unnamed)")
        qop = sorted(set(nodes) & _QOPERATOR_OPS)
        if qop:
            raise InputError(f"{self.path} is quantized in ONNX's QOperator format ({', '.join(qop)}: e.g. node "
                             f"{nodes[qop[0]][0]}); builds take float files and Q/DQ files (QuantizeLinear / "
                             "DequantizeLinear): export it in QDQ format (quantize_static(..., quant_format=QDQ))")
        known = _get_convert_map()
        missing = sorted(op for op in nodes if op not in known)
        if missing:
            listed = "; ".join(f"{op} ({', '.join(nodes[op][:2])}{' ...' if len(nodes[op]) > 2 else ''})"
                               for op in missing[:5])
            raise InputError(f"{self.path} uses ops TVM's ONNX frontend has no converter for: {listed}; replace them "
                             "in the model (or export it at another opset)")

    def _image_input(self) -> tuple[str, list]:
        graph = self.proto.graph
        weights = {i.name for i in graph.initializer}
        inputs = [i for i in graph.input if i.name not in weights]
        if len(inputs) != 1:
            raise InputError(f"{self.path} takes {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); a classifier "
                             "build takes one image tensor")
        (inp,) = inputs
        ttype = inp.type.tensor_type
        if ttype.elem_type != _FLOAT:
            import onnx

            raise InputError(f"{self.path}: input {inp.name} is {onnx.TensorProto.DataType.Name(ttype.elem_type)}; "
                             "builds take a float32 image (export the float32 model)")
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in ttype.shape.dim]
        if len(dims) != 4:
            raise InputError(f"{self.path}: input {inp.name} has shape {dims}; builds take one NCHW image batch "
                             "(4 dimensions)")
        if isinstance(dims[1], int) and dims[1] != 3:
            raise InputError(f"{self.path}: input {inp.name} has {dims[1]} channels; the calibration images are RGB "
                             "(3 channels, NCHW): a channels-last (NHWC) input must be transposed in the model")
        return inp.name, dims


class OnnxExported(ExportedGraphs):
    """The float graphs of an :class:`OnnxModel`: each batch imported by TVM's ONNX frontend."""

    def __init__(self, model: OnnxModel, input_shape):
        super().__init__(model, input_shape)
        self.model = model
        self.dynamic = False

    def imported(self, batch: int):
        batch = int(batch)
        if batch not in self._imported:
            shape = (batch, *self.sample_shape)
            mod = self._timed(lambda: self.model.relax(shape))
            self._imported[batch] = (mod, self.model.layer_names())
        return self._imported[batch]

    def annotate(self, fg):
        """In a Q/DQ file's graph each conv and linear layer the file gives integers for takes them
        (``graph.Layer.given_weight``) where its float weight is exactly theirs (a transform
        between, e.g. a folded scale, would make it another weight)."""
        qdq = self.model.qdq
        if qdq is not None:
            for ly in fg.graph.layers:
                given = qdq.weights.get(ly.name)
                if given is None or ly.weight is None:
                    continue
                q, s = given
                q2 = q.reshape(q.shape[0], -1)
                if ly.weight.shape[0] == q.shape[0] and ly.weight.size == q.size and np.array_equal(
                        ly.weight.reshape(q.shape[0], -1), (q2 * s[:, None]).astype(np.float32)):
                    ly.given_weight = (q.reshape(ly.weight.shape).astype(np.int8), s)
        return fg


def _name_nodes(proto) -> None:
    """Give every node a unique name (``<op>_<index>`` where it has none or shares one): layers,
    notes and the Q/DQ bookkeeping are by node name."""
    seen = set()
    for i, node in enumerate(proto.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def _file_bytes(path: str) -> int:
    """The file's size plus its external data's where it is kept as the exporters name it
    (``model.onnx.data``, ``model.data`` beside ``model.onnx``): checked before anything is loaded."""
    size = os.path.getsize(path)
    for data in (path + ".data", os.path.splitext(path)[0] + ".data"):
        if os.path.isfile(data):
            size += os.path.getsize(data)
    return size
