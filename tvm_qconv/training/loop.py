"""Float and quantization-aware (QAT) training on scikit-learn's digits.

QAT trains the model built from ``QuantizedConv2dReLU`` / ``QuantizedLinear`` (int8 forward, STE
backward), so the network learns around the int8 rounding the compile step will apply, and every
layer learns its input and output ranges (EMA of the batch max) on the way.

The checkpoint format (weights, learned ranges, config, accuracies) is in ``checkpoint.py``, the
configuration in ``config.py``; :func:`tvm_qconv.build.compile_checkpoint` (``deploy.py build
--checkpoint``) compiles a QAT checkpoint with its learned ranges instead of calibration, and
:func:`tvm_qconv.evaluate.evaluate_library` (``deploy.py eval``) measures the compiled library
on the same test split as :func:`evaluate`.

Example:
    >>> result = run_training(TrainConfig(model="small_vgg", epochs=5, qat=True), out="ckpt.pt")
    >>> result["accuracy"]          # {'float': 97.78, 'ptq': 97.78, 'qat': 97.5}
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from ..data import digits_dataset
from ..fileio import check_output_file
from ..nn import learned_amax
from .checkpoint import save_checkpoint
from .config import TrainConfig, build_model

log = logging.getLogger(__name__)

_EVAL_BATCH = 256


def load_digits(config: TrainConfig):
    """``((x_train, y_train), (x_test, y_test))`` as torch tensors (see ``tvm_qconv.data.digits_dataset``)."""
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
    if out is not None:
        check_output_file(out, "checkpoint")
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
