"""torch model in, float Relax module out (torch.export -> relax.frontend.torch)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time

import torch
import torchvision
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from .errors import InputError
from .fileio import file_kind
from .graph import Graph, analyze
from .transform.channels_first import channels_first
from .transform.conv_bias_batch_norms import move_conv_biases_into_batch_norms
from .transform.fold_pads import fold_pads_into_convs
from .transform.global_means import keep_global_mean_dims
from .transform.identity_reshapes import drop_identity_reshapes

_CONV_TARGETS = {"aten.conv2d.default", "aten.convolution.default"}
_LINEAR_TARGETS = {"aten.linear.default"}


def list_models() -> list[str]:
    """torchvision classification model names (``vgg16``, ``resnet50``, ...)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _first_line(err: Exception, limit: int = 200) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def load_user_model(spec: str) -> torch.nn.Module:
    """The model a ``path/to/file.py:factory`` spec names: the file is imported and ``factory()``
    (a function or an ``nn.Module`` class taking no arguments) is called.

    Raises:
        InputError: the file, the factory or its result is not usable, with the reason.
    """
    path, _, factory = spec.rpartition(":")
    if not path.endswith(".py") or not factory.isidentifier():
        raise InputError(f"--model {spec!r}: write a user model as path/to/file.py:factory (a function or class "
                         "in that file that takes no arguments and returns the torch.nn.Module)")
    if not os.path.isfile(path):
        raise InputError(f"--model {spec!r}: {path} does not exist")
    module_name = "tvm_qconv_user_model_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    # registered before it runs, as a normal import is: dataclasses and pickling look it up there
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise InputError(f"--model {spec!r}: importing {path} failed: {type(err).__name__}: "
                         f"{_first_line(err)}") from err
    fn = getattr(module, factory, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InputError(f"--model {spec!r}: {path} has no function or class {factory!r} (it has {names[:10]})")
    try:
        model = fn()
    except Exception as err:
        raise InputError(f"--model {spec!r}: {factory}() raised {type(err).__name__}: "
                         f"{_first_line(err)}") from err
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model {spec!r}: {factory}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def load_model(name: str, weights: str | None = None, num_classes: int | None = None) -> torch.nn.Module:
    """A torchvision classifier (or a user's model) in eval mode.

    Args:
        name: torchvision model name, e.g. ``vgg16``; or ``path/to/file.py:factory``, a user's own
            ``nn.Module`` (:func:`load_user_model`); or ``path/to/model.onnx``, a float ONNX file
            (``onnx_import.OnnxModel``, which a build takes where it takes a module).
        weights: None (random init), a path to a state-dict / checkpoint file, or a torchvision
            weight name such as ``DEFAULT`` or ``IMAGENET1K_V1``.
        num_classes: classifier width for random init (default: torchvision's, 1000).
    """
    from .onnx_import import OnnxModel, is_onnx_path

    if is_onnx_path(name):
        if weights is not None or num_classes is not None:
            raise InputError(f"--model {name}: an ONNX file holds its weights and classifier; drop "
                             f"{'--weights' if weights is not None else '--num-classes'}")
        return OnnxModel(name)
    if ".py:" in name:
        if num_classes is not None:
            raise InputError(f"--num-classes sets the width of a torchvision classifier; {name} builds its own model")
        model = load_user_model(name)
        if weights is not None:
            load_state_dict_file(model, weights)
        return model.eval()
    if os.path.isfile(name):    # a file, but neither a model file (.py:factory) nor an ONNX model
        kind = file_kind(name)
        hint = (f"give path/to/file.py:factory, the function that returns the module ({name}:FACTORY)"
                if name.endswith(".py") else
                "give path/to/file.py:factory (your nn.Module) or an .onnx file (a float or Q/DQ model)")
        what = "names a Python file but no factory" if name.endswith(".py") else f"is {kind or 'a file'}, not a model"
        raise InputError(f"--model {name} {what}: {hint}")
    if name not in list_models():
        close = [m for m in list_models() if m.startswith(name[:3])][:8]
        raise InputError(f"unknown model {name!r}: choose a torchvision classifier such as {close or list_models()[:8]}, "
                         "or give your own as path/to/file.py:factory")
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    if weights is None or os.path.exists(weights) or os.sep in weights or weights.endswith((".pt", ".pth")):
        model = torchvision.models.get_model(name, weights=None, **kwargs)
        if weights is not None:
            load_state_dict_file(model, weights)
        return model.eval()
    try:
        enum = torchvision.models.get_model_weights(name)
        w = enum[weights] if weights != "DEFAULT" else enum.DEFAULT
    except (KeyError, ValueError) as err:
        names = [w.name for w in torchvision.models.get_model_weights(name)]
        raise InputError(f"{name} has no torchvision weights {weights!r} (it has {names + ['DEFAULT']}), "
                         f"and no file of that name exists: give a weight name or a checkpoint path") from err
    try:
        return torchvision.models.get_model(name, weights=w).eval()
    except Exception as err:  # network errors come in many types
        raise InputError(f"cannot fetch torchvision weights {w} ({type(err).__name__}: {err}); "
                         "download them elsewhere and pass the .pth file to --weights") from err


def load_state_dict_file(model: torch.nn.Module, path: str) -> dict:
    """Load a state dict (or a checkpoint dict with ``state_dict`` / ``model``) into ``model``.

    Args:
        model: the module to load into (strictly: every key, every shape).
        path: a file written by ``torch.save``.

    Returns:
        The whole checkpoint dict (a QAT checkpoint carries learned scales beside the weights).

    Raises:
        InputError: the file cannot be read, holds no state dict, or its tensors do not fit
            ``model``: one line counting them and naming a few missing, unexpected and
            shape-mismatched keys (not torch's list of every key).
    """
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        kind = file_kind(path)
        if kind is not None and kind != "a file torch.save wrote":   # a file of another kind in this slot
            onnx = "; an ONNX file is a model: give it as --model" if kind == "an ONNX model" else ""
            raise InputError(f"weights file {path} is {kind}, not a state dict: give a file saved with "
                             f"torch.save(model.state_dict(), path){onnx}") from None
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise InputError(f"cannot read weights file {path}: {type(err).__name__}: {reason}; "
                         "give a file saved with torch.save(model.state_dict(), path)") from err
    if not isinstance(ckpt, dict):
        raise InputError(f"weights file {path} holds a {type(ckpt).__name__}, not a state dict")
    state = ckpt.get("state_dict", ckpt.get("model", ckpt))
    if not isinstance(state, dict):
        raise InputError(f"weights file {path} holds a {type(state).__name__} where its state dict should be: "
                         "give a file saved with torch.save(model.state_dict(), path)")
    keys_shown_chars = 240  # at most this much of key names in the "does not fit" line

    def shape_of(value) -> str:  # 64x3x7x7; "scalar" for 0-d; the type's name for a non-tensor
        shape = getattr(value, "shape", None)
        return type(value).__name__ if shape is None else "x".join(str(d) for d in shape) or "scalar"

    def some(items: list[str], budget: int) -> str:  # "a, b, ... N more": what fits in budget chars (>= 1)
        shown: list[str] = []
        used = 0
        for item in items:
            if shown and used + len(item) + 2 > budget:
                break
            shown.append(item[:budget])
            used += len(shown[-1]) + 2
        rest = len(items) - len(shown)
        return ", ".join(shown) + (f", ... {rest} more" if rest else "")

    # The mismatch, by key, before loading: torch's own message lists every key (~15 KB for a
    # whole network of another architecture).  torch decides whether it fits (a module may
    # accept keys of its own, e.g. BatchNorm's num_batches_tracked in an old file): the
    # summary is used when it refuses.
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {shape_of(v)} (model {shape_of(expected[k])})" for k, v in state.items()
                  if k in expected and shape_of(v) != shape_of(expected[k])]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        groups = [(label, keys) for label, keys in (("missing", missing), ("unexpected", unexpected),
                                                    ("size mismatch", mismatched)) if keys]
        share = keys_shown_chars // max(len(groups), 1)
        listed = "; ".join(f"{label}: {some(keys, share)}" for label, keys in groups)
        if not groups:  # refused for another reason (a module's own check): torch's first line, cut short
            listed = (str(err).strip().splitlines() or [type(err).__name__])[0][:keys_shown_chars]
        kind = type(model).__name__
        counts = []
        if unexpected or mismatched:
            counts.append(f"{len(unexpected) + len(mismatched)} of its {len(state)} tensors do not match")
        if missing:
            counts.append(f"{len(missing)} of this {kind}'s {len(expected)} are missing")
        raise InputError(f"weights file {path} does not fit this model: {' and '.join(counts) or 'torch refuses it'} "
                         f"({listed}): were they saved from another architecture? give the "
                         f"weights of this {kind}") from err
    return ckpt


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of a model's parameters and buffers (names, dtypes, shapes, values): a built
    library records it, so a comparison can tell whether a library holds the weights of the float
    model it is compared with (two random inits of one architecture do not)."""
    if not isinstance(model, torch.nn.Module):  # an ONNX file (onnx_import.OnnxModel): its initializers
        return model.digest()
    digest = hashlib.blake2b(digest_size=10)
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def export_to_relax(model: torch.nn.Module, input_shape: tuple[int, int, int, int]):
    """torch.export the model at a static input shape and import it into Relax.

    Returns:
        (mod, names): the Relax IRModule with weights bound as constants, and
        ``{"conv2d": [...], "dense": [...]}``, the torch module paths of the conv and linear
        layers in graph order (the importer emits them in the same order).
    """
    model = model.eval()
    ep = _export(model, torch.zeros(input_shape), None, f"input shape {tuple(input_shape)}")
    return _import(ep), _layer_names(ep)


def exported_model(model, input_shape) -> "ExportedModel":
    """The build's one export of ``model``: a torch module's :class:`ExportedModel`, an ONNX file's
    ``onnx_import.OnnxExported`` (the same interface)."""
    from .onnx_import import OnnxExported, OnnxModel

    if isinstance(model, OnnxModel):
        return OnnxExported(model, input_shape)
    return ExportedModel(model, input_shape)


class ExportedModel:
    """A float model exported once, its float graph at every batch a build needs.

    A build needs its own batch and batch 1 (calibration, the verification's per-layer twin and
    its reference).  At batch 1 that is one static ``torch.export``.  At a larger batch the one
    export has a symbolic batch dimension, and each batch is that program imported into Relax
    with the batch bound -- the same module a static export at that batch gives
    (``tests/test_frontend.py``); a symbolic export costs ~1.5x a static one, so it is made only
    where two batches are needed.  Every batch is then folded (:func:`simplify`) and analysed
    (``graph.analyze``) once.  A model that fixes its batch (a reshape to a literal batch, say)
    cannot be exported with a symbolic one: it is exported at each batch instead (``dynamic``
    False).

    Attributes:
        model: the torch model (eval mode).
        exports, export_seconds: the torch.export calls made, and their time.
        dynamic: whether the one export has a symbolic batch (None: not exported yet).
    """

    def __init__(self, model: torch.nn.Module, input_shape: tuple[int, int, int, int]):
        self.model = model.eval()
        self.sample_shape = tuple(int(d) for d in input_shape[1:])
        self.exports, self.export_seconds = 0, 0.0
        # batch 1 needs no symbolic batch: every graph a batch-1 build asks for is at batch 1
        self.dynamic: bool | None = None if int(input_shape[0]) > 1 else False
        self._program = None          # the symbolic-batch Relax module and its layer names
        self._imported: dict = {}     # batch -> (imported Relax module, layer names)
        self._at: dict = {}           # batch -> FloatGraph

    def imported(self, batch: int):
        """(Relax module as imported, layer names) at ``batch``: the export's program with the
        batch bound (or, where the model fixes its batch, an export at ``batch``)."""
        batch = int(batch)
        if batch not in self._imported:
            shape = (batch, *self.sample_shape)
            if self.dynamic is None:
                self._program = self._export_dynamic()
                self.dynamic = self._program is not None
            if self.dynamic:
                mod, names = self._program
                self._imported[batch] = (_bind_batch(mod, batch), names)
            else:
                ep = self._timed(lambda: _export(self.model, torch.zeros(shape), None, f"input shape {shape}"))
                self._imported[batch] = (_import(ep), _layer_names(ep))
        return self._imported[batch]

    def at(self, batch: int) -> "FloatGraph":
        """The float graph at ``batch``: imported, simplified, its channels-last regions as NCHW
        ops (``transform/channels_first.py``) and the identity reshapes that leaves dropped
        (``transform/identity_reshapes.py``), analysed (made once per batch)."""
        batch = int(batch)
        if batch not in self._at:
            imported, names = self.imported(batch)
            mod, names = channels_first(simplify(imported), names)
            mod = drop_identity_reshapes(mod)
            graph = analyze(mod["main"], names)
            graph.kernels = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"}
            self._at[batch] = FloatGraph(imported, mod, names, graph)
        return self._at[batch]

    def _timed(self, export):
        t = time.perf_counter()
        try:
            return export()
        finally:
            self.exports += 1
            self.export_seconds += time.perf_counter() - t

    def _export_dynamic(self):
        """(Relax module with a symbolic batch, layer names), or None where the model fixes its batch."""
        # an example batch of 2: torch.export specializes a dimension of size 1
        example = torch.zeros((2, *self.sample_shape))
        batch = torch.export.Dim("batch", min=1, max=_MAX_BATCH)
        try:
            ep = self._timed(lambda: _export(self.model, example, ({0: batch},), "a symbolic batch"))
            return _import(ep), _layer_names(ep)
        except InputError:
            return None


# The largest batch the symbolic-batch export admits (a bound keeps torch.export's range analysis finite).
_MAX_BATCH = 1 << 16


class FloatGraph:
    """One batch's float graph: ``imported`` (as the importer gave it), ``mod`` (simplified),
    ``names`` (torch paths of the conv / linear layers) and ``graph`` (its analysis)."""

    def __init__(self, imported, mod, names: dict, graph: Graph):
        self.imported, self.mod, self.names, self.graph = imported, mod, names, graph


def _export(model, example, dynamic_shapes, what: str):
    try:
        with torch.no_grad():
            return torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes)
    except Exception as err:
        raise InputError(f"torch.export failed for {what}: {type(err).__name__}: {_first_line(err)}") from err


def _import(ep):
    try:
        return from_exported_program(ep)
    except Exception as err:
        raise InputError(f"the Relax importer does not support this model: {type(err).__name__}: "
                         f"{_first_line(err)}") from err


def _bind_batch(mod, batch: int):
    """``mod`` with its symbolic batch bound to ``batch`` (and the bounds the importer recorded on it dropped)."""
    (sym,) = relax.analysis.defined_symbolic_vars(mod["main"])
    mod = relax.transform.BindSymbolicVars({sym: batch})(mod)
    main = mod["main"]
    for attr in ("tir_var_lower_bound", "tir_var_upper_bound"):
        if main.attrs is not None and attr in main.attrs:
            main = main.without_attr(attr)
    mod["main"] = main
    return mod


def _layer_names(ep) -> dict:
    """``{"conv2d": [...], "dense": [...]}``: torch module paths of the conv and linear layers in graph order."""
    names = {"conv2d": [], "dense": []}
    for node in ep.graph_module.graph.nodes:
        target = str(node.target)
        kind = "conv2d" if target in _CONV_TARGETS else "dense" if target in _LINEAR_TARGETS else None
        if kind is None:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else f"{kind}_{len(names[kind])}"
        names[kind].append(path.removeprefix("L['self'].").replace("getattr(L['self'], '", "").replace("')", ""))
    return names


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

