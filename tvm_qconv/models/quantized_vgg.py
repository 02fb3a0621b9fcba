"""VGG16 and the small VGG built from tvm_qconv's int8 quantization-aware layers (or their float twins).

``quantized=True`` builds every conv + ReLU as ``QuantizedConv2dReLU`` and every linear layer as
``QuantizedLinear`` (the compile step runs both in int8, so QAT trains what it deploys);
``quantized=False`` builds the float twins ``TorchConv2dReLU`` / ``TorchLinear``.  The int8
models' 2x2 max-pools are ``CompactMaxPool2d`` (PyTorch's values, a 1-byte index kept for
backward instead of 8), the twins' ``nn.MaxPool2d``.

Module names match the float models (``torchvision.models.vgg16``, ``models.vgg.SmallVGG``):
the fused conv + ReLU sits at the conv's index and an ``nn.Identity`` holds the ReLU's, so
``features.0.weight`` is ``features.0.weight`` in both.  The only extra entries are each layer's
learned ranges (``*.input_amax``, ``*.output_amax``)::

    float_model.load_state_dict(to_float_state_dict(qat_model.state_dict()))   # QAT -> float
    load_float_state_dict(qat_model, float_model.state_dict())                  # float -> QAT
    # (== qat_model.load_state_dict(sd, strict=False), checking that only ranges are missing)
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from tvm_qconv.nn import CompactMaxPool2d, QuantizedConv2dReLU, QuantizedLinear, TorchConv2dReLU, TorchLinear

from .vgg import SMALL_VGG_CFG

# torchvision's configuration "D" (VGG16): conv widths, "M" = 2x2 max-pool.
VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
VGG16_POOL = 7  # torchvision's AdaptiveAvgPool2d((7, 7)) at 224x224


def _layer_types(quantized: bool, input_grad: str = "float32", weight_grad: str = "float32"):
    """The (conv + ReLU, linear) layer constructors: the int8 QAT layers computing their input
    and weight gradients as ``input_grad`` and ``weight_grad`` say, or the float twins."""
    if not quantized:
        return TorchConv2dReLU, TorchLinear
    return (functools.partial(QuantizedConv2dReLU, input_grad=input_grad, weight_grad=weight_grad),
            functools.partial(QuantizedLinear, input_grad=input_grad, weight_grad=weight_grad))


def make_features(cfg, in_channels: int, quantized: bool, input_grad: str = "float32",
                  weight_grad: str = "float32") -> tuple[nn.Sequential, int]:
    """Conv3x3(pad 1) + ReLU blocks and 2x2 max-pools, indexed like torchvision's ``make_layers``.

    Returns:
        ``(features, out_channels)``.
    """
    conv, _ = _layer_types(quantized, input_grad, weight_grad)
    # the int8 layers' pools keep a 1-byte window index for backward (tvm_qconv.nn.max_pool)
    pool = CompactMaxPool2d if quantized else nn.MaxPool2d
    layers, c = [], in_channels
    for v in cfg:
        if v == "M":
            layers.append(pool(2, 2))
        else:
            # The fused layer takes the conv's index; Identity keeps the ReLU's index free.
            layers += [conv(c, v, 3, padding=1), nn.Identity()]
            c = v
    return nn.Sequential(*layers), c


def _pools(cfg) -> int:
    return sum(1 for v in cfg if v == "M")


class QuantizedVGG16(nn.Module):
    """torchvision's VGG16 (cfg D, no batch norm) from int8 QAT layers, at any image size >= 32.

    At 224x224 the model is torchvision's (``AdaptiveAvgPool2d(7)``, 512*7*7 -> 4096 -> 4096 ->
    classes) and its state dict loads from ``torchvision.models.vgg16`` weights.  Smaller images
    shrink the pool to ``image_size // 32`` (1x1 at 32x32) and the first linear layer with it,
    instead of upsampling a 1x1 map to 7x7 for a 25088-wide layer.

    Args:
        num_classes: logits.
        image_size: input height and width (>= 32, five 2x2 pools).
        quantized: int8 QAT layers (True) or their float twins (False).
        classifier_width: hidden width of the classifier (torchvision: 4096).
        dropout: dropout probability in the classifier.
        in_channels: input channels.
        input_grad, weight_grad: how the int8 layers compute input and weight gradients
            (``"float32"`` or ``"int8"``: ``QuantizedConv2d``); the float twins ignore them.
    """

    def __init__(self, num_classes: int = 1000, image_size: int = 224, quantized: bool = True,
                 classifier_width: int = 4096, dropout: float = 0.5, in_channels: int = 3,
                 input_grad: str = "float32", weight_grad: str = "float32"):
        super().__init__()
        if image_size < 32:
            raise ValueError(f"VGG16 pools 5 times: image_size must be >= 32, got {image_size}")
        _, linear = _layer_types(quantized, input_grad, weight_grad)
        self.features, c = make_features(VGG16_CFG, in_channels, quantized, input_grad, weight_grad)
        pool = min(VGG16_POOL, image_size // 2 ** _pools(VGG16_CFG))
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            linear(c * pool * pool, classifier_width), nn.ReLU(True), nn.Dropout(dropout),
            linear(classifier_width, classifier_width), nn.ReLU(True), nn.Dropout(dropout),
            linear(classifier_width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class SmallQuantizedVGG(nn.Module):
    """``models.vgg.SmallVGG`` (cfg (16, 'M', 32, 'M', 64, 64, 'M'), 32x32 inputs) from int8 QAT layers.

    Args:
        num_classes: logits.
        cfg: conv widths and "M" pools.
        in_channels: input channels.
        image_size: input height and width.
        quantized: int8 QAT layers (True) or their float twins (False).
        input_grad, weight_grad: as ``QuantizedVGG16``.
    """

    def __init__(self, num_classes: int = 10, cfg=SMALL_VGG_CFG, in_channels: int = 3, image_size: int = 32,
                 quantized: bool = True, input_grad: str = "float32", weight_grad: str = "float32"):
        super().__init__()
        _, linear = _layer_types(quantized, input_grad, weight_grad)
        self.features, c = make_features(cfg, in_channels, quantized, input_grad, weight_grad)
        size = image_size // 2 ** _pools(cfg)
        self.classifier = nn.Sequential(nn.Flatten(), linear(c * size * size, 128), nn.ReLU(inplace=True),
                                        linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
