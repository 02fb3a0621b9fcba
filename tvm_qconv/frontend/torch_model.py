"""torch models in: an ``nn.Module`` (a torchvision classifier, a user's ``file.py:factory``) as a
:class:`~tvm_qconv.frontend.base.Frontend`, exported by ``torch.export`` into Relax
(``relax.frontend.torch.from_exported_program``).

    load(name) --> nn.Module --TorchModel--> probe (fake tensors), export (ExportedModel: one
      torch.export, a symbolic batch where two batches are needed), reference (the module on x)

The probe runs the model once on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and
dtypes, no data, no memory; a VGG16 at 224 px in ~30 ms), which tells, before anything is
exported or calibrated, whether it takes the shape at all (VGG16 at 16 px: its fifth max pool
would make 0x0), how much memory its largest activation needs, and what its ``forward`` returns:
one tensor, or a tuple / list / dict whose first tensor the build takes (:meth:`first_output`,
named in the report), or nothing usable (refused by name).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import sys
from typing import Iterator

import numpy as np
import torch
import torchvision
from torch._subclasses.fake_tensor import FakeTensorMode
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from ..errors import InputError, message_line
from ..fileio import file_kind
from .base import Probe, no_ranges
from .exported import ExportedGraphs

_CONV_TARGETS = {"aten.conv2d.default", "aten.convolution.default"}
_LINEAR_TARGETS = {"aten.linear.default"}


def list_models() -> list[str]:
    """torchvision classification model names (``vgg16``, ``resnet50``, ...)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


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
                         f"{message_line(err)}") from err
    fn = getattr(module, factory, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InputError(f"--model {spec!r}: {path} has no function or class {factory!r} (it has {names[:10]})")
    try:
        model = fn()
    except Exception as err:
        raise InputError(f"--model {spec!r}: {factory}() raised {type(err).__name__}: "
                         f"{message_line(err)}") from err
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"--model {spec!r}: {factory}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def accepts(name: str) -> bool:
    """Whether ``--model`` names a torch model: a ``path/to/file.py:factory`` or a torchvision name
    (anything that is not a file: an unknown name is refused by :func:`load` with the choices)."""
    return ".py:" in name or not os.path.isfile(name)


def load(name: str, weights: str | None = None, num_classes: int | None = None) -> torch.nn.Module:
    """A torchvision classifier (or a user's model) in eval mode.

    Args:
        name: torchvision model name, e.g. ``vgg16``; or ``path/to/file.py:factory``, a user's own
            ``nn.Module`` (:func:`load_user_model`).
        weights: None (random init), a path to a state-dict / checkpoint file, or a torchvision
            weight name such as ``DEFAULT`` or ``IMAGENET1K_V1``.
        num_classes: classifier width for random init (default: torchvision's, 1000).
    """
    if ".py:" in name:
        if num_classes is not None:
            raise InputError(f"--num-classes sets the width of a torchvision classifier; {name} builds its own model")
        model = load_user_model(name)
        if weights is not None:
            load_state_dict_file(model, weights)
        return model.eval()
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
    if num_classes is not None:     # the CLI refuses the two flags together before it loads anything
        raise InputError(f"num_classes sets the classifier's width for random init; torchvision's weights {weights!r} "
                         "come with their own (1000 ImageNet classes): leave num_classes out")
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
    digest = hashlib.blake2b(digest_size=10)
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class TorchModel:
    """A ``torch.nn.Module`` as a :class:`~tvm_qconv.frontend.base.Frontend` (eval mode)."""

    exporter = "torch.export"
    path = None         # not read from a file the compiler could pass on
    has_own_ranges = False
    fixed_size = None
    own_ranges = staticmethod(no_ranges)

    def __init__(self, module: torch.nn.Module, name: str | None = None):
        self.module = module.eval()
        self.name = name or type(module).__name__.lower()

    def probe(self, input_shape: tuple, name: str | None = None) -> Probe:
        """Run the module on a fake input of ``input_shape`` (module docstring).

        Raises:
            InputError: the model cannot take this shape, or returns no tensor.
        """
        name = name or self.name
        largest = [0, ""]
        paths = {m: p for p, m in self.module.named_modules()}

        def hook(module, args, out):
            found = _first_tensor(out)
            if found is not None and found[1].numel() * 4 > largest[0]:
                largest[:] = [found[1].numel() * 4, paths.get(module, "")]

        handles = [m.register_forward_hook(hook) for m in self.module.modules() if not list(m.children())]
        # torch logs the traceback of a shape check that fails on fake tensors (20 lines) before it
        # raises; the error below says it in one
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level, fake_log.level = fake_log.level, logging.CRITICAL
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
                out = self.module(torch.empty(tuple(input_shape), dtype=torch.float32))
                del mode
        except Exception as err:  # the model's own shape checks, in whatever type it raises them
            raise InputError(f"{name} cannot take input {tuple(input_shape)}: {type(err).__name__}: "
                             f"{message_line(err)}; choose another --image-size (224 is what ImageNet "
                             "classifiers are made for)") from None
        finally:
            fake_log.setLevel(level)
            for h in handles:
                h.remove()
        found = _first_tensor(out)
        if found is None:
            raise InputError(f"{name}'s forward returns {_describe(out)} with no tensor in it: the build needs the "
                             "logits as a tensor (or a tuple / dict whose first entry is)")
        return Probe(_describe(out), found[0], largest[0], largest[1])

    @contextlib.contextmanager
    def first_output(self, probe: Probe) -> Iterator[None]:
        """While inside, the module returns the first tensor of what its ``forward`` returns (a
        forward hook, removed afterwards; module paths, and so layer names, stay as they are)."""
        if probe.output_path == ():
            yield
            return

        def first(module, args, out):
            for key in probe.output_path:
                out = out[key]
            return out

        handle = self.module.register_forward_hook(first)
        try:
            yield
        finally:
            handle.remove()

    def input_notes(self, input_shape) -> list[str]:
        return []       # a module is exported at the build's shape: nothing it leaves open

    def report_note(self, probe: Probe) -> str | None:
        """The report's line about a model whose output is not one tensor (None: it is)."""
        if probe.output_path == ():
            return None
        where = "".join(f"[{k!r}]" for k in probe.output_path)
        return (f"forward returns {probe.output}: the library computes its first tensor, output{where}; the rest "
                "is dropped")

    def export(self, input_shape: tuple) -> "ExportedModel":
        return ExportedModel(self, input_shape)

    def reference(self, x: np.ndarray, device: str = "cpu", chunk: int | None = None) -> np.ndarray:
        """The module's first output tensor on ``x``, float32: on ``device`` (the module moves there
        for the call and back), ``chunk`` images at a time (None: all at once)."""
        module = self.module.to(device)
        x = np.ascontiguousarray(x, np.float32)
        step = chunk or max(len(x), 1)
        try:
            with torch.no_grad():
                outs = [_first_tensor(module(torch.from_numpy(x[i:i + step]).to(device)))[1].float().cpu().numpy()
                        for i in range(0, len(x), step)]
            return np.concatenate(outs)
        finally:
            self.module = module.cpu()

    def digest(self) -> str:
        return weights_digest(self.module)

    def image_size(self, requested: int | None) -> int:
        return requested or 224

    def with_module(self, module: torch.nn.Module) -> "TorchModel":
        return TorchModel(module, self.name)


def _first_tensor(out, path=()):
    """(path, tensor) of the first tensor in ``out`` (depth first), or None."""
    if isinstance(out, torch.Tensor):
        return path, out
    items = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, (tuple, list)) else ()
    for key, value in items:
        found = _first_tensor(value, (*path, key))
        if found is not None:
            return found
    return None


def _describe(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor {tuple(out.shape)}"
    if isinstance(out, (tuple, list, dict)):
        kind = type(out).__name__ if not hasattr(out, "_fields") else f"{type(out).__name__} (a named tuple)"
        return f"a {kind} of {len(out)}"
    return f"a {type(out).__name__}"


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




class ExportedModel(ExportedGraphs):
    """A torch model exported once, its float graph at every batch a build needs.

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

    def __init__(self, model, input_shape: tuple[int, int, int, int]):
        frontend = model if isinstance(model, TorchModel) else TorchModel(model)
        super().__init__(frontend, input_shape)
        self.model = frontend.module.eval()
        # batch 1 needs no symbolic batch: every graph a batch-1 build asks for is at batch 1
        self.dynamic: bool | None = None if int(input_shape[0]) > 1 else False
        self._program = None          # the symbolic-batch Relax module and its layer names

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


def _export(model, example, dynamic_shapes, what: str):
    try:
        with torch.no_grad():
            return torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes)
    except Exception as err:
        raise InputError(f"torch.export failed for {what}: {type(err).__name__}: {message_line(err)}") from err


def _import(ep):
    try:
        return from_exported_program(ep)
    except Exception as err:
        raise InputError(f"the Relax importer does not support this model: {type(err).__name__}: "
                         f"{message_line(err)}") from err


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


