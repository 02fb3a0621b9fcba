"""Float models in: every kind of model the compiler takes, behind one interface.

    --model NAME --> load_model (the first frontend of FRONTENDS that accepts it) --> the model
    (a torch.nn.Module, an OnnxModel) --as_frontend--> Frontend (base.py): probe, export,
    reference, digest, image size, own ranges

``torch_model.py`` (``torch.export``) and ``onnx_model.py`` (TVM's ONNX frontend, Q/DQ files through
``onnx_qdq.py``) implement :class:`~tvm_qconv.frontend.base.Frontend`; ``exported.py`` holds what
every frontend's float graph goes through after import.  Adding a kind of model (a TFLite or
Keras file) is one file with ``accepts(name)``, ``load(name, weights, num_classes)`` and a class
implementing the interface, and one entry in :data:`FRONTENDS` (``docs/design.md`` section 9).
"""
from __future__ import annotations

import torch

from ..errors import InputError
from ..fileio import file_kind
from . import onnx_model, torch_model
from .base import Frontend, Probe
from .exported import ExportedGraphs, FloatGraph, simplify
from .onnx_model import OnnxExported, OnnxModel, is_onnx_path
from .torch_model import (ExportedModel, TorchModel, export_to_relax, list_models, load_state_dict_file,
                          load_user_model, weights_digest)

# The frontends, in the order they are asked: each module has accepts(name) and load(name, weights,
# num_classes).  The torch one accepts what is not a file (a torchvision name) last.
FRONTENDS = (onnx_model, torch_model)

__all__ = ["FRONTENDS", "ExportedGraphs", "ExportedModel", "FloatGraph", "Frontend", "OnnxExported", "OnnxModel",
           "Probe", "TorchModel", "as_frontend", "export_to_relax", "exported_model", "is_onnx_path", "list_models",
           "load_model", "load_state_dict_file", "load_user_model", "simplify", "weights_digest"]


def load_model(name: str, weights: str | None = None, num_classes: int | None = None):
    """The model ``--model`` names, in eval mode: a torchvision classifier name (``vgg16``), the
    user's ``path/to/file.py:factory``, or an ``.onnx`` file (float or Q/DQ).

    Args:
        weights: None (random init), a state-dict / checkpoint file, or a torchvision weight name
            (``DEFAULT``, ``IMAGENET1K_V1``).
        num_classes: the classifier's width for a random init (default: torchvision's, 1000).

    Returns:
        the model (a ``torch.nn.Module``, an ``OnnxModel``): :func:`as_frontend` gives its interface.

    Raises:
        InputError: a file of another kind, an unknown name (with the choices), weights that do not fit.
    """
    for frontend in FRONTENDS:
        if frontend.accepts(name):
            return frontend.load(name, weights, num_classes)
    kind = file_kind(name)      # a file no frontend takes: say what it is
    if name.endswith(".py"):
        raise InputError(f"--model {name} names a Python file but no factory: give path/to/file.py:factory, the "
                         f"function that returns the module ({name}:FACTORY)")
    raise InputError(f"--model {name} is {kind or 'a file'}, not a model: give path/to/file.py:factory (your "
                     "nn.Module) or an .onnx file (a float or Q/DQ model)")


def as_frontend(model, name: str | None = None) -> Frontend:
    """The :class:`Frontend` of ``model``: itself where it is one (an ``OnnxModel``), a
    ``TorchModel`` of a ``torch.nn.Module``, the loaded model of a ``--model`` name.

    Raises:
        TypeError: anything else.
    """
    if isinstance(model, str):
        return as_frontend(load_model(model), name or model)
    if isinstance(model, Frontend):
        return model
    if isinstance(model, torch.nn.Module):
        return TorchModel(model, name)
    raise TypeError(f"a model is a torch.nn.Module, an ONNX file's OnnxModel or a --model name, not a "
                    f"{type(model).__name__}")


def exported_model(model, input_shape) -> ExportedGraphs:
    """The one export of ``model`` (any kind :func:`as_frontend` takes) at ``input_shape``."""
    return as_frontend(model).export(input_shape)
