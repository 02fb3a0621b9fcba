"""What the compiler asks of a float model, whatever it was written in: the :class:`Frontend`
interface, and :class:`Probe`, what a model says of itself at an input shape before any work.

The build, calibration, the verification, ``compare``, ``eval`` and the CLIs hold a model only
through this interface: nothing outside ``tvm_qconv/frontend/`` asks which kind of model it is.
A capability a kind has or lacks is a member here (``module`` is None where there is no torch
module to round or time; ``has_own_ranges`` where the file carries its scales).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:   # (types only: the frontends import these modules, not the other way)
    import torch

    from ..config import QuantConfig
    from .exported import ExportedGraphs


@dataclass(frozen=True)
class Probe:
    """What a model says of itself at an input shape, before anything is exported or calibrated.

    Attributes:
        output: how its output reads (``"a tensor (1, 1000)"``, ``"a tuple of 2"``).
        output_path: where the first tensor is in it (``()`` for a tensor, ``(0,)`` for a tuple's
            first item, ``("logits",)`` for a dict's entry).
        largest_bytes: the largest activation it makes (float32 at the input shape).
        largest_layer: where it makes it.
    """

    output: str
    output_path: tuple
    largest_bytes: int
    largest_layer: str


@runtime_checkable
class Frontend(Protocol):
    """A float model the compiler takes.

    Attributes:
        name: how the model is named in reports, libraries and messages.
        path: the file the model was read from, where another tool can run that file as it is (an
            ONNX file: ONNX Runtime and TensorRT rows), else None.
        exporter: what turns it into Relax (``"torch.export"``, ``"TVM's ONNX frontend"``).
        module: the ``torch.nn.Module`` where the model is one (GPTQ rounds its weights, ``compare``
            times it in PyTorch), else None.
        has_own_ranges: whether the model carries its activation ranges (a Q/DQ file): it is then
            never calibrated (:meth:`own_ranges`).
        fixed_size: the image size the model fixes (an ONNX file's static height = width), or None.
    """

    name: str
    path: str | None
    exporter: str
    module: "torch.nn.Module | None"
    has_own_ranges: bool
    fixed_size: int | None

    def probe(self, input_shape: tuple, name: str | None = None) -> Probe:
        """What the model makes at ``input_shape`` (before any long work).

        Raises:
            InputError: it cannot take the shape, or returns no tensor.
        """

    def first_output(self, probe: Probe) -> ContextManager[None]:
        """While inside, the model gives the first tensor of its output (what a library computes)."""

    def report_note(self, probe: Probe) -> str | None:
        """The build report's lines about the model's interface (several outputs, a dynamic size)."""

    def input_notes(self, input_shape: tuple) -> list[str]:
        """The lines a build starts with: what the model leaves open that ``input_shape`` fixes (an
        ONNX file's dynamic batch or image size)."""

    def export(self, input_shape: tuple) -> "ExportedGraphs":
        """The model exported once: its float Relax graph at every batch a build needs."""

    def reference(self, x: np.ndarray, device: str = "cpu", chunk: int | None = None) -> np.ndarray:
        """The float model's output (its first tensor) on ``x`` (NCHW float32), as float32, run on
        ``device`` where the model can be, ``chunk`` images at a time (None: all at once)."""

    def digest(self) -> str:
        """A short hash of the weights: a library records it; two random inits differ."""

    def image_size(self, requested: int | None) -> int:
        """The build's input height = width: the model's own where it fixes one, else ``requested``
        (default 224).

        Raises:
            InputError: a requested size the model contradicts.
        """

    def own_ranges(self, exported: "ExportedGraphs", config: "QuantConfig"):
        """``(range source or None, config)``: the ranges the model carries (None: it carries
        none), and ``config`` with what they leave float added to its skip list."""

    def with_module(self, module: "torch.nn.Module") -> "Frontend":
        """The same model with another torch module's weights (GPTQ's rounded copy)."""


def no_ranges(exported, config):
    """:meth:`Frontend.own_ranges` of a model that carries no ranges."""
    return None, config


def unchanged_output(probe: Probe) -> ContextManager[None]:
    """:meth:`Frontend.first_output` of a model whose output is already one tensor."""
    return contextlib.nullcontext()
