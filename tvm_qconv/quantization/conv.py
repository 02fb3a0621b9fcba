"""Planning rules of the layers with weights: conv2d (+bias)(+activation) and linear layers.

A conv becomes one fused kernel: its weights int8 per output channel and packed for the kernel,
the bias in int32 at scale ``s_x * s_w[c]`` (the zero points folded into it), the requantize
multiplier ``s_x * s_w[c] / s_y`` in fixed point, the activation an int8 clamp.  A linear layer
quantizes its float input into rows and writes float (the classifier's logits).
"""
from __future__ import annotations

import numpy as np

from ..graph import static_shape
from ..ranges.observers import quantize_weight_per_channel
from ..schedules.dense_int8 import DenseWorkload
from ..schedules.requantize import UNSIGNED_ZERO, quantize_multiplier
from ..schedules.workload import ConvWorkload
from .plan import LayerPlan, TensorQuant, TensorRead
from .scales import activation_suffix, bias_weight_scales, block_diagonal, int8_clamp, weight_error_mean


def plan_conv2d(p, ly) -> LayerPlan | str:
    a = ly.call.attrs
    n, c, h, w = static_shape(ly.inputs[0].ty)
    weight = ly.weight
    o, _, kh, kw = weight.shape
    groups = int(a.groups)
    # per output channel: block-diagonal or not; a Q/DQ file's own integers and scales where it gives them
    qw, s_w = ly.given_weight if ly.given_weight is not None else quantize_weight_per_channel(weight)
    own_weight = (qw, s_w)
    if p.zero(ly.output) and not output_zero_fits(p, ly, s_w):
        p.make_symmetric(ly.output)
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
    shape = dict(batch=n, in_channels=c, height=h, width=w, out_channels=o, kernel=(kh, kw),
                 stride=tuple(map(int, a.strides)), padding=tuple(map(int, a.padding)),
                 dilation=tuple(map(int, a.dilation)), in_zero=p.zero(ly.inputs[0]))
    wl = ConvWorkload.with_activation(activation, act_min, act_max, groups=groups, **shape)
    # a memory-bound conv (depthwise, grouped, of few channels: KernelImpl.follows_input) takes its
    # int8 input's layout where a kernel there takes it: no relayout before it, whichever family
    # ran the layer before (dp4a's NCHW4c at small maps, the tensor cores' NHWC32)
    x_in = p.quantized(ly.inputs[0])
    impl = p.pick("conv2d", wl, ly.name, follow=x_in.layout if x_in else None)
    note = ""
    if impl is None and groups > 1:
        # Groups no kernel takes as they are (channels per group not a multiple of 4):
        # the same conv with a block-diagonal weight, groups=1.
        dense = ConvWorkload.with_activation(activation, act_min, act_max, **shape)
        impl = p.pick("conv2d", dense, ly.name)
        if impl is not None:
            wl, weight, note = dense, block_diagonal(weight, groups), f" (groups={groups} as block-diagonal)"
    if impl is None:
        return p.no_kernel("conv2d", wl)
    x = p.read(ly.inputs[0], impl.input_layout())
    s_x, z_x = x.quant.scale, x.quant.zero
    if note:
        qw, s_w = quantize_weight_per_channel(weight)
    bias = np.zeros(o) if ly.bias is None else ly.bias.astype(np.float64)
    # a bias int32 cannot hold at scale s_x * s_w (an input faded to ~1e-9 of it): those channels'
    # weights on a coarser step (scales.bias_weight_scales says why and what it costs)
    fit = bias_weight_scales(bias, s_x, s_w)
    raised = fit > s_w
    if raised.any():
        qw, s_w = _requantized(weight, qw, fit, raised)
        own_weight = _requantized(ly.weight, own_weight[0], fit, raised)
    acc_scale = s_x * s_w.astype(np.float64)
    mean = p.input_mean(ly)
    if mean is not None:  # weight is groups=1 here when it was made block-diagonal
        # rounded to float32 once, as the ONNX export writes it: a build from that file starts from these numbers
        bias = (bias - weight_error_mean(weight, qw, s_w, mean, 1 if note else groups)).astype(np.float32).astype(
            np.float64)
    float_bias = bias if ly.bias is not None or mean is not None else None   # the plan's, for ONNX
    bias_q = np.round(bias / acc_scale)
    # zero points: the kernel reads q_x = x / s_x + z_x, so its sum holds z_x * sum(w) too; and
    # adds z_y to the output as z_y / M in the accumulator (off by at most M / 2 of a step)
    bias_q = bias_q - z_x * qw.reshape(o, -1).astype(np.float64).sum(axis=1) + np.round(z_y * s_y / acc_scale)
    clipped = int(np.count_nonzero(np.abs(bias_q) > 2**31 - 1))
    bias_q = np.clip(bias_q, -2**31, 2**31 - 1).astype(np.int32)
    mult, shift = quantize_multiplier(acc_scale / s_y)
    out_shape = tuple(impl.out_shape(wl))
    out = TensorQuant(s_y, z_y, o, impl.layout, out_shape)
    p.produce(ly.output, out)
    row = dict(layer=ly.name, kind="conv2d" + ("+bias" if ly.bias is not None else "")
               + activation_suffix(activation, act_min, act_max),
               kernel=impl.name, dtype="int8", shape=wl.describe() + note, in_scale=s_x, out_scale=s_y)
    if clipped:  # a bias beyond int32 at scale s_x * s_w: saturated, and the report says so
        row["bias_saturated"] = clipped
    if raised.any():
        row["weight_scale_raised"] = int(np.count_nonzero(raised))
    if mean is not None:
        row["bias_corrected"] = True
    return LayerPlan(ly, impl=impl, workload=wl, reads=(x,), output=out, out_shape=out_shape,
                     params=tuple(impl.pack_params(wl, qw, bias_q, mult, shift)), weight=own_weight, bias=float_bias,
                     row=row)


def _requantized(weight: np.ndarray, qw: np.ndarray, scales: np.ndarray,
                 rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``qw`` with the output channels ``rows`` (bool [O]) quantized again from ``weight`` at
    ``scales``; the others keep their integers (a Q/DQ file's, where it gave them)."""
    coarse, _ = quantize_weight_per_channel(weight, scales)
    return np.where(rows.reshape((-1,) + (1,) * (qw.ndim - 1)), coarse, qw), scales


def output_zero_fits(p, ly, s_w: np.ndarray) -> bool:
    """Whether a conv's unsigned output zero point, folded into its int32 bias as ``-128 / M``
    (``M = s_x * s_w / s_y`` per channel), fits there with the bias itself: not where a
    channel's ``M`` is under ~1e-7 (a dead filter, a BatchNorm's zero gamma folded in), whose
    output would then saturate instead of reading the real zero."""
    x = p.quantized(ly.inputs[0])   # a max pool's or gather's output: its source's scale
    s_x = x.scale if x is not None else p.scale(ly.inputs[0])
    m = s_x * s_w.astype(np.float64) / p.scale(ly.output)
    bias = np.zeros(len(m)) if ly.bias is None else np.abs(ly.bias.astype(np.float64))
    fold = np.where(m > 0, (-UNSIGNED_ZERO + bias / p.scale(ly.output)) / np.maximum(m, 1e-300), np.inf)
    headroom = 2**30   # |bias_q| <= 2**30 also keeps the 32-bit requantize (I32_MAX_BIAS) usable
    return bool(np.all(fold < headroom) and np.all(quantize_multiplier(np.maximum(m, 1e-300))[0] > 0))


def plan_dense(p, ly) -> LayerPlan | str:
    n, k = static_shape(ly.inputs[0].ty)
    o = ly.weight.shape[0]
    wl = DenseWorkload(n, k, o, (ly.clip or (0.0, float("inf"))) if ly.relu else None)
    impl = p.select("dense", wl)
    if impl is None:
        return p.no_kernel("dense", f"{k}->{o}")
    # the float input (an int8 producer's dequantized) quantized into rows at its point's scale
    x = TensorRead(ly.inputs[0], TensorQuant(p.scale(ly.inputs[0]), p.zero(ly.inputs[0]), k, "rows", (n, k)))
    s_x, z_x = x.quant.scale, x.quant.zero
    qw, s_w = ly.given_weight if ly.given_weight is not None else quantize_weight_per_channel(ly.weight)
    bias = np.zeros(o, np.float32) if ly.bias is None else ly.bias
    mean = p.input_mean(ly)
    if mean is not None:    # (float32 once, as for a conv above)
        bias = (bias - weight_error_mean(ly.weight, qw, s_w, mean)).astype(np.float32)
    float_bias = bias if ly.bias is not None or mean is not None else None   # the plan's, for ONNX
    if z_x:  # the kernel sums q_x = x / s_x + z_x: z_x * sum(w), at scale s_x * s_w, comes off the bias
        bias = bias - z_x * qw.astype(np.float64).sum(axis=1) * s_x * s_w
    params = impl.pack_params(wl, qw, (s_x * s_w).astype(np.float32), bias.astype(np.float32))
    row = dict(layer=ly.name, kind="dense" + ("+bias" if ly.bias is not None else "") + ("+relu" if ly.relu else ""),
               kernel=impl.name, dtype="int8", shape=f"{k}->{o} b{n}", in_scale=s_x)
    if mean is not None:
        row["bias_corrected"] = True
    return LayerPlan(ly, impl=impl, workload=wl, reads=(x,), output=None, out_shape=(n, o), out_dtype="float32",
                     params=tuple(params), weight=(qw, s_w), bias=float_bias, row=row)
