"""The quantization plan is where a build's decisions live: the Relax lowering and the ONNX export
both follow it, layer by layer, and decide nothing of their own."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from tvm import relax

from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.lowering import LowerToRelax
from tvm_qconv.lowering.onnx import ONNXEmitter
from tvm_qconv.quantization import QuantizationPlan
from tvm_qconv.pipeline import fused
from tvm_qconv.int8_module import quantize_module
from tvm_qconv.ranges import Calibrate
from tvm_qconv.relax_utils import bindings_of
from tvm_qconv.target import TargetInfo, make_target

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

SIZE = 32


class Residual(nn.Module):
    """Conv + ReLU, a residual add, a max pool, a concat and a classifier: one layer of most kinds."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.body = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.side = nn.Conv2d(16, 8, 1)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.body(x))
        x = self.pool(x)
        x = torch.cat([x, torch.relu(self.side(x))], dim=1)
        return self.head(x.mean((2, 3)))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    return quantize_module(Residual().eval(), (1, 3, SIZE, SIZE), TargetInfo.from_target(make_target("llvm")),
                           config=QuantConfig(num_calib_images=4, unsigned_activations=True),
                           ranges=Calibrate(skimage_photos(SIZE)[:4]), progress=False)


def _kernel_calls(mod) -> list[str]:
    """The int8 kernels ``main`` calls (one per int8 layer, besides the conversions)."""
    conversions = ("quantize_pack", "dequantize_unpack", "relayout_int8", "quantize_rows")
    called = [b.value.args[0].name_hint for b in bindings_of(mod["main"])
              if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"]
    return [name for name in called if not name.startswith(conversions)]


def _onnx(plan):
    emitter = ONNXEmitter(plan, (1, 3, SIZE, SIZE), 17, dynamic_batch=False)
    return emitter.run(), emitter.summary()


def _lowered(plan):
    """The plan the Relax backend lowers: the pipeline's own fusions (``pipeline.fused``; this test
    composed them itself before and left the LayerNorm fusion out)."""
    return fused(plan)


def test_the_report_rows_are_the_plans(quantized):
    plan = quantized.plan
    assert quantized.report["layers"] == [lp.row for lp in _lowered(plan).layers]
    assert quantized.report["unsigned"] == plan.unsigned
    assert [lp.layer.name for lp in plan.layers] == [ly.name for ly in quantized.graph.layers]


def test_the_relax_module_has_one_kernel_per_int8_layer_of_the_plan(quantized):
    int8 = [lp for lp in quantized.plan.layers if lp.int8]
    # 3 convs, add, max pool, concat, the global mean (an int8 pool: transform/global_means.py), linear
    assert len(int8) == len(quantized.plan.layers) == 8
    # the add runs in the body conv's epilogue (its only other reader is the add itself)
    fused = [lp for lp in _lowered(quantized.plan).layers if lp.fused_into is not None]
    assert [(lp.layer.name, lp.fused_into) for lp in fused] == [("add_0", "body")]
    assert len(_kernel_calls(quantized.mod)) == len(int8) - len(fused)


def test_a_layer_the_plan_keeps_float_is_float_in_both_backends(quantized):
    old = quantized.plan
    layers = [dataclasses.replace(lp, why_float="kept float by the test") if lp.layer.name == "side" else lp
              for lp in old.layers]
    plan = QuantizationPlan(old.graph, old.target, layers, old.unsigned, old.unsigned_fallback)
    lowered = LowerToRelax(plan)(quantized.exported.at(1).mod)
    assert len(_kernel_calls(lowered)) == sum(lp.int8 for lp in old.layers) - 1    # the unfused plan, less side
    assert [getattr(b.value.op, "name", "") for b in bindings_of(lowered["main"])
            if isinstance(b.value, relax.Call)].count("relax.nn.conv2d") == 1   # the side conv, in float
    _, summary = _onnx(plan)
    assert summary["float_layers"] == ["side"] and summary["int8_layers"] == 7


def test_the_onnx_file_carries_the_plans_scales_zero_points_and_weights(quantized):
    graph, _ = _onnx(quantized.plan)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    q_nodes = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    scales = {float(inits[n.input[1]]) for n in q_nodes}
    zeros = {int(inits[n.input[2]]) for n in q_nodes}
    planned = {float(np.float32(t.quant.scale)) for lp in quantized.plan.layers for t in lp.reads
               if t.quant.layout != "rows"} | {float(np.float32(lp.output.scale)) for lp in quantized.plan.layers
                                                if lp.output is not None}
    planned |= {float(np.float32(r.quant.scale)) for lp in quantized.plan.layers for r in lp.reads
                if r.quant.layout == "rows"}
    assert scales == planned
    assert zeros == {t.zero for lp in quantized.plan.layers for t in [*(r.quant for r in lp.reads), lp.output]
                     if t is not None}
    for lp in quantized.plan.layers:
        if lp.weight is not None:
            assert np.array_equal(inits[f"{lp.layer.name}.weight_int8"], lp.weight[0])


def test_unsigned_tensors_are_the_plans_in_the_onnx_file(quantized):
    # ReLU outputs read only by int8 layers are unsigned (zero point -128) in the plan and the file
    assert quantized.plan.unsigned, "the scheme made some tensors unsigned"
    graph, _ = _onnx(quantized.plan)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    unsigned_q = [n for n in graph.node if n.op_type == "QuantizeLinear" and int(inits[n.input[2]]) == -128]
    assert len(unsigned_q) >= len(quantized.plan.unsigned) - len(quantized.plan.unsigned_fallback)
