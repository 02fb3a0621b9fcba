"""torchvision's ResNet-50 built from tvm_qconv's int8 quantization-aware layers (or their float twins).

Every ``nn.Conv2d`` becomes ``QuantizedConv2d`` and the classifier ``QuantizedLinear``
(``quantized=True``), or ``TorchConv2d`` / ``TorchLinear`` (``quantized=False``).  BatchNorm, the
pools and the residual adds stay torch modules: each conv feeds a BatchNorm, so no ReLU can be
fused into it (``QuantizedConv2d``, not ``QuantizedConv2dReLU``); the int8 model's ReLUs are
``CompactReLU`` (a 1-bit mask kept for backward instead of the float output).

Module names and initialization are torchvision's (the layers are swapped after torchvision builds
the model, weights copied), so the quantized model and its float twin built under the same seed hold
the same weights, and torchvision state dicts load with ``load_float_state_dict``::

    model = quantized_resnet50()
    load_float_state_dict(model, torchvision.models.resnet50(weights="DEFAULT").state_dict())
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from tvm_qconv.nn import (CompactReLU, QuantizedConv2d, QuantizedLinear, TorchConv2d, TorchLinear,
                          load_float_state_dict)
from tvm_qconv.nn.batch_norm import BatchNormReLU


def _conv_like(conv: nn.Conv2d, cls) -> nn.Module:
    # cls: a layer class, or a partial of one; the int8 layers refuse a padding mode other than zeros
    new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
              conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode, device=conv.weight.device,
              dtype=conv.weight.dtype)
    load_float_state_dict(new, conv.state_dict())
    return new


def _linear_like(linear: nn.Linear, cls) -> nn.Module:
    new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=linear.weight.device,
              dtype=linear.weight.dtype)
    load_float_state_dict(new, linear.state_dict())
    return new


def swap_layers(model: nn.Module, quantized: bool = True, input_grad: str = "float32",
                weight_grad: str = "float32") -> nn.Module:
    """``model`` with every plain ``nn.Conv2d`` / ``nn.Linear`` replaced in place by the int8 QAT
    layer (or its float twin), same name, same weights; with ``quantized``, every ``nn.ReLU`` by
    ``CompactReLU`` (the same values and gradients, 1 bit an element kept for backward).

    Args:
        model: a float model (torchvision's, or any built from ``nn.Conv2d`` / ``nn.Linear``).
        quantized: the int8 layers (True) or the float twins (False).
        input_grad, weight_grad: how the int8 layers compute input and weight gradients
            (``QuantizedConv2d``).

    Returns:
        ``model`` itself.
    """
    if quantized:
        conv = functools.partial(QuantizedConv2d, input_grad=input_grad, weight_grad=weight_grad)
        linear = functools.partial(QuantizedLinear, input_grad=input_grad, weight_grad=weight_grad)
    else:
        conv, linear = TorchConv2d, TorchLinear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Conv2d:
                setattr(parent, name, _conv_like(child, conv))
            elif type(child) is nn.Linear:
                setattr(parent, name, _linear_like(child, linear))
            elif type(child) is nn.ReLU and quantized:
                setattr(parent, name, CompactReLU())    # a 1-bit mask kept, not the float output
    return model


def quantized_resnet50(num_classes: int = 1000, quantized: bool = True, input_grad: str = "float32",
                       weight_grad: str = "float32", fuse_bn_relu: bool | None = None) -> nn.Module:
    """torchvision's ``resnet50`` (random init under the caller's seed) with int8 QAT layers.

    Args:
        num_classes: logits.
        quantized: the int8 layers (True) or the float twins (False).
        input_grad, weight_grad: how the int8 layers compute input and weight gradients
            (``QuantizedConv2d``).
        fuse_bn_relu: BatchNorm, the residual add and the ReLU as one op (:func:`fuse_batch_norm_relu`);
            by default the int8 model fuses them (its GPU step is 1.2-1.4x faster: docs/performance.md)
            and the float twin keeps torch's modules.
    """
    import torchvision  # here: the VGG models need no torchvision

    model = swap_layers(torchvision.models.resnet50(num_classes=num_classes), quantized, input_grad, weight_grad)
    return fuse_batch_norm_relu(model) if (quantized if fuse_bn_relu is None else fuse_bn_relu) else model


@functools.lru_cache(maxsize=None)
def _fused_blocks() -> dict[type, tuple[type, tuple[str, ...]]]:
    """torchvision's block classes -> (the same block with its BatchNorms as :class:`BatchNormReLU`,
    the ReLUs and the residual add inside them; the names of those BatchNorms).  Built on first
    use: importing this module needs no torchvision."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    class FusedBottleneck(Bottleneck):
        def forward(self, x):       # the downsampling last, as torchvision's: its output lives shortest
            h, x = _first_conv(self.conv1, x)
            out = self.conv3(self.bn2(self.conv2(self.bn1(h))))
            return self.bn3(out, x if self.downsample is None else self.downsample(x))

    class FusedBasicBlock(BasicBlock):
        def forward(self, x):
            h, x = _first_conv(self.conv1, x)
            out = self.conv2(self.bn1(h))
            return self.bn2(out, x if self.downsample is None else self.downsample(x))

    return {Bottleneck: (FusedBottleneck, ("bn1", "bn2", "bn3")), BasicBlock: (FusedBasicBlock, ("bn1", "bn2"))}


def _first_conv(conv: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's first conv and its input for the identity: an int8 conv hands ``x`` through
    (``passthrough``), so the identity's gradient joins the conv's input gradient in one kernel
    instead of autograd's add of the two."""
    if isinstance(conv, QuantizedConv2d):
        return conv(x, passthrough=True)
    return conv(x), x


def _batch_norm_relu_like(bn: nn.BatchNorm2d) -> BatchNormReLU:
    like = next(bn.parameters(), None)
    like = like if like is not None else next(bn.buffers(), None)
    new = BatchNormReLU(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                        **({} if like is None else {"device": like.device, "dtype": like.dtype}))
    new.load_state_dict(bn.state_dict())
    for p, q in zip(new.parameters(), bn.parameters()):
        p.requires_grad_(q.requires_grad)      # a frozen BatchNorm stays frozen
    return new.train(bn.training)


def fuse_batch_norm_relu(model: nn.Module) -> nn.Module:
    """``model`` (a torchvision ResNet) with every BatchNorm that a ReLU follows as one
    :class:`BatchNormReLU` (the stem's, each block's, the last one of a block with the residual
    add); the downsampling branches' BatchNorms, which no ReLU follows, stay.  Same parameter
    values and state dict, in place; the fused BatchNorms' parameters are new tensors: build the
    optimizer after fusing.  Save the fused model by its state dict (its block classes are made on
    first use, so pickling the module itself fails).

    Raises:
        TypeError: a model that is not a torchvision ResNet.
    """
    from torchvision.models.resnet import ResNet

    if not isinstance(model, ResNet):
        raise TypeError(f"fuse_batch_norm_relu takes a torchvision ResNet, got {type(model).__name__}")
    model.bn1, model.relu = _batch_norm_relu_like(model.bn1), nn.Identity()
    fused = _fused_blocks()
    for block in model.modules():
        if type(block) in fused:
            cls, names = fused[type(block)]
            block.__class__ = cls
            for name in names:
                setattr(block, name, _batch_norm_relu_like(getattr(block, name)))
    return model
