"""2x2 / stride-2 max-pool for the int8 training path: backward keeps a 1-byte window index per
output, not PyTorch's int64 index.

``nn.MaxPool2d`` keeps, for backward, the flat input index of every output: 8 bytes an output,
2 bytes an input element.  In VGG16 at batch 32, 224 px, that is 392 MB, more than all the int8
activations the quantized layers keep (~290 MB).  The window's position ``2 * i + j`` (0-3) says
the same in 1 byte: 49 MB.  Forward and backward give PyTorch's values bit for bit: the max is
exact, equal maxima route the gradient to the first in row-major order (PyTorch's ``val >
maxval`` scan), and the windows do not overlap, so each input element gets one output's gradient
or 0 (an odd last row or column, which the pool skips, gets 0).

The work goes through ``ELEMENTWISE_KERNELS[device]["max_pool" | "max_pool_grad"]`` (on CUDA one
TVM kernel each, ``schedules/training/elementwise.py``), PyTorch's operations otherwise.
:class:`CompactMaxPool2d` runs this only where a gradient is being taken; eval and export see
``F.max_pool2d``, so the compile step meets a plain max-pool.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import _elementwise

POOL = 2


def max_pool2x2_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.max_pool2d(x, 2, 2), index)`` of NCHW ``x``: ``index`` uint8, the window position
    ``2 * i + j`` of each max (the first of equal ones)."""
    n, c, h, w = x.shape
    oh, ow = h // POOL, w // POOL
    windows = (x[:, :, :oh * POOL, :ow * POOL].reshape(n, c, oh, POOL, ow, POOL)
               .permute(0, 1, 2, 4, 3, 5).reshape(n, c, oh, ow, POOL * POOL))
    out, index = windows.max(dim=-1)        # the first of equal maxima (torch.max's contract)
    return out, index.to(torch.uint8)


def max_pool2x2_grad_torch(g: torch.Tensor, index: torch.Tensor, input_shape) -> torch.Tensor:
    """``dx`` of :func:`max_pool2x2_torch` for ``input_shape``: ``g`` at each window's max, else 0."""
    n, c, h, w = input_shape
    oh, ow = g.shape[2:]
    hit = index.unsqueeze(-1) == torch.arange(POOL * POOL, dtype=torch.uint8, device=g.device)
    d = torch.where(hit, g.unsqueeze(-1), torch.zeros((), dtype=g.dtype, device=g.device))
    d = d.view(n, c, oh, ow, POOL, POOL).permute(0, 1, 2, 4, 3, 5).reshape(n, c, oh * POOL, ow * POOL)
    if (oh * POOL, ow * POOL) == (h, w):
        return d
    return F.pad(d, (0, w - ow * POOL, 0, h - oh * POOL))


class MaxPool2x2Function(torch.autograd.Function):
    """2x2 / stride-2 max-pool of float32 NCHW ``x`` keeping 1-byte window indices for backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out, index = _elementwise(x.device.type, "max_pool", max_pool2x2_torch)(x)
        ctx.save_for_backward(index)
        ctx.input_shape = tuple(x.shape)
        return out

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        grad = _elementwise(g.device.type, "max_pool_grad", max_pool2x2_grad_torch)
        return grad(g.to(torch.float32).contiguous(), index, ctx.input_shape)


class CompactMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d(2, 2)`` whose backward keeps 1 byte an output instead of 8 (module docstring).

    Takes ``nn.MaxPool2d``'s arguments but only its 2x2 / stride-2 / unpadded form; in training
    with a float32 input that needs a gradient it runs :class:`MaxPool2x2Function`, otherwise
    ``F.max_pool2d`` (the same values).

    Raises:
        ValueError: another kernel, stride, padding or dilation, ``ceil_mode`` or ``return_indices``.
    """

    def __init__(self, kernel_size=2, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False):
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)   # noqa: E731
        if (pair(self.kernel_size), pair(self.stride), pair(self.padding), pair(self.dilation)) != \
                ((POOL, POOL),) * 2 + ((0, 0), (1, 1)) or return_indices or ceil_mode:
            raise ValueError("CompactMaxPool2d is the 2x2, stride-2, unpadded max-pool; got "
                             f"{self.extra_repr()}: use nn.MaxPool2d for other pools")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and x.dtype == torch.float32 and x.dim() == 4:
            return MaxPool2x2Function.apply(x)
        return F.max_pool2d(x, POOL, POOL)
