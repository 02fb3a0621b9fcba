"""fuse_layer_norms: a plan in which each LayerNorm that a depthwise conv alone feeds runs in that
conv's kernel (``schedules/tensorcore/depthwise_layer_norm.py``) instead of as a kernel of its own.

ConvNeXt's block is a 7 x 7 depthwise conv, then a LayerNorm over each pixel's channels: at batch 1
on an H200 (2026-11-28) its 18 LayerNorm kernels after depthwise convs took ~60 of 432 us of GPU
kernels, each 2-4 us and latency-bound, plus a launch gap each under a CUDA graph.  Fused, the
LayerNorm reads the conv's int8 output from shared memory: the same integers, one kernel and one
round trip of the map fewer.

A LayerNorm is fused into its input's producer where all of these hold, else it keeps its kernel:
- the producer is an int8 conv whose implementation takes a LayerNorm (``KernelImpl.takes_norm``:
  the NHWC32 depthwise kernel, channel multiplier 1, no dilation, channels a multiple of 4) and has
  no other epilogue (table, residual);
- nothing else reads the conv's output (no other layer, no float op, not a model output);
- the LayerNorm reads the conv's output in the layout the conv writes it.

A pass over a finished plan, applied where a library is lowered (``int8_module.py``) after
``fuse_tables``; the ONNX backend and a build that exposes every activation keep the unfused plan.
"""
from __future__ import annotations

import dataclasses

from .. import registry
from .plan import LayerPlan, QuantizationPlan


def fuse_layer_norms(plan: QuantizationPlan) -> QuantizationPlan:
    """``plan`` with every fusable LayerNorm in its conv's kernel (module docstring); the fused
    LayerNorms stay in the plan, kernel-less, saying where they went (``LayerPlan.fused_into``)."""
    readers, outputs = plan.graph.binding_readers, plan.graph.outputs
    by_output = {lp.layer.output: lp for lp in plan.layers}
    fused: dict = {}
    for lp in plan.layers:
        conv = by_output.get(lp.layer.inputs[0]) if lp.layer.kind == "layer_norm" and lp.int8 else None
        if conv is None or not _fusable(conv, lp, readers, outputs, plan.target):
            continue
        wl = dataclasses.replace(conv.workload, norm=(lp.output.zero,))
        row = dict(conv.row, kind=conv.row["kind"] + "+layer_norm", out_scale=lp.output.scale, norm=lp.layer.name)
        fused[id(conv)] = dataclasses.replace(conv, workload=wl, params=(*conv.params, *lp.params), output=lp.output,
                                              writes=lp.layer.output, row=row)
        fused[id(lp)] = dataclasses.replace(lp, impl=None, workload=None, reads=(), params=(),
                                            fused_into=conv.layer.name,
                                            row=dict(lp.row, kernel=f"in {conv.layer.name}'s kernel"))
    return dataclasses.replace(plan, layers=[fused.get(id(lp), lp) for lp in plan.layers])


def _fusable(conv: LayerPlan, norm: LayerPlan, readers: dict, outputs: set, target) -> bool:
    if conv.layer.kind != "conv2d" or not conv.int8 or conv.writes is not None or conv.runs_at is not None:
        return False
    wl = dataclasses.replace(conv.workload, norm=(norm.output.zero,))   # no table: conv.writes would be set
    if conv.impl not in registry.candidates("conv2d", wl, target):
        return False
    out = conv.layer.output
    if out in outputs or not readers.get(out, set()) <= set(norm.layer.vars):
        return False
    return norm.reads[0].quant == conv.output and norm.output.layout == conv.output.layout
