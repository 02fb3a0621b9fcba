"""BatchNorm (+ a residual add) + ReLU for the int8 training path: one op, its backward in two passes.

In ResNet-50 every int8 conv feeds a BatchNorm, most of them a ReLU after it, and each block's
last one an add and a ReLU.  As torch modules that is cuDNN's BatchNorm (a statistics pass and an
apply pass forward, two passes backward, float32 NCHW), an add, the ReLU and its mask: at batch
128 on an H200 21.7 ms of BatchNorm, 4.1 of adds and 5.6 of ReLU and mask in a 76.5 ms step
(``docs/history.md``).  :class:`BatchNormReLU` is ``nn.BatchNorm2d`` whose forward also adds an
optional residual and applies the ReLU, keeping for backward its input ``y`` (as BatchNorm does)
and 1 bit an element for the ReLU (as ``CompactReLU`` does), and whose backward is::

    dz   = g * bit                                   the ReLU's mask (threshold_backward: z > 0 or NaN)
    s1   = sum dz,  s2 = sum dz * (y - mean)         per channel, float64  (pass 1)
    dy   = a * dz + b * (y - mean) + c               per channel a, b, c from s1, s2  (pass 2)
    d(addend) = dz,  d(gamma) = s2 * invstd,  d(beta) = s1

with ``a = gamma * invstd``, ``b = -a * invstd**2 * s2 / M``, ``c = -a * s1 / M`` (``M = N*H*W``):
the training-mode BatchNorm gradient ``gamma * invstd * (dz - mean(dz) - xhat * mean(dz * xhat))``
rearranged so that each pass reads ``g``, the bits and ``y`` once.

This module holds the definition (the CPU path, and the reference the CUDA kernels will be
checked against): float64 per-channel sums, float32 elementwise operations in a fixed order.
Statistics are the batch's in training (the running ones updated as ``nn.BatchNorm2d`` does,
unbiased variance, ``momentum`` not None), the running ones in eval.  The CUDA kernels round each
operation with CUDA's ``__f*_rn``, which under TVM's ``--use_fast_math`` flush subnormals: a
normalized value below 1.2e-38 in magnitude becomes 0 there (and its ReLU bit 0), where the
definition keeps it.  No second derivative (``once_differentiable``).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .functional import _elementwise, _relu_bits, mask_torch


def batch_stats(y: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, var, invstd)`` per channel of NCHW float32 ``y``: float64 sums of ``y`` and ``y * y``
    (:func:`finish_stats`)."""
    y64 = y.to(torch.float64)
    return finish_stats(y64.sum(dim=(0, 2, 3)), (y64 * y64).sum(dim=(0, 2, 3)), y.numel() // y.shape[1], eps)


def finish_stats(s1: torch.Tensor, s2: torch.Tensor, m: int, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, var, invstd)`` from the float64 per-channel sums of ``y`` and ``y * y`` over ``m``
    elements: the biased variance (what normalizes), float32 out; ``invstd = 1 / sqrt(var + eps)``."""
    mean = s1 / m
    var = (s2 / m - mean * mean).clamp_min(0.0)
    return mean.to(torch.float32), var.to(torch.float32), torch.rsqrt(var + eps).to(torch.float32)


def normalize_relu(y: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor,
                   addend: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(relu((y - mean) * scale + beta [+ addend]), its ReLU bits)``, per channel ``mean``,
    ``scale`` (``gamma * invstd``) and ``beta``, each float32 operation rounded on its own."""
    c = (1, -1, 1, 1)
    z = (y - mean.view(c)).mul_(scale.view(c)).add_(beta.view(c))
    if addend is not None:
        z.add_(addend)
    out = torch.relu(z)
    return out, _relu_bits(out)


def grad_sums(g: torch.Tensor, bits: torch.Tensor, y: torch.Tensor, mean: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of the backward: per channel ``sum dz`` and ``sum dz * (y - mean)`` (float64) of
    ``dz = g`` masked by ``bits``."""
    dz = mask_torch(g, bits).to(torch.float64)
    centered = y.to(torch.float64) - mean.to(torch.float64).view(1, -1, 1, 1)
    return dz.sum(dim=(0, 2, 3)), (dz * centered).sum(dim=(0, 2, 3))


def grad_apply(g: torch.Tensor, bits: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: ``(dy, dz)`` with ``dy = a * dz + b * (y - mean) + c`` per channel (float32, each
    operation rounded on its own) and ``dz = g`` masked by ``bits``."""
    v = (1, -1, 1, 1)
    dz = mask_torch(g, bits)
    dy = (dz * a.view(v)).add_((y - mean.view(v)).mul_(b.view(v))).add_(c.view(v))
    return dy, dz


def _grad_apply(g, bits, y, mean, a, b, c, want_dz: bool = True):
    """:func:`grad_apply` with the kernels' signature (``dz`` only where wanted)."""
    dy, dz = grad_apply(g, bits, y, mean, a, b, c)
    return dy, (dz if want_dz else None)


def train_stats(y: torch.Tensor, gamma: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                eps: float, momentum: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training's ``(mean, invstd, scale = gamma * invstd)`` of NCHW float32 ``y``
    (:func:`batch_stats`), the running statistics updated in place as ``nn.BatchNorm2d`` does
    (the unbiased variance)."""
    mean, var, invstd = batch_stats(y, eps)
    m = y.numel() // y.shape[1]
    running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
    running_var.mul_(1 - momentum).add_(var * (m / (m - 1)), alpha=momentum)
    return mean, invstd, gamma.detach().to(torch.float32) * invstd


def coefficients(s1: torch.Tensor, s2: torch.Tensor, gamma: torch.Tensor, invstd: torch.Tensor, m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 2's per-channel ``(a, b, c)`` (module docstring), computed in float64, float32 out."""
    a = gamma.to(torch.float64) * invstd.to(torch.float64)
    i2 = invstd.to(torch.float64) ** 2
    return a.to(torch.float32), (-a * i2 * s2 / m).to(torch.float32), (-a * s1 / m).to(torch.float32)


def grad_coefficients(s1: torch.Tensor, s2: torch.Tensor, gamma: torch.Tensor, invstd: torch.Tensor, m: int
                      ) -> tuple[torch.Tensor, ...]:
    """Backward's per-channel ``(a, b, c, dgamma, dbeta)`` from pass 1's float64 sums: :func:`coefficients`,
    ``dgamma = s2 * invstd`` and ``dbeta = s1`` (float64, in ``gamma``'s dtype out).  ``s1``, ``s2``:
    ``[C]``, or ``[C, K]`` partials (a kernel's ``bn_grad_sums``), added here."""
    if s1.dim() == 2:
        s1, s2 = s1.sum(dim=1), s2.sum(dim=1)
    a, b, c = coefficients(s1, s2, gamma, invstd, m)
    return a, b, c, (s2 * invstd.to(torch.float64)).to(gamma.dtype), s1.to(gamma.dtype)


class BatchNormReLUFunction(torch.autograd.Function):
    """``apply(y, gamma, beta, addend, mean, invstd, scale, batch)``: the op with given statistics
    (the caller computed and recorded them; ``scale = gamma * invstd``); ``addend`` may be None;
    ``batch``: the statistics are the batch's own (training: their gradient flows), else constants
    (eval: ``dy = a * dz``)."""

    @staticmethod
    def forward(ctx, y, gamma, beta, addend, mean, invstd, scale, batch):
        # on CUDA one TVM kernel (tvm_kernels.bn_relu), which also notes the output's range
        out, bits = _elementwise(y.device.type, "bn_relu", normalize_relu)(
            y, mean, scale, beta.detach().to(torch.float32), addend)
        ctx.save_for_backward(y, bits, gamma, mean, invstd)
        ctx.has_addend, ctx.batch = addend is not None, batch
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        y, bits, gamma, mean, invstd = ctx.saved_tensors
        g = g.to(torch.float32).contiguous()
        device = g.device.type      # on CUDA one TVM kernel a pass (tvm_kernels.bn_grad_sums, bn_grad)
        # the float64 sums; on CUDA as the kernel's per-thread partials, which bn_coeffs adds
        s1, s2 = _elementwise(device, "bn_grad_sums", grad_sums)(g, bits, y, mean)
        m = y.numel() // y.shape[1]
        # the per-channel arithmetic in one kernel on CUDA (tvm_kernels.bn_coeffs)
        a, b, c, dgamma, dbeta = _elementwise(device, "bn_coeffs", grad_coefficients)(s1, s2, gamma.detach(),
                                                                                    invstd, m)
        dy = dz = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[3]:
            if ctx.batch:
                dy, dz = _elementwise(device, "bn_grad", _grad_apply)(g, bits, y, mean, a, b, c, ctx.has_addend)
            else:   # constant statistics (eval): no gradient through them, y not read (an inf there stays out)
                dz = mask_torch(g, bits)
                dy = dz * a.view(1, -1, 1, 1)
        return (dy, dgamma if ctx.needs_input_grad[1] else None, dbeta if ctx.needs_input_grad[2] else None,
                dz if ctx.has_addend else None, None, None, None, None)


class BatchNormReLU(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose forward is ``relu(batch_norm(y) [+ addend])`` in one op that keeps
    ``y`` and 1 bit an element for backward (module docstring).  Same parameters, buffers and
    state dict as ``nn.BatchNorm2d``; falls back to torch's modules where the op does not apply
    (no gradient, not float32, no affine, ``momentum=None``, not tracking running stats)."""

    def forward(self, y: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        fused = (y.dtype == torch.float32 and y.dim() == 4 and self.affine and self.momentum is not None
                 and self.track_running_stats and torch.is_grad_enabled())
        if not fused:
            z = super().forward(y)
            return torch.relu(z if addend is None else z + addend)
        y = y.contiguous()
        addend = None if addend is None else addend.to(torch.float32).contiguous()
        if self.training:
            if y.numel() == y.shape[1]:
                raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                                 f"{list(y.shape)}")
            with torch.no_grad():   # on CUDA a pass over y and one kernel a channel (tvm_kernels.bn_train_stats)
                mean, invstd, scale = _elementwise(y.device.type, "bn_train_stats", train_stats)(
                    y, self.weight, self.running_mean, self.running_var, self.eps, self.momentum)
                self.num_batches_tracked.add_(1)
        else:
            mean = self.running_mean.to(torch.float32)
            invstd = torch.rsqrt(self.running_var.to(torch.float32) + self.eps)
            scale = self.weight.detach().to(torch.float32) * invstd
        return BatchNormReLUFunction.apply(y, self.weight, self.bias, addend, mean, invstd, scale, self.training)
