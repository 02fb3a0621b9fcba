"""The zoo: the 16 torchvision classifiers the project is tested and measured on, as the tests and
the benchmarks build them (random init, the scheme each is calibrated with).

    >>> from tvm_qconv.zoo import SIZES, zoo_config, zoo_model
    >>> compile_model(zoo_model("resnet18"), "r18.so", config=zoo_config("resnet18", images=4))

``tests/test_zoo.py`` holds what each must give (int8 layers, float ops, SQNR floor);
``benchmarks/zoo.py`` times them against PyTorch.
"""
from __future__ import annotations

import torch
import torchvision

from .config import QuantConfig

# model -> the image size of the CPU zoo test (the GPU test and the benchmarks use 224 px)
SIZES = {
    "alexnet": 64,
    "vgg16": 64,
    "resnet18": 64,
    "resnet50": 64,
    "wide_resnet50_2": 64,
    "resnext50_32x4d": 64,
    "regnet_x_400mf": 64,
    "mobilenet_v2": 64,
    "mobilenet_v3_small": 64,
    "efficientnet_b0": 64,
    "shufflenet_v2_x1_0": 64,
    "squeezenet1_0": 64,
    "googlenet": 64,
    "inception_v3": 96,  # its stem needs 75 px at least
    "densenet121": 64,
    "convnext_tiny": 64,
}

# Calibrated with max: ShuffleNet's small random features (KL and percentile clip them: 17.6 dB
# with max, 15.7 percentile, 1.8 entropy at 64 px); GoogLeNet's (224 px, llvm library: 32.0 dB
# with max, 24.9 with percentile on the GPU); VGG16's once its 3x3 convs read unsigned tensors
# (percentile's clipping costs more than max's coarser step: 224 px, llvm, 30.2 max, 29.1
# percentile; docs/history.md).
MAX_CALIBRATED = ("shufflenet_v2_x1_0", "googlenet", "vgg16")


def zoo_config(name: str, images: int) -> QuantConfig:
    """The scheme: percentile 99.99 (the default), max calibration for :data:`MAX_CALIBRATED`;
    unsigned activations (``zero_points.py``) wherever the readers take them; GPTQ weight
    rounding on the calibration photos (``ranges/weight_rounding.py``)."""
    return QuantConfig(calibration="max" if name in MAX_CALIBRATED else "percentile", num_calib_images=images,
                       unsigned_activations=True, weight_rounding="gptq")


def zoo_model(name: str) -> torch.nn.Module:
    """The random-init classifier ``name`` (seeded), with what makes its int8 comparison mean
    something: GoogLeNet with PyTorch's default init, the last layer's bias zeroed."""
    torch.manual_seed(0)
    # GoogLeNet's own init (truncated normal, std 0.01) shrinks its features to ~1e-11, so its
    # logits would be the classifier's bias alone and any comparison vacuous: PyTorch's default
    # init instead.
    kwargs = {"init_weights": False, "aux_logits": False} if name == "googlenet" else {}
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    # The last layer's bias is the same in float and int8 and, where a random network's features
    # are small (ShuffleNet, GoogLeNet), it *is* the logits: comparing them would compare two
    # copies of one bias.  Without it, the logits are what the input made of them.
    last = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))][-1]
    if last.bias is not None:
        torch.nn.init.zeros_(last.bias)
    return model
