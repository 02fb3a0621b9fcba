"""Training configuration: the models train.py can train and :class:`TrainConfig`, one run."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..models.quantized_vgg import QuantizedVGG16, SmallQuantizedVGG
from ..nn.functional import INPUT_GRADS
from ..nn.modules import INPUT_RANGES, set_input_range

TRAIN_CONFIG_VERSION = 1
DIGITS_CLASSES = 10


def _small_vgg(quantized: bool, num_classes: int, image_size: int, input_grad: str = "float32",
               weight_grad: str = "float32") -> nn.Module:
    return SmallQuantizedVGG(num_classes=num_classes, image_size=image_size, quantized=quantized,
                             input_grad=input_grad, weight_grad=weight_grad)


def _vgg16(quantized: bool, num_classes: int, image_size: int, input_grad: str = "float32",
           weight_grad: str = "float32") -> nn.Module:
    return QuantizedVGG16(num_classes=num_classes, image_size=image_size, quantized=quantized, input_grad=input_grad,
                          weight_grad=weight_grad)


# The CLI's --model choices.
MODELS: dict[str, Callable[..., nn.Module]] = {"small_vgg": _small_vgg, "vgg16": _vgg16}


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
        input_grad: how the int8 layers compute input gradients: ``"float32"``, or ``"int8"`` (the
            output gradient quantized to int8, on the int8 conv kernels: ``QuantizedConv2d``).
        weight_grad: how they compute weight gradients: ``"float32"``, or ``"int8"`` (the output
            gradient quantized to int8 per channel, exact int sums: ``QuantizedConv2d``).
        input_range: the range a training step quantizes each layer's input with: ``"batch"``
            (its own max) or ``"delayed"`` (the one learned before it: ``modules.INPUT_RANGES``).
    """

    model: str = "small_vgg"
    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    qat: bool = False
    seed: int = 0
    image_size: int = 32
    input_grad: str = "float32"
    weight_grad: str = "float32"
    input_range: str = "batch"
    version: int = TRAIN_CONFIG_VERSION

    def __post_init__(self):
        checks = [
            (self.model in MODELS, f"model must be one of {sorted(MODELS)}, got {self.model!r}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.input_grad in INPUT_GRADS, f"input_grad must be one of {INPUT_GRADS}, got {self.input_grad!r}"),
            (self.qat or self.input_grad == "float32", "input_grad is the int8 layers' (qat=True); the float model "
                                                       "has float gradients"),
            (self.weight_grad in INPUT_GRADS, f"weight_grad must be one of {INPUT_GRADS}, got {self.weight_grad!r}"),
            (self.qat or self.weight_grad == "float32", "weight_grad is the int8 layers' (qat=True); the float model "
                                                        "has float gradients"),
            (self.input_range in INPUT_RANGES, f"input_range must be one of {INPUT_RANGES}, got {self.input_range!r}"),
            (self.qat or self.input_range == "batch", "input_range is the int8 layers' (qat=True)"),
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
    model = MODELS[config.model](q, DIGITS_CLASSES, config.image_size, config.input_grad, config.weight_grad)
    return set_input_range(model, config.input_range) if q else model
