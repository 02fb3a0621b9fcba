"""Float and quantization-aware (QAT) training on scikit-learn's digits, and the checkpoint format.

QAT trains the model built from ``QuantizedConv2dReLU`` / ``QuantizedLinear`` (int8 forward, STE
backward), so the network learns around the int8 rounding the compile step will apply, and every
layer learns its input and output ranges (EMA of the batch max) on the way.

A checkpoint (``torch.save`` of a dict) holds:

* ``state_dict``: the float-model state dict (no range buffers), so it loads strictly into the
  plain float model (``models.vgg.SmallVGG``; ``torchvision.models.vgg16`` for a VGG16 trained
  at 224x224, whose classifier is torchvision's);
* ``amax``: the learned ranges by calibration point, ``f"{layer}.in0"`` (input max|x|) and
  ``f"{layer}.out"`` (output max, after the fused ReLU) for every conv and linear layer, ``layer``
  being the module path (``"features.0"``);
* ``config``: :class:`TrainConfig` as a dict; ``accuracy``: test accuracies in percent.

:func:`tvm_qconv.build.compile_checkpoint` (``deploy.py build --checkpoint``) compiles a QAT
checkpoint with these ranges instead of calibration, and :func:`evaluate_library`
(``deploy.py eval``) measures the compiled library on the same test split as :func:`evaluate`.

Example:
    >>> result = run_training(TrainConfig(model="small_vgg", epochs=5, qat=True), out="ckpt.pt")
    >>> result["accuracy"]          # {'float': 97.78, 'ptq': 97.78, 'qat': 97.5}
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .nn import learned_amax, load_float_state_dict, to_float_state_dict
from .nn.modules import AMAX_BUFFERS, TRACKED_LAYERS

log = logging.getLogger(__name__)

TRAIN_CONFIG_VERSION = 1
DIGITS_CLASSES = 10
_EVAL_BATCH = 256


def _small_vgg(quantized: bool, num_classes: int, image_size: int) -> nn.Module:
    from models.quantized_vgg import SmallQuantizedVGG
    return SmallQuantizedVGG(num_classes=num_classes, image_size=image_size, quantized=quantized)


def _vgg16(quantized: bool, num_classes: int, image_size: int) -> nn.Module:
    from models.quantized_vgg import QuantizedVGG16
    return QuantizedVGG16(num_classes=num_classes, image_size=image_size, quantized=quantized)


# The CLI's --model choices.
MODELS: dict[str, Callable[[bool, int, int], nn.Module]] = {"small_vgg": _small_vgg, "vgg16": _vgg16}


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        model: a key of ``MODELS``.
        epochs: passes over the 1437 training digits.
        batch_size: training batch.
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
        qat: train the int8 quantized model (else the float twin).
        seed: seeds the initialization, the batch order and the data split.
        image_size: digits are upsampled to this size (32 for both models).
    """

    model: str = "small_vgg"
    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    qat: bool = False
    seed: int = 0
    image_size: int = 32
    version: int = TRAIN_CONFIG_VERSION

    def __post_init__(self):
        checks = [
            (self.model in MODELS, f"model must be one of {sorted(MODELS)}, got {self.model!r}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.image_size >= 32, f"image_size must be >= 32 (the VGGs pool to 4x4 / 1x1), got {self.image_size}"),
            (self.version == TRAIN_CONFIG_VERSION, f"config version {self.version} is not {TRAIN_CONFIG_VERSION}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"TrainConfig: {msg}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"TrainConfig: unknown keys {sorted(unknown)}")
        return cls(**d)


def build_model(config: TrainConfig, quantized: bool | None = None) -> nn.Module:
    """The model of ``config`` (quantized iff ``config.qat`` unless ``quantized`` says otherwise)."""
    q = config.qat if quantized is None else quantized
    return MODELS[config.model](q, DIGITS_CLASSES, config.image_size)


def load_digits(config: TrainConfig):
    """``((x_train, y_train), (x_test, y_test))`` as torch tensors (see ``tvm_qconv.data.digits_dataset``)."""
    from .data import digits_dataset

    (xt, yt), (xe, ye) = digits_dataset(config.image_size, seed=config.seed)
    return (torch.from_numpy(xt), torch.from_numpy(yt)), (torch.from_numpy(xe), torch.from_numpy(ye))


def train_model(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], config: TrainConfig,
                report: Callable[[str], None] = log.info) -> nn.Module:
    """Train ``model`` in place with Adam and cross-entropy.

    Args:
        model: float or quantized model.
        train: ``(images, labels)``.
        config: epochs, batch size, optimizer settings, seed (batch order).
        report: called with one line per epoch.

    Returns:
        ``model``, in eval mode.
    """
    x, y = train
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(config.seed)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(config.epochs):
        model.train()
        start, total, correct = time.perf_counter(), 0.0, 0
        for idx in torch.randperm(len(x), generator=gen).split(config.batch_size):
            logits = model(x[idx])
            loss = loss_fn(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
        report(f"epoch {epoch + 1}/{config.epochs}: loss {total / len(x):.4f}, "
               f"train acc {100.0 * correct / len(x):.2f}%, {time.perf_counter() - start:.1f} s")
    return model.eval()


@torch.no_grad()
def evaluate(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Top-1 accuracy in percent (eval mode: quantized layers use their learned ranges)."""
    model.eval()
    x, y = data
    correct = sum(int((model(xb).argmax(1) == yb).sum())
                  for xb, yb in zip(x.split(_EVAL_BATCH), y.split(_EVAL_BATCH)))
    return 100.0 * correct / len(x)


def save_checkpoint(path: str, model: nn.Module, config: TrainConfig, accuracy: dict[str, float]) -> dict:
    """Write the checkpoint dict (module docstring) atomically: a temp file renamed into place.

    Returns:
        The dict written.
    """
    ckpt = {
        "state_dict": to_float_state_dict(model.state_dict()),
        "amax": learned_amax(model),
        "config": config.to_dict(),
        "accuracy": dict(accuracy),
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(ckpt, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return ckpt


def set_learned_amax(model: nn.Module, amax: dict[str, float]) -> None:
    """Restore the range buffers from a checkpoint's ``amax`` dict.

    Raises:
        KeyError: a tracked layer of ``model`` has no entry.
    """
    for name, m in model.named_modules():
        if isinstance(m, TRACKED_LAYERS):
            for buf, suffix in AMAX_BUFFERS.items():
                getattr(m, buf).fill_(float(amax[f"{name}.{suffix}"]))


CHECKPOINT_KEYS = ("state_dict", "amax", "config")


def read_checkpoint(path: str) -> tuple[dict, TrainConfig]:
    """Read and check a file written by :func:`save_checkpoint`.

    Returns:
        ``(checkpoint dict, its TrainConfig)``.

    Raises:
        InputError: unreadable, not a dict with ``state_dict`` / ``amax`` / ``config`` (e.g. a
            plain state dict), or a config this version cannot read.
    """
    from .errors import InputError

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise InputError(f"cannot read checkpoint {path}: {type(err).__name__}: {reason}") from err
    lacking = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if lacking:
        what = f"a dict with keys {sorted(ckpt)[:6]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise InputError(f"{path} is not a train.py checkpoint ({what}; it lacks {lacking}): give the file that "
                         "`python train.py --qat --out CKPT` wrote; a plain state dict of a torchvision model "
                         "builds with --model NAME --weights FILE (ranges by calibration)")
    try:
        config = TrainConfig.from_dict(dict(ckpt["config"]))
    except (TypeError, ValueError) as err:
        raise InputError(f"checkpoint {path} has a training config this version cannot read: {err}") from err
    return ckpt, config


def load_checkpoint(path: str, quantized: bool | None = None) -> tuple[nn.Module, dict]:
    """Rebuild the trained model of a checkpoint, with its weights and learned ranges, in eval mode.

    Args:
        path: a file written by :func:`save_checkpoint`.
        quantized: build the int8 model (True) or the float twin (False); default: as trained.

    Returns:
        ``(model, checkpoint dict)``.
    """
    ckpt, config = read_checkpoint(path)
    model = build_model(config, quantized)
    load_float_state_dict(model, ckpt["state_dict"])
    set_learned_amax(model, ckpt["amax"])
    return model.eval(), ckpt


def load_float_model(path: str, require_qat: bool = False) -> tuple[nn.Module, dict, TrainConfig]:
    """The float architecture a checkpoint was trained with, holding its weights, in eval mode.

    This is what the compile step imports: the float twin (``TorchConv2dReLU``, ...) has the
    trained model's module names, so its calibration points are the checkpoint's ``amax`` keys.

    Args:
        path: a file written by :func:`save_checkpoint`.
        require_qat: raise unless the checkpoint was trained with ``qat=True``.

    Returns:
        ``(model, checkpoint dict, TrainConfig)``.

    Raises:
        InputError: see :func:`read_checkpoint`; trained in float while ``require_qat``; weights
            that do not fit the configured model.
    """
    from .errors import InputError

    ckpt, config = read_checkpoint(path)
    if require_qat and not config.qat:
        raise InputError(f"{path} was trained in float (train.py without --qat): its ranges are statistics of the "
                         "float activations, not scales learned under int8; retrain with "
                         f"`python train.py --model {config.model} --qat --out CKPT`")
    model = build_model(config, quantized=False)
    try:
        load_float_state_dict(model, ckpt["state_dict"])
    except RuntimeError as err:
        raise InputError(f"the weights in {path} do not fit its configured model {config.model}: {err}") from err
    return model.eval(), ckpt, config


def evaluate_library(lib_path: str, seed: int | None = None, device: str | None = None) -> dict:
    """Top-1 accuracy of a built library on the digits test split (the split :func:`evaluate` uses).

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
    import numpy as np

    from .data import digits_dataset
    from .runtime import CompiledModel

    lib = CompiledModel(lib_path, device)
    dataset = lib.meta.get("dataset") or {}
    seed = dataset.get("seed", 0) if seed is None else seed
    n, _, size, _ = lib.input_shape
    _, (x, y) = digits_dataset(size, seed=seed)
    pred = []
    for i in range(0, len(x), n):  # the library has a static batch: pad the last one with its last image
        xb = x[i: i + n]
        padded = np.concatenate([xb, np.repeat(xb[-1:], n - len(xb), axis=0)])
        pred.append(lib(padded)[: len(xb)].argmax(1))
    correct = int((np.concatenate(pred) == y).sum())
    return {"accuracy": 100.0 * correct / len(y), "correct": correct, "total": len(y), "seed": seed,
            "device": str(lib.dev), "recorded": dict((lib.meta.get("checkpoint") or {}).get("accuracy") or {})}


def _fresh(config: TrainConfig, quantized: bool) -> nn.Module:
    torch.manual_seed(config.seed)  # the same initial weights for the float and the QAT run
    return build_model(config, quantized)


def _int8_twin(model: nn.Module, config: TrainConfig) -> nn.Module:
    """The quantized twin of a float-trained model, with its weights and EMA ranges (PTQ)."""
    twin = build_model(config, quantized=True)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def run_training(config: TrainConfig, out: str | None = None, baseline: bool = True,
                 report: Callable[[str], None] = log.info) -> dict:
    """Train on digits, evaluate float vs int8, and optionally save a checkpoint.

    Without ``config.qat``: trains the float model and reports its accuracy (``float``) and that
    of its int8 twin run with the EMA ranges seen in float training (``ptq``, post-training
    quantization).  With ``config.qat``: trains the quantized model (``qat``, evaluated in int8
    with its learned ranges) and, if ``baseline``, the float model from the same initial weights
    and batch order (``float`` and ``ptq``).

    Args:
        config: the run.
        out: checkpoint path (the trained model: the QAT one if ``config.qat``), or None.
        baseline: with ``config.qat``, also train the float model for comparison.
        report: called with progress and result lines.

    Returns:
        ``{"accuracy": {...}, "amax": {...}, "model": the trained model, "seconds": {...}}``.
    """
    train, test = load_digits(config)
    accuracy, seconds, trained = {}, {}, None
    if baseline or not config.qat:
        report(f"float training ({config.model}, {config.epochs} epochs)")
        start = time.perf_counter()
        trained = train_model(_fresh(config, quantized=False), train, config, report)
        seconds["float"] = time.perf_counter() - start
        accuracy["float"] = evaluate(trained, test)
        accuracy["ptq"] = evaluate(_int8_twin(trained, config), test)
    if config.qat:
        report(f"QAT training ({config.model}, {config.epochs} epochs, int8 conv/linear)")
        start = time.perf_counter()
        trained = train_model(_fresh(config, quantized=True), train, config, report)
        seconds["qat"] = time.perf_counter() - start
        accuracy["qat"] = evaluate(trained, test)
    report("test accuracy: " + ", ".join(f"{k} {v:.2f}%" for k, v in accuracy.items()))
    if out is not None:
        save_checkpoint(out, trained, config, accuracy)
        report(f"wrote {out}")
    return {"accuracy": accuracy, "amax": learned_amax(trained), "model": trained, "seconds": seconds}
