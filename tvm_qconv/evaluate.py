"""Measuring a built library: accuracy on a labelled split, agreement with the float model."""
from __future__ import annotations

import numpy as np

from .artifact import read_meta
from .data import digits_dataset, static_batches
from .errors import InputError
from .runtime import CompiledModel

DIGITS_CLASSES = 10  # tvm_qconv.training.config.DIGITS_CLASSES (not imported: that pulls in training)


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB
    (``10 log10(sum ref^2 / sum (act - ref)^2)``; inf when they are equal)."""
    ref = np.asarray(reference, np.float64)
    err = float(((np.asarray(actual, np.float64) - ref) ** 2).sum())
    return float("inf") if err == 0 else float(10 * np.log10((ref ** 2).sum() / err))


def check_digits_library(lib_path: str, meta: dict) -> dict:
    """Refuse a library that was not built from a digits checkpoint (an ImageNet model, say, which
    would score ~0 % on digits without saying why).

    A digits library's json record has a ``dataset`` entry named ``digits`` (written by
    :func:`tvm_qconv.build.compile_checkpoint`), takes 3-channel square images of the dataset's
    size, and, where it records its categories, has 10 of them.

    Args:
        lib_path: the library, for the message.
        meta: its json record (:func:`tvm_qconv.artifact.read_meta`).

    Returns:
        The record's ``dataset`` entry.

    Raises:
        InputError: one line naming the library, what it was built from (model and input shape),
            and the build that makes a library ``eval --dataset digits`` takes.
    """
    dataset = meta.get("dataset")
    shape = list(meta.get("input_shape") or [])
    categories = meta.get("categories")
    if not isinstance(dataset, dict) or dataset.get("name") != "digits":
        why = "not from a digits checkpoint"
    elif len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3] or shape[2] != dataset.get("image_size", shape[2]):
        why = (f"but its input does not take the {dataset.get('image_size')} px images its digits checkpoint "
               "was trained on")
    elif categories is not None and len(categories) != DIGITS_CLASSES:
        why = f"but it has {len(categories)} outputs, not the {DIGITS_CLASSES} digits"
    else:
        return dataset
    raise InputError(f"--lib {lib_path} was built from {meta.get('model', 'an unnamed model')} with input shape "
                     f"{tuple(shape)}, {why}: `eval --dataset digits` takes a library built with `python deploy.py "
                     f"build --checkpoint CKPT -o LIB` from a checkpoint of `python train.py --qat --out CKPT`")


def evaluate_library(lib_path: str, seed: int | None = None, device: str | None = None) -> dict:
    """Top-1 accuracy of a built library on the digits test split (the split ``tvm_qconv.training.loop.evaluate`` uses).

    Args:
        lib_path: a ``.so`` written by ``deploy.py build`` for digits (e.g. from a QAT checkpoint).
        seed: the split's seed; default: the one recorded at build time (the checkpoint's), else 0.
        device: ``llvm`` / ``cuda``; default: the library's target.

    Returns:
        ``{"accuracy": percent, "correct": n, "total": n, "seed": seed, "device": str,
        "recorded": the accuracies its checkpoint recorded ({} when not built from one)}``.

    Raises:
        InputError: the library is missing or not whole, or was not built from a digits checkpoint
            (:func:`check_digits_library`, checked before the library is loaded).

    Example:
        >>> evaluate_library("build/small_vgg.so")["accuracy"]     # 97.5
    """
    dataset = check_digits_library(lib_path, read_meta(lib_path))
    lib = CompiledModel(lib_path, device)
    seed = dataset.get("seed", 0) if seed is None else seed
    n, _, size, _ = lib.input_shape
    _, (x, y) = digits_dataset(size, seed=seed)
    pred = []
    for real, xb in static_batches(x, n):
        pred.append(lib(xb)[:real].argmax(1))
    correct = int((np.concatenate(pred) == y).sum())
    return {"accuracy": 100.0 * correct / len(y), "correct": correct, "total": len(y), "seed": seed,
            "device": str(lib.dev), "recorded": dict((lib.meta.get("checkpoint") or {}).get("accuracy") or {})}
