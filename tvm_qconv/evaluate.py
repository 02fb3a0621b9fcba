"""Measuring a built library: accuracy on a labelled split, agreement with the float model."""
from __future__ import annotations

import numpy as np

from .runtime.artifact import read_meta
from .data import digits_dataset, static_batches
from .errors import InputError
from .labelled_images import labelled_images, read_batch
from .progress import bar
from .runtime.compiled_model import CompiledModel, class_scores

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


def topk_accuracy(logits: np.ndarray, labels: np.ndarray) -> dict:
    """Top-1 and top-5 (percent) of ``logits`` [images, classes] against class indices ``labels``."""
    top = np.argsort(-logits, axis=1)[:, :5]
    return {"top1": 100.0 * float((top[:, 0] == labels).mean()),
            "top5": 100.0 * float((top == labels[:, None]).any(axis=1).mean())}


def check_class_scores(lib_path: str, shape, batch: int) -> None:
    """Refuse a library whose output is not class scores ``[batch, classes]`` (a feature map, a
    segmentation map): top-1 / top-5 mean nothing there.

    Raises:
        InputError: naming the output's shape and what shows it.
    """
    if not class_scores(shape, batch):
        raise InputError(f"{lib_path} outputs {tuple(shape)}, not class scores [batch, classes]: eval measures "
                         f"top-1 / top-5 of a classifier; `python deploy.py run --lib {lib_path} --image ...` shows "
                         "what it outputs")


def evaluate_folder(lib_path: str, data: str, *, labels: str | None = None, classes: str | None = None,
                    float_model=None, device: str | None = None, limit: int | None = None,
                    progress: bool = True) -> dict:
    """Top-1 / top-5 of a built library on a labelled image folder (``labelled_images``), and of
    the float model on the same images where one is given, with their top-1 agreement and the
    int8 logits' SQNR against the float ones.

    Args:
        lib_path: a classifier library (``deploy.py build``).
        data, labels, classes: the folder and how its labels read (:func:`labelled_images.labelled_images`).
        float_model: the float model the library was built from (a ``torch.nn.Module``, any
            ``frontend.Frontend``), or None.
        device: ``llvm`` / ``cuda``; default: the library's target.
        limit: at most this many images (the first, in file order).
        progress: a progress bar on a terminal.

    Returns:
        ``{"images", "skipped": [(file, why)], "layout", "int8": {"top1", "top5"}, "float": {...} or
        None, "top1_agreement", "logits_sqnr_db", "device"}``, accuracies in percent.

    Raises:
        InputError: as :func:`labelled_images.labelled_images`; no image readable.
    """
    if float_model is not None:
        from .frontend import as_frontend  # (torch and the frontends load only with a float model: sqnr_db stays light)
        float_model = as_frontend(float_model)
    meta = read_meta(lib_path)
    if meta.get("output_shape") is not None:    # recorded since 2026-12; older libraries: at the first batch
        check_class_scores(lib_path, meta["output_shape"], meta["input_shape"][0])
    # the folder first: a bad labels file or class folder is said before the library is loaded
    images = labelled_images(data, labels, classes, meta.get("categories"), None)
    lib = CompiledModel(lib_path, device)
    n, _, size, _ = lib.input_shape
    if limit is not None:
        if limit < 1:
            raise InputError(f"limit must be >= 1, got {limit}")
        images.paths, images.labels = images.paths[:limit], images.labels[:limit]
    outs = {"int8": [], "float": []}
    truth = []
    for start in bar(range(0, len(images.paths), n), progress, desc="eval", unit="batch"):
        x, y = read_batch(images, start, n, size)
        if not len(x):
            continue
        (real, xb), = static_batches(x, n)      # a short last batch padded with its own images
        out = lib(xb)
        check_class_scores(lib_path, out.shape, n)
        logits = out[:real]
        if logits.shape[-1] <= int(y.max()):
            raise InputError(f"--data {data}: labels go up to class {int(y.max())}, the library has {logits.shape[-1]} "
                             "outputs: labels are class indices from 0")
        outs["int8"].append(logits)
        if float_model is not None:
            f = float_model.reference(x)
            if f.shape[1:] != logits.shape[1:]:
                raise InputError(f"the float model gives outputs of shape {f.shape[1:]} per image, {lib_path} "
                                 f"{logits.shape[1:]}: it is not the model the library was built from (another "
                                 "class count?); give that model, or leave --model out")
            outs["float"].append(f)
        truth.append(y)
    if not truth:
        raise InputError(f"--data {data}: none of its {len(images.paths)} images could be read "
                         f"(first: {images.skipped[0][0]}: {images.skipped[0][1]})")
    y = np.concatenate(truth)
    q = np.concatenate(outs["int8"])

    result = {"images": int(len(y)), "skipped": images.skipped, "layout": images.layout, "int8": topk_accuracy(q, y),
              "float": None, "top1_agreement": None, "logits_sqnr_db": None, "device": str(lib.dev),
              "library": lib_path, "data": data}
    if outs["float"]:
        f = np.concatenate(outs["float"])
        result.update(float=topk_accuracy(f, y), top1_agreement=100.0 * float((f.argmax(1) == q.argmax(1)).mean()),
                      logits_sqnr_db=sqnr_db(f, q))
    return result
