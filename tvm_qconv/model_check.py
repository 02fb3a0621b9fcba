"""Refuse, before any long work, a build whose activations cannot fit the memory that is free:
from the model's probe (``frontend.Frontend.probe``: its largest activation at the input shape,
made on fake tensors, no data, no memory).  VGG16 at 100000 px (2.5 TB) is refused instead of
attempted."""
from __future__ import annotations

import psutil

from .errors import InputError
from .frontend.base import Probe

# A build keeps a few activations of the largest size alive at once (the float model's input and
# output of a layer, calibration's observers, the verification's float reference): refuse a
# shape whose largest activation times this does not fit the memory that is free.
LIVE_COPIES = 4


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
