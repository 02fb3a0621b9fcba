"""Measuring a built library: accuracy on a labelled split, agreement with the float model."""
from __future__ import annotations

import numpy as np

from .data import digits_dataset, static_batches
from .runtime import CompiledModel


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB
    (``10 log10(sum ref^2 / sum (act - ref)^2)``; inf when they are equal)."""
    ref = np.asarray(reference, np.float64)
    err = float(((np.asarray(actual, np.float64) - ref) ** 2).sum())
    return float("inf") if err == 0 else float(10 * np.log10((ref ** 2).sum() / err))


def evaluate_library(lib_path: str, seed: int | None = None, device: str | None = None) -> dict:
    """Top-1 accuracy of a built library on the digits test split (the split ``tvm_qconv.training.loop.evaluate`` uses).

    Args:
        lib_path: a ``.so`` written by ``deploy.py build`` for digits (e.g. from a QAT checkpoint).
        seed: the split's seed; default: the one recorded at build time (the checkpoint's), else 0.
        device: ``llvm`` / ``cuda``; default: the library's target.

    Returns:
        ``{"accuracy": percent, "correct": n, "total": n, "seed": seed, "device": str,
        "recorded": the accuracies its checkpoint recorded ({} when not built from one)}``.

    Example:
        >>> evaluate_library("build/small_vgg.so")["accuracy"]     # 97.5
    """
    lib = CompiledModel(lib_path, device)
    dataset = lib.meta.get("dataset") or {}
    seed = dataset.get("seed", 0) if seed is None else seed
    n, _, size, _ = lib.input_shape
    _, (x, y) = digits_dataset(size, seed=seed)
    pred = []
    for real, xb in static_batches(x, n):
        pred.append(lib(xb)[:real].argmax(1))
    correct = int((np.concatenate(pred) == y).sum())
    return {"accuracy": 100.0 * correct / len(y), "correct": correct, "total": len(y), "seed": seed,
            "device": str(lib.dev), "recorded": dict((lib.meta.get("checkpoint") or {}).get("accuracy") or {})}
