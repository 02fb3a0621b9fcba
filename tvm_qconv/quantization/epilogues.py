"""fuse_tables: a plan in which each lookup table that a conv alone feeds runs in that conv's
epilogue (``schedules/epilogue_table.py``) instead of as a kernel of its own.

EfficientNet's SiLU and MobileNet-V3's hardswish follow almost every conv and depthwise conv;
each is a table kernel (``lut_int8.py``) that reads the conv's int8 output and writes it again: at
batch 1 on an H200 EfficientNet-B0 ran 49 such kernels, 60 of its 418 us of GPU kernels, each
one launch more (``docs/results/kernel_profile_efficientnet_b0_b1_h200_global_pool.json``).
Fused, the conv stores the table's entry for the int8 it would have stored: the same integers,
one kernel and one pass over the activation fewer.

A table is fused into its input's producer where all of these hold, else it keeps its kernel:
- the producer is an int8 conv whose implementation takes a table (``KernelImpl.takes_table``;
  not the wgmma family, whose hand-written epilogue has none);
- nothing else reads the conv's output (no other layer, no float op, not a model output), so no
  one needs the integers before the table;
- the table reads the conv's output in the layout the conv writes it (no relayout between).

This is a pass over a finished plan, applied where a library is lowered (``int8_module.py``); the
ONNX backend keeps the unfused plan (ONNX has no conv with a table), and a build that exposes
every layer's activations keeps it too, so that each layer's output exists to compare.
"""
from __future__ import annotations

import dataclasses

from .plan import LayerPlan, QuantizationPlan


def fuse_tables(plan: QuantizationPlan) -> QuantizationPlan:
    """``plan`` with every fusable table in its conv's epilogue (module docstring); the fused table
    layers stay in the plan, kernel-less, saying where they went (``LayerPlan.fused_into``)."""
    readers, outputs = plan.graph.binding_readers, plan.graph.outputs
    by_output = {lp.layer.output: lp for lp in plan.layers}
    fused: dict = {}        # id(layer plan) -> its replacement
    for lp in plan.layers:
        conv = by_output.get(lp.layer.inputs[0]) if lp.layer.kind == "lut" and lp.int8 else None
        if conv is None or not _fusable(conv, lp, readers, outputs, plan.target):
            continue
        table = lp.params[0]
        wl = dataclasses.replace(conv.workload, table=True)
        row = dict(conv.row, kind=conv.row["kind"] + "+table", out_scale=lp.output.scale,
                   table=lp.layer.name)
        fused[id(conv)] = dataclasses.replace(conv, workload=wl, params=(*conv.params, table), output=lp.output,
                                              writes=lp.layer.output, row=row)
        fused[id(lp)] = dataclasses.replace(lp, impl=None, workload=None, reads=(), params=(),
                                            fused_into=conv.layer.name,
                                            row=dict(lp.row, kernel=f"in {conv.layer.name}'s epilogue"))
    layers = [fused.get(id(lp), lp) for lp in plan.layers]
    return dataclasses.replace(plan, layers=layers)


def _fusable(conv: LayerPlan, lut: LayerPlan, readers: dict, outputs: set, target) -> bool:
    if conv.layer.kind != "conv2d" or not conv.int8 or conv.writes is not None:
        return False
    if not (conv.impl.takes_table and conv.impl.applies(dataclasses.replace(conv.workload, table=True), target)):
        return False
    out = conv.layer.output
    if out in outputs or not readers.get(out, set()) <= set(lut.layer.vars):
        return False
    return lut.reads[0].quant == conv.output
