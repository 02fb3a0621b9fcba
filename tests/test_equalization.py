"""``QuantConfig.equalization`` (``ranges/equalize.py``): the channels between two convs widened
so one per-tensor int8 scale fits them all, the float model unchanged."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.frontend import as_frontend
from tvm_qconv.onnx_export import export_onnx
from tvm_qconv.ranges import Calibrate, GivenRanges
from tvm_qconv.ranges import equalize
from tvm_qconv.runtime import CompiledModel

SIZE = 16


class Skewed(nn.Module):
    """conv -> activation -> depthwise conv -> activation -> 1x1 conv -> linear, the first
    conv's 16 output channels spread over a 100x range of magnitudes and the 1x1 conv's columns
    the inverse (as trained layers compensate each other): every channel matters to the logits
    alike, and one per-tensor scale leaves the narrow ones a few int8 levels."""

    def __init__(self, act=nn.ReLU):
        super().__init__()
        self.c1, self.a1 = nn.Conv2d(3, 16, 3, padding=1), act()
        self.c2, self.a2 = nn.Conv2d(16, 16, 3, padding=1, groups=16), act()
        self.c3 = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8 * SIZE * SIZE, 10)
        spread = torch.logspace(-2, 0, 16)
        with torch.no_grad():
            self.c1.weight.mul_(spread.view(-1, 1, 1, 1) * 3)
            self.c1.bias.mul_(spread * 3)
            self.c3.weight.div_(spread.view(1, -1, 1, 1) * 30)

    def forward(self, x):
        x = self.c3(self.a2(self.c2(self.a1(self.c1(x)))))
        return self.fc(x.flatten(1))


def _model(act=nn.ReLU) -> nn.Module:
    torch.manual_seed(0)
    return Skewed(act).eval()


def _logits(tmp_path, model, photos, config, name):
    res = compile_model(model, str(tmp_path / f"{name}.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=config, ranges=Calibrate(photos[:8]), progress=False)
    lib = CompiledModel(res.lib_path)
    return res, np.concatenate([lib(x[None]) for x in photos])


def test_equalized_float_graph_is_the_float_model(tmp_path):
    """Every layer kept float (``skip=("*",)``), the equalized graph computes the model's logits:
    the rescaling moves magnitude between two convs and changes no output (float32 rounding)."""
    photos = skimage_photos(SIZE)
    model = _model()
    with torch.no_grad():
        ref = model(torch.from_numpy(photos)).numpy()
    res, got = _logits(tmp_path, model, photos, QuantConfig(equalization=True, skip=("*",)), "float")
    pairs = res.report["ranges"]["equalization"]["pairs"]
    assert [(p["layer"], p["reader"]) for p in pairs] == [("c1", "c2"), ("c2", "c3")]
    assert pairs[0]["widest_factor"] > 10     # the narrow channels were widened (not a vacuous check)
    assert sqnr_db(ref, got) > 100, sqnr_db(ref, got)


def test_equalization_raises_the_int8_accuracy_of_skewed_channels(tmp_path):
    photos = skimage_photos(SIZE)
    model = _model()
    with torch.no_grad():
        ref = model(torch.from_numpy(photos)).numpy()
    _, plain = _logits(tmp_path, model, photos, QuantConfig(), "plain")
    _, equal = _logits(tmp_path, model, photos, QuantConfig(equalization=True), "equal")
    # measured 2026-12-07 (2-core box): 40.0 dB plain, 47.2 dB equalized (the narrow channels get their int8
    # levels back); a build that equalized nothing would be the plain one
    assert sqnr_db(ref, equal) > sqnr_db(ref, plain) + 5, (sqnr_db(ref, plain), sqnr_db(ref, equal))


def test_relu6_widens_a_channel_only_as_far_as_its_input_bound_proves():
    """Behind a ReLU6 a widened channel would be clipped at 6 where the float model's is not (on
    held-out photos a channel passes its calibrated max): it widens only where the bound of its
    input (a ReLU6 before it: [0, 6]) proves it stays under 6; the first conv reads the image (no
    bound), so it does not widen at all."""
    model = _model(nn.ReLU6)
    fe = as_frontend(model)
    graph = fe.export((1, 3, SIZE, SIZE)).at(1).graph
    ly = {layer.name: layer for layer in graph.layers}
    amax = {graph.points[layer.output]: np.linspace(0.01, 1.0, 16) for layer in graph.layers if layer.kind == "conv2d"}
    g = equalize.factors(graph, amax)
    assert "c1" not in g                  # its input, the image, has no bound
    w = ly["c2"].weight.reshape(16, -1)
    bound = 6 * np.maximum(w, 0).sum(1) + ly["c2"].bias
    widened = g["c2"] > 1
    assert widened.any() and not widened.all()    # some channels provably stay under 6, some do not
    assert np.all(g["c2"][widened] * bound[widened] <= 6 + 1e-4)


def test_export_onnx_writes_the_equalized_weights(tmp_path):
    """ONNX Runtime on the exported file agrees with the TVM library built from the export's
    ranges and factors (``ExportResult.given_ranges``): the file holds the equalized weights."""
    photos = skimage_photos(SIZE)
    model = _model()
    res = export_onnx(model, str(tmp_path / "m.onnx"), input_shape=(1, 3, SIZE, SIZE),
                      config=QuantConfig(equalization=True), ranges=Calibrate(photos[:8]), progress=False)
    assert res.equalization and set(res.equalization) == {"c1", "c2"}
    lib = compile_model(model, str(tmp_path / "m.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=res.config, ranges=res.given_ranges(), progress=False)
    assert lib.report["ranges"]["equalization"]["pairs"]
    library = CompiledModel(lib.lib_path)
    ref = np.concatenate([library(x[None]) for x in photos])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"]).run(
        None, {"input": photos})[0]
    # the two differ by rounding alone (test_onnx_export.py: a real fault, one scale 10 % off, is < 25 dB)
    assert sqnr_db(ref, got) > 40, sqnr_db(ref, got)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="equalization and weight_rounding='gptq' cannot be combined"):
        QuantConfig(equalization=True, weight_rounding="gptq")
    with pytest.raises(InputError, match="equalization needs the activations' per-channel ranges"):
        compile_model(_model(), str(tmp_path / "m.so"), options=BuildOptions(image_size=SIZE, verify=False),
                      config=QuantConfig(equalization=True), ranges=GivenRanges({"x": 1.0}), progress=False)


def test_the_cli_flag():
    def scheme(*argv):
        return deploy.quant_config(deploy.build_parser().parse_args([*argv, "--model", "resnet18", "-o", "x.so"]))
    assert scheme("build").equalization is False
    assert scheme("build", "--equalization").equalization is True
    assert scheme("export-onnx", "--equalization").equalization is True
