"""Check a model at the build's input shape before any long work, without running it.

The model runs once on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes,
no data, no memory; a VGG16 at 224 px in ~30 ms), which tells, before anything is exported or
calibrated:

- whether it takes the shape at all (VGG16 at 16 px: its fifth max pool would make 0x0),
- how much memory its largest activation needs (VGG16 at 100000 px: 2.5 TB, refused instead of
  attempted),
- what its ``forward`` returns: one tensor, or a tuple / list / dict whose first tensor the build
  takes (:func:`single_output`, named in the report), or nothing usable (refused by name).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import InputError

# A build keeps a few activations of the largest size alive at once (the float model's input and
# output of a layer, calibration's observers, the verification's float reference): refuse a
# shape whose largest activation times this does not fit the memory that is free.
LIVE_COPIES = 4


@dataclass(frozen=True)
class Probe:
    """What the fake run found.

    Attributes:
        output: how ``forward``'s result reads (``"a tensor (1, 1000)"``, ``"a tuple of 2"``).
        output_path: where the first tensor is in it (``()`` for a tensor, ``(0,)`` for a tuple's
            first item, ``("logits",)`` for a dict's entry).
        largest_bytes: the largest activation a leaf module makes (float32 at the build shape).
        largest_layer: that module's path.
    """

    output: str
    output_path: tuple
    largest_bytes: int
    largest_layer: str


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


def probe(model: torch.nn.Module, input_shape: tuple, name: str = "the model") -> Probe:
    """Run ``model`` on a fake input of ``input_shape``.

    An ONNX file (``onnx_import.OnnxModel``) answers from its imported graph instead.

    Raises:
        InputError: the model cannot take this shape, or returns no tensor.
    """
    if not isinstance(model, torch.nn.Module) and hasattr(model, "probe"):
        return model.probe(input_shape, name)
    largest = [0, ""]
    paths = {m: p for p, m in model.named_modules()}

    def hook(module, args, out):
        found = _first_tensor(out)
        if found is not None and found[1].numel() * 4 > largest[0]:
            largest[:] = [found[1].numel() * 4, paths.get(module, "")]

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    # torch logs the traceback of a shape check that fails on fake tensors (20 lines) before it
    # raises; the error below says it in one
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            out = model.eval()(torch.empty(tuple(input_shape), dtype=torch.float32))
            del mode
    except Exception as err:  # the model's own shape checks, in whatever type it raises them
        text = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise InputError(f"{name} cannot take input {tuple(input_shape)}: {type(err).__name__}: {text}; "
                         f"choose another --image-size (224 is what ImageNet classifiers are made for)") from None
    finally:
        fake_log.setLevel(level)
        for h in handles:
            h.remove()
    found = _first_tensor(out)
    if found is None:
        raise InputError(f"{name}'s forward returns {_describe(out)} with no tensor in it: the build needs the "
                         "logits as a tensor (or a tuple / dict whose first entry is)")
    return Probe(_describe(out), found[0], largest[0], largest[1])


def check_memory(p: Probe, input_shape: tuple, name: str = "the model", available: int | None = None,
                 host_batch: int | None = None) -> None:
    """Refuse a shape whose largest float activation cannot fit the host memory that is free.

    Args:
        p, input_shape: the probe at the build's input shape.
        host_batch: how many images the host runs the float model on at once (default: the
            input's batch; a CUDA build calibrates one image at a time and verifies on 4, its
            batch runs on the GPU).

    Raises:
        InputError: naming the layer, the bytes needed and the bytes free.
    """
    if available is None:
        available = psutil.virtual_memory().available
    batch = int(input_shape[0])
    per_image = p.largest_bytes / max(batch, 1)
    need = per_image * (batch if host_batch is None else host_batch) * LIVE_COPIES
    if need > available:
        raise InputError(f"{name} at input {tuple(input_shape)} needs about {_size(need)} of memory ({p.largest_layer} "
                         f"alone makes {_size(per_image)} of float32 activations per image), this machine has "
                         f"{_size(available)} free: use a smaller --image-size or --batch")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


@contextlib.contextmanager
def single_output(model: torch.nn.Module, p: Probe) -> Iterator[None]:
    """While inside, ``model`` returns the first tensor of what its ``forward`` returns (a forward
    hook, removed afterwards; module paths, and so layer names, stay as they are).  An ONNX file
    keeps its first output at load (``onnx_import.OnnxModel``): nothing to do."""
    if p.output_path == () or not isinstance(model, torch.nn.Module):
        yield
        return

    def first(module, args, out):
        for key in p.output_path:
            out = out[key]
        return out

    handle = model.register_forward_hook(first)
    try:
        yield
    finally:
        handle.remove()


def output_note(p: Probe) -> str | None:
    """The report's line about a model whose output is not one tensor (None: it is)."""
    if p.output_path == ():
        return None
    where = "".join(f"[{k!r}]" for k in p.output_path)
    return f"forward returns {p.output}: the library computes its first tensor, output{where}; the rest is dropped"
