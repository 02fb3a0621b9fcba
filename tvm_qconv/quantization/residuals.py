"""fuse_residuals: a plan in which each residual add that a conv alone feeds runs in that conv's
epilogue (``schedules/epilogue_residual.py``) instead of as a kernel of its own.

Every residual block ends in a conv (no activation) whose output only the add reads: ResNet's and
ResNeXt's third conv, ConvNeXt's second pointwise conv, MobileNet-V2's and EfficientNet's
projection.  Unfused, the add kernel reads the conv's int8 output back with the other addend and
writes the sum: one launch and one round trip of the activation per block (ConvNeXt-T at batch 1
on an H200, 2026-11-28: 18 launches of its 107; ResNeXt-50 at batch 64: 291 of 2,173 us of GPU
kernels).  Fused, the conv reads the other addend where it stores and stores the add's int8: the
same integers, one kernel and one pass over the activation fewer.

An add is fused into the conv that produces one of its inputs where all of these hold (the first
input that qualifies), else it keeps its kernel:
- the conv is an int8 conv whose implementation takes a residual (``KernelImpl.takes_residual``:
  the mma.sync, wgmma, dp4a and CPU kernels; not the depthwise, grouped and stem kernels) and has
  no table in its epilogue (``epilogues.py``);
- nothing else reads the conv's output (no other layer, no float op, not a model output), and the
  add's other input is another tensor;
- the add reads the conv's output in the layout the conv writes it, and the other addend in the
  same layout and shape (no relayout, no group-padded layout between).

The fused kernel runs where the add is (``LayerPlan.runs_at``): the other addend may be computed
after the conv (ResNet's downsample conv follows its block's third conv in torchvision).  This is
a pass over a finished plan, applied where a library is lowered (``int8_module.py``), after
``fuse_tables``; the ONNX backend and a build that exposes every layer's activations keep the
unfused plan.
"""
from __future__ import annotations

import dataclasses

from .. import registry
from ..schedules.epilogue_residual import add_params
from .plan import LayerPlan, QuantizationPlan


def fuse_residuals(plan: QuantizationPlan) -> QuantizationPlan:
    """``plan`` with every fusable add in its conv's epilogue (module docstring); the fused adds
    stay in the plan, kernel-less, saying where they went (``LayerPlan.fused_into``)."""
    readers, outputs = plan.graph.binding_readers, plan.graph.outputs
    by_output = {lp.layer.output: lp for lp in plan.layers}
    fused: dict = {}        # id(layer plan) -> its replacement
    for lp in plan.layers:
        if lp.layer.kind != "add" or not lp.int8 or lp.impl is None:
            continue
        for i, read in enumerate(lp.reads):
            conv = by_output.get(read.var)
            if conv is None or id(conv) in fused or not _fusable(conv, lp, i, readers, outputs, plan.target):
                continue
            fused[id(conv)], fused[id(lp)] = _fuse(conv, lp, i)
            break
    layers = [fused.get(id(lp), lp) for lp in plan.layers]
    return dataclasses.replace(plan, layers=layers)


def _residual(add: LayerPlan, i: int) -> tuple:
    """``ConvWorkload.residual`` of the conv that is the add's input ``i``: the add's zero points
    (the conv's first) and clamp."""
    a = add.workload
    zeros = (a.zero_a, a.zero_b) if i == 0 else (a.zero_b, a.zero_a)
    return (*zeros, a.zero_out, a.act_min, a.act_max)


def _fusable(conv: LayerPlan, add: LayerPlan, i: int, readers: dict, outputs: set, target) -> bool:
    """Whether the add's input ``i``, ``conv``'s output, can take the add in its epilogue (module docstring)."""
    read, other = add.reads[i], add.reads[1 - i]
    if conv.layer.kind != "conv2d" or not conv.int8 or conv.writes is not None or conv.runs_at is not None:
        return False
    if other.var.same_as(read.var):    # the conv's output added to itself: there is no other addend to read
        return False
    wl = dataclasses.replace(conv.workload, residual=_residual(add, i))
    if conv.impl not in registry.candidates("conv2d", wl, target):
        return False
    out = conv.layer.output
    if out in outputs or not readers.get(out, set()) <= set(add.layer.vars):
        return False
    return read.quant == conv.output and other.quant.layout == conv.output.layout \
        and tuple(other.quant.shape) == tuple(conv.out_shape)


def _fuse(conv: LayerPlan, add: LayerPlan, i: int) -> tuple[LayerPlan, LayerPlan]:
    """(the conv with the add in its epilogue, the add without a kernel)."""
    a = add.workload
    mults = (a.mult_a, a.mult_b) if i == 0 else (a.mult_b, a.mult_a)
    wl = dataclasses.replace(conv.workload, residual=_residual(add, i))
    kind = conv.row["kind"] + "+" + add.row["kind"]
    row = dict(conv.row, kind=kind, out_scale=add.output.scale, residual=add.layer.name)
    host = dataclasses.replace(conv, workload=wl, reads=(conv.reads[0], add.reads[1 - i]),
                               params=(*conv.params, add_params(*mults, a.shift)), output=add.output,
                               writes=add.layer.output, runs_at=add.layer.output, row=row)
    gone = dataclasses.replace(add, impl=None, workload=None, reads=(), params=(), fused_into=conv.layer.name,
                               row=dict(add.row, kernel=f"in {conv.layer.name}'s epilogue"))
    return host, gone
