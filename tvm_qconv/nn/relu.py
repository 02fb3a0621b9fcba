"""ReLU for the int8 training path: backward keeps a 1-bit mask, not the float output.

``nn.ReLU`` keeps its output for backward: 4 bytes an element in float32, the whole activation.
Where the next layer is an int8 layer, which keeps only its int8 input, that float tensor would
otherwise be freed once the next layer has read it: in ResNet-50 the ReLUs' outputs are most of
what a training step keeps (about 9 M elements an image, 4.6 GB at batch 128). The mask "not
``y <= 0``" packed 8 to a byte (``functional.pack_bits``) says everything backward needs, and
gives the same gradient bit for bit (``threshold_backward``: the gradient where the output is
positive, or NaN).

The forward (``relu``, its bits and, for the next int8 layer, its range) and the masking go
through the ``relu_with_bits`` / ``mask`` entries of ``ELEMENTWISE_KERNELS[device]`` (on CUDA one
TVM kernel each: ``relu_bits_amax``, ``elementwise.mask``); without a gradient to take,
:class:`CompactReLU` is ``torch.relu``.
"""
from __future__ import annotations

import torch
from torch import nn

from .functional import _mask, _relu_with_bits


class ReLUFunction(torch.autograd.Function):
    """``relu(x)`` keeping ``relu_bits_torch(y)`` (positive or NaN) for backward (contiguous NCHW order)."""

    @staticmethod
    def forward(ctx, x):
        y, bits = _relu_with_bits(x.contiguous())
        ctx.save_for_backward(bits)
        return y

    @staticmethod
    def backward(ctx, g):
        (bits,) = ctx.saved_tensors
        return _mask(g.contiguous(), bits)


class CompactReLU(nn.ReLU):
    """``nn.ReLU`` whose backward keeps 1 bit an element instead of the float output (module
    docstring).  ``inplace`` is accepted for ``nn.ReLU``'s signature; a gradient-taking call
    returns a new tensor (the input is freed as soon as nothing else holds it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and x.dtype == torch.float32:
            return ReLUFunction.apply(x)
        return super().forward(x)
