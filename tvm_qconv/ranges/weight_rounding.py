"""GPTQ weight rounding (``QuantConfig.weight_rounding = "gptq"``): each int8 conv / linear layer's
weights rounded, one input column at a time, so that the layer's output on the calibration
images moves least.

Rounding to nearest treats every weight alone: each output channel's error is
``(W_q - W) x``, the sum of K independent roundings.  GPTQ (Frantar et al., 2022, after Optimal
Brain Quantization) rounds the columns in turn and, after each, moves the columns not yet
rounded to cancel the error it made, weighted by how the layer's inputs correlate:

    minimize  || X (W_q - W)^T ||^2   over the calibration inputs X [rows, K]
    H = X^T X (+ 1% of its mean diagonal, for conditioning);  for column i:
        q_i = round(w_i / s) * s;   w_{>i} -= (w_i - q_i) * (H^-1)_{i,>i} / (H^-1)_{i,i}

(the inverse's upper Cholesky factor, in blocks of 128 columns; columns in decreasing order of
``diag(H)``, GPTQ's "act order").  The grid is the build's own: symmetric per output channel,
``s = max|w| / 127`` of the float weights, and each channel's largest weight stays at +-127 so
the build, rounding the result to nearest, finds the same scale and the same integers.

It runs on the torch model before it is exported, on its ``nn.Conv2d`` / ``nn.Linear`` modules
that the build runs in int8: a BatchNorm folded into a conv later scales each output channel,
which scales that channel's grid and objective alike, so the integers are the same.  A layer's
inputs are the float model's, recorded by forward hooks on the calibration images.  Grouped and
depthwise convs are rounded per group (one ``H`` per group).  A layer keeps nearest rounding
(the report's ``nearest`` says why) where GPTQ would fit the photos rather than the layer: its
inputs give fewer rows (pixels times images) than it has input columns K, so ``H`` is singular
and the rounding error could hide where these photos have no energy (a classifier after the
global pool: one row per image; more calibration images lift it); where K is over
``MAX_COLUMNS`` (VGG16's first classifier layer, 25088: ``H`` would take 5 GB); and for a module
whose weight is computed (weight norm, a parametrization) or shared with another module.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .observers import weight_scales_per_channel

QMAX = 127
DAMP = 0.01          # added to H's diagonal, times its mean: H of a few images is near singular
BLOCK = 128          # columns rounded between the trailing updates (the algorithm's lazy batch)
MAX_COLUMNS = 8192   # K above this: nearest rounding (H is K x K float64)


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """The int8 integers of ``weight`` by GPTQ.

    Args:
        weight: float ``[G, O, K]`` (G groups of O output channels, K inputs each).
        hessian: ``[G, K, K]``, ``X^T X`` of each group's inputs.
        scale: ``[G, O]`` per output channel (the grid: ``q * scale``, ``|q| <= 127``).
        pin: each channel's largest weight is rounded to +-127 at its turn (its error passed on
            like any other), so that ``max|q| * scale`` is the channel's ``max|w|``: the build,
            deriving the scale from the rounded weights, finds ``scale`` again.

    Returns:
        float64 ``[G, O, K]`` integers in [-127, 127]; where ``hessian`` is a multiple of the
        identity (uncorrelated inputs), exactly round-to-nearest's.
    """
    w = weight.to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    s = scale.to(torch.float64)[..., None]
    g, o, k = w.shape
    diag = torch.diagonal(h, dim1=1, dim2=2)
    dead = diag <= 0
    diag[dead] = 1.0                    # an input never nonzero here: its column moves nothing
    diag += DAMP * diag.mean(dim=1, keepdim=True)
    order = torch.argsort(diag, dim=1, descending=True)   # the most active inputs first
    h = torch.gather(torch.gather(h, 1, order[:, :, None].expand(g, k, k)), 2, order[:, None, :].expand(g, k, k))
    w = torch.gather(w, 2, order[:, None, :].expand(g, o, k))
    top = torch.abs(w).argmax(dim=2)                          # [G, O]: the largest weight's turn
    top_sign = torch.sign(torch.gather(w, 2, top[..., None]))[..., 0]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i0 in range(0, k, BLOCK):
        i1 = min(i0 + BLOCK, k)
        wb, hb = w[:, :, i0:i1].clone(), hinv[:, i0:i1, i0:i1]
        err = torch.zeros_like(wb)
        for j in range(i1 - i0):
            col = wb[:, :, j]
            qj = torch.clamp(torch.round(col / s[..., 0]), -QMAX, QMAX)
            if pin:
                qj = torch.where((top == i0 + j) & (top_sign != 0), top_sign * QMAX, qj)
            q[:, :, i0 + j] = qj
            e = (col - qj * s[..., 0]) / hb[:, j, j][:, None]
            wb[:, :, j:] -= e[:, :, None] * hb[:, j, j:][:, None, :]
            err[:, :, j] = e
        w[:, :, i1:] -= err @ hinv[:, i0:i1, i1:]
    out = torch.empty_like(q)
    out.scatter_(2, order[:, None, :].expand(g, o, k), q)
    return out


class _Inputs:
    """``X^T X`` of a conv's (im2col columns, per group) or linear layer's inputs, accumulated
    by a forward hook."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.h: torch.Tensor | None = None
        self.rows = 0

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if isinstance(m, nn.Linear):
            return x.reshape(1, -1, x.shape[-1])
        if m.padding_mode != "zeros" or isinstance(m.padding, str):   # as Conv2d._conv_forward pads
            x = F.pad(x, m._reversed_padding_repeated_twice, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
            padding = 0
        else:
            padding = m.padding
        cols = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=padding, stride=m.stride)  # [N, C*kh*kw, L]
        n, ck, L = cols.shape
        g = m.groups
        return cols.reshape(n, g, ck // g, L).permute(1, 0, 3, 2).reshape(g, n * L, ck // g)

    def __call__(self, module, args, output):
        cols = self.columns(args[0].detach().to(torch.float64))
        h = cols.transpose(1, 2) @ cols
        self.h = h if self.h is None else self.h + h
        self.rows += cols.shape[1]


def gptq_model(model: nn.Module, images: np.ndarray, layers: list[str]) -> tuple[nn.Module, dict, dict]:
    """A copy of ``model`` whose modules ``layers`` (``nn.Conv2d`` / ``nn.Linear`` paths) hold
    their GPTQ-rounded weights, on the int8 grid (``q * s``, as floats).

    Args:
        model: the float model (not modified).
        images: the calibration images, float32 ``[N, C, H, W]`` (the model's input).
        layers: module paths to round (the build's int8 conv / linear layers).

    Returns:
        ``(model copy, report, integers)``: ``report`` = ``dict(rounded=[...], nearest={layer:
        reason}, moved={layer: share of weights GPTQ rounded away from the nearest integer})``;
        ``integers``: ``{layer: int8 weights}`` (what the build must find again).
    """
    model = copy.deepcopy(model).eval()
    modules = dict(model.named_modules())
    owners: dict = {}
    for mod_name, m in modules.items():
        if isinstance(getattr(m, "weight", None), torch.Tensor):
            owners.setdefault(id(m.weight), []).append(mod_name)
    hooks, inputs, nearest = [], {}, {}
    for name in layers:
        m = modules.get(name)
        if not isinstance(m, (nn.Conv2d, nn.Linear)):
            nearest[name] = "not an nn.Conv2d / nn.Linear module"
            continue
        if not isinstance(m.weight, nn.Parameter) or parametrize.is_parametrized(m):
            nearest[name] = "its weight is computed (weight norm, a parametrization)"
            continue
        if len(owners.get(id(m.weight), [])) > 1:
            nearest[name] = f"its weight is shared with {[n for n in owners[id(m.weight)] if n != name]}"
            continue
        k = m.weight[0].numel()
        if k > MAX_COLUMNS:
            nearest[name] = f"{k} inputs > {MAX_COLUMNS}"
            continue
        inputs[name] = _Inputs(m)
        hooks.append(m.register_forward_hook(inputs[name]))
    try:
        with torch.no_grad():
            for i in range(len(images)):
                model(torch.from_numpy(np.ascontiguousarray(images[i:i + 1])))
    finally:
        for hk in hooks:
            hk.remove()
    moved, integers = {}, {}
    for name, rec in list(inputs.items()):
        if rec.h is None:   # a module the forward did not call (an auxiliary head in eval mode)
            nearest[name] = "not run on the calibration images"
            del inputs[name]
            continue
        k = rec.h.shape[-1]
        if rec.rows < k:
            nearest[name] = f"{rec.rows} input rows < {k} columns: give more calibration images"
            del inputs[name]
            continue
        m = rec.module
        w = m.weight.detach().to(torch.float64).cpu().numpy()
        scale = weight_scales_per_channel(w).astype(np.float64)
        g = m.groups if isinstance(m, nn.Conv2d) else 1
        o = w.shape[0]
        q = gptq_round(torch.from_numpy(w.reshape(g, o // g, -1)), rec.h,
                       torch.from_numpy(scale.reshape(g, o // g))).numpy().reshape(w.shape)
        nearest_q = np.clip(np.rint(w / scale.reshape((-1,) + (1,) * (w.ndim - 1))), -QMAX, QMAX)
        moved[name] = round(float(np.mean(q != nearest_q)), 4)
        integers[name] = q.astype(np.int8)
        rounded = q * scale.reshape((-1,) + (1,) * (w.ndim - 1))
        m.weight.data = torch.from_numpy(rounded).to(m.weight.dtype)
    return model, dict(rounded=sorted(inputs), nearest=nearest, moved=moved), integers
