"""A small VGG for 32x32 inputs (scikit-learn digits upsampled): conv3x3+ReLU blocks and max-pools,
then a two-layer classifier, the same op mix as VGG16 at a size that trains in seconds on a CPU."""
from __future__ import annotations

import torch
from torch import nn

SMALL_VGG_CFG = (16, "M", 32, "M", 64, 64, "M")


class SmallVGG(nn.Module):
    def __init__(self, num_classes: int = 10, cfg=SMALL_VGG_CFG, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        layers, c = [], in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                image_size //= 2
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c * image_size * image_size, 128),
                                        nn.ReLU(inplace=True), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
