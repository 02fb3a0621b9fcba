"""Lookup-table activations (``lut`` layers, ``graph.py``; ``lut_table.py``; ``schedules/lut_int8.py``):
an elementwise function of one int8 tensor -- SiLU, hardswish, GELU -- as a 256-entry int8
table, instead of a dequantize, the float ops and a quantize back.  The table is that float path
tabulated, so a build with tables computes what the build without them computes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.frontend import export_to_relax, simplify
from tvm_qconv.graph import analyze
from tvm_qconv.lut_table import dequantized_inputs, lut_table
from tvm_qconv.onnx_export import export_onnx
from tvm_qconv.ranges import Calibrate, GivenRanges
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.schedules.quantize import quantize_ref

SIZE = 24
LUTS = ["lut_0", "lut_1", "lut_2"]  # SiLU, hardswish, GELU, in graph order


class ActNet(nn.Module):
    """conv -> SiLU -> depthwise -> hardswish -> 1x1 -> GELU -> 1x1 -> squeeze-excite gate (sigmoid
    of a 1x1 conv on the pooled map, multiplied into the map) -> 1x1 -> global pool."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.c = nn.Conv2d(16, 24, 1)
        self.d = nn.Conv2d(24, 16, 1)
        self.se = nn.Conv2d(16, 16, 1)
        self.e = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        x = nn.functional.silu(self.a(x))
        x = nn.functional.hardswish(self.b(x))
        x = self.d(nn.functional.gelu(self.c(x)))
        x = x * torch.sigmoid(self.se(x.mean((2, 3), keepdim=True)))
        return self.e(x).mean((2, 3))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return ActNet().eval()


@pytest.fixture(scope="module")
def photos():
    return skimage_photos(SIZE)[:4]


@pytest.fixture(scope="module")
def builds(net, photos, tmp_path_factory):
    """The model with its tables, and with the three table layers skipped (the float path), from
    the same ranges."""
    tmp = tmp_path_factory.mktemp("lut")
    opts = BuildOptions(image_size=SIZE)
    with_tables = compile_model(net, str(tmp / "lut.so"), options=opts, config=QuantConfig(num_calib_images=4),
                                ranges=Calibrate(photos), progress=False)
    amax = with_tables.meta["amax"]
    floats = compile_model(net, str(tmp / "float.so"), options=opts, config=QuantConfig(skip=LUTS),
                           ranges=GivenRanges(amax), progress=False)
    return with_tables, floats


def test_the_graph_finds_silu_hardswish_and_gelu_and_leaves_the_gate_float(net):
    mod, names = export_to_relax(net, (1, 3, SIZE, SIZE))
    graph = analyze(simplify(mod)["main"], names)
    value = {b.var: b.value for b in graph.bindings}
    luts = [ly for ly in graph.layers if ly.kind == "lut"]
    assert [ly.name for ly in luts] == LUTS
    ops = [[value[v].op.name.removeprefix("relax.") for v in ly.vars] for ly in luts]
    assert ops == [["sigmoid", "multiply"], ["add", "clip", "clip", "multiply", "divide"], ["nn.gelu"]], ops
    # the gate's sigmoid (read by a multiply into another tensor) is no lut layer: it is the channel
    # scale's gate table, its binding emitted in float only where a float reader needs it
    sigmoids = [v for v, e in value.items() if getattr(e, "op", None) is not None and e.op.name == "relax.sigmoid"]
    (scale,) = [ly for ly in graph.layers if ly.kind == "scale"]
    assert len(sigmoids) == 2 and scale.gate_chain.vars == [scale.gate] and scale.gate in sigmoids
    assert scale.gate in graph.lazy and sum(v in graph.lazy for v in sigmoids) == 1
    # each reads its conv's int8 output and has a calibrated output of its own
    assert [(graph.points[ly.inputs[0]], graph.points[ly.output]) for ly in luts] == [
        ("a.out", "lut_0.out"), ("b.out", "lut_1.out"), ("c.out", "lut_2.out")]


def test_a_table_is_the_float_path_tabulated(net, builds):
    # entry q + 128 is quantize(f(dequantize(q))) with torch's own SiLU / hardswish / GELU (float32)
    with_tables, _ = builds
    mod, names = export_to_relax(net, (1, 3, SIZE, SIZE))
    graph = analyze(simplify(mod)["main"], names)
    value = {b.var: b.value for b in graph.bindings}
    amax = with_tables.meta["amax"]
    for ly, f in zip([ly for ly in graph.layers if ly.kind == "lut"],
                     [nn.functional.silu, nn.functional.hardswish, nn.functional.gelu]):
        s_x, s_y = amax[graph.points[ly.inputs[0]]] / 127, amax[graph.points[ly.output]] / 127
        got = lut_table(ly, value, s_x, s_y)
        want = quantize_ref(f(torch.from_numpy(dequantized_inputs(s_x))).numpy(), s_y)
        # torch computes in float32, the table in float64 rounded once: a value within an ulp of
        # a rounding tie may go either way; none does at these scales
        np.testing.assert_array_equal(got, want, err_msg=ly.name)
        assert got.min() < 0 < got.max() or ly.name != "lut_0"  # SiLU dips below zero


def test_a_build_with_tables_computes_what_the_float_path_computes(builds, photos):
    with_tables, floats = builds
    rows = {r["layer"]: r for r in with_tables.report["layers"]}
    # each table in the epilogue of the conv that feeds it alone (quantization/epilogues.py)
    assert all(rows[n]["dtype"] == "int8" and rows[n]["kernel"] == f"in {conv}'s epilogue" for n, conv in zip(LUTS, "abc"))
    assert all(rows[conv]["kind"].endswith("+table") for conv in "abc")
    # the squeeze-excite gate: its mean an int8 pool, its multiply an int8 channel scale reading the
    # sigmoid as a table of its conv's int8 output; the classifier's mean (no keepdims) an int8 global
    # pool too, its [N, C] view the one float op
    assert with_tables.report["float_ops"] == {"relax.reshape": 1}
    assert len(with_tables.report["conversions"]) < len(floats.report["conversions"])
    a, b = (np.concatenate([CompiledModel(res.lib_path)(photos[i:i + 1]) for i in range(len(photos))])
            for res in (with_tables, floats))
    # the same integers wherever no float value lands on a rounding tie: measured identical here
    # (2-core CI box, 2026-11-26); 50 dB would allow one int8 step on a few values
    assert sqnr_db(b, a) > 50, sqnr_db(b, a)
    assert with_tables.report["verify"]["logits_sqnr_db"] > 30


def test_onnx_export_puts_the_tables_ops_between_dq_and_q(net, photos, tmp_path):
    import onnxruntime as ort

    res = export_onnx(net, str(tmp_path / "act.onnx"), input_shape=(1, 3, SIZE, SIZE), ranges=Calibrate(photos),
                      progress=False)
    model = onnx.load(str(tmp_path / "act.onnx"))
    onnx.checker.check_model(model, full_check=True)
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    # the SiLU: Sigmoid and Mul both read DequantizeLinear outputs, and the Mul is quantized
    mul = next(n for n in model.graph.node if n.op_type == "Mul" and any(
        producer.get(i) is not None and producer[i].op_type == "Sigmoid" for i in n.input))
    assert [c.op_type for c in consumers[mul.output[0]]] == ["QuantizeLinear"]
    lib = compile_model(net, str(tmp_path / "act.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=res.config, ranges=res.given_ranges(), progress=False)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdqisint8allowed", "1")  # test_onnx_export.py says why
    got = ort.InferenceSession(str(tmp_path / "act.onnx"), so, providers=["CPUExecutionProvider"]).run(
        None, {"input": photos[:1]})[0]
    ref = CompiledModel(lib.lib_path)(photos[:1])
    # ONNX Runtime requantizes in float and rounds half to even: rounding differences only
    assert sqnr_db(ref, got) > 35, sqnr_db(ref, got)


def test_a_table_whose_reader_stays_float_stays_float_too(net, builds, tmp_path):
    # the depthwise conv after the SiLU skipped: lut_0's int8 output would only be dequantized
    # for it, adding a rounding the float path does not have
    with_tables, _ = builds
    res = compile_model(net, str(tmp_path / "skip.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=QuantConfig(skip=["b"]), ranges=GivenRanges(with_tables.meta["amax"]), progress=False)
    rows = {r["layer"]: r for r in res.report["layers"]}
    assert rows["b"]["dtype"] == rows["lut_0"]["dtype"] == "float32"
    assert rows["lut_0"]["kernel"] == "float (no int8 reader)"
    assert rows["lut_1"]["kernel"] == "float (input is float)"  # the hardswish after the float conv
    assert rows["lut_2"]["dtype"] == "int8"  # the GELU between two int8 convs
