"""``QuantConfig.bias_correction``: each conv / linear bias corrected for its int8 weights' mean
error on the calibration images (``quantization/scales.py: weight_error_mean``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.ranges.observers import quantize_weight_per_channel
from tvm_qconv.ranges import Calibrate, GivenRanges
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.quantization.scales import weight_error_mean

SIZE = 16


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_weight_error_mean_is_the_conv_of_the_mean_input(groups):
    # on an input whose every pixel of channel c is mean[c] (no padding), conv(x, W_q - W) is
    # that mean error at every output pixel
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 12 // groups, 3, 3)).astype(np.float32)
    qw, s_w = quantize_weight_per_channel(w)
    mean = rng.normal(size=12)
    x = torch.from_numpy(np.broadcast_to(mean[None, :, None, None], (1, 12, 5, 5)).copy())
    err_w = torch.from_numpy(qw.astype(np.float64) * s_w.astype(np.float64)[:, None, None, None] - w)
    want = torch.nn.functional.conv2d(x, err_w, groups=groups)[0, :, 2, 2].numpy()
    np.testing.assert_allclose(weight_error_mean(w, qw, s_w, mean, groups), want, rtol=1e-9, atol=1e-12)


class Biased(nn.Module):
    """A conv whose int8 weights err one way: per output channel one weight of 1 sets the scale
    (1/127) and 63 weights of 0.004 round up to 0.00787, each +0.0039, on inputs of mean ~3
    (the first conv's bias 3, ReLU): ~0.7 of error on outputs of ~4, the same at every pixel."""

    def __init__(self):
        super().__init__()
        self.lift = nn.Conv2d(3, 64, 1)
        self.conv = nn.Conv2d(64, 8, 1)
        with torch.no_grad():
            self.lift.weight.copy_(torch.randn(64, 3, 1, 1) * 0.2)
            self.lift.bias.fill_(3.0)
            self.conv.weight.fill_(0.004)
            self.conv.weight[:, 0] = 1.0
            self.conv.bias.zero_()

    def forward(self, x):
        return self.conv(torch.relu(self.lift(x))).mean((2, 3))


def _build_and_run(tmp_path, model, photos, correct: bool) -> np.ndarray:
    lib = str(tmp_path / f"biased_{correct}.so")
    compile_model(model, lib, options=BuildOptions(image_size=SIZE, verify=False), name="biased",
                  config=QuantConfig(bias_correction=correct), ranges=Calibrate(photos), progress=False)
    return np.concatenate([CompiledModel(lib)(x[None]) for x in photos])


def test_bias_correction_removes_a_systematic_weight_error(tmp_path):
    torch.manual_seed(0)
    model = Biased().eval()
    photos = skimage_photos(SIZE)
    with torch.no_grad():
        ref = model(torch.from_numpy(photos)).numpy()
    plain = sqnr_db(ref, _build_and_run(tmp_path, model, photos, False))
    corrected = sqnr_db(ref, _build_and_run(tmp_path, model, photos, True))
    # plain: the +0.7 offset on ~4 (~15 dB); corrected: what remains is rounding noise
    assert plain < 20 and corrected > plain + 15, (plain, corrected)


def test_bias_correction_needs_calibrated_means(tmp_path):
    model = Biased().eval()
    with pytest.raises(InputError, match="bias correction needs the inputs' means"):
        compile_model(model, str(tmp_path / "m.so"), options=BuildOptions(image_size=SIZE, verify=False),
                      config=QuantConfig(bias_correction=True), ranges=GivenRanges({"x": 1.0}), progress=False)


def test_the_weight_error_mean_in_blocks_is_the_whole_formula_bit_for_bit():
    """A linear layer of 3000 x 700 is computed ~500 rows at a time (VGG16's first would take
    0.8 GB a temporary whole): each row's float64 sums are those of the formula on the whole."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3000, 700)).astype(np.float32)
    qw, s_w = quantize_weight_per_channel(w)
    mean = rng.normal(size=700)
    err = qw.astype(np.float64) * s_w.astype(np.float64)[:, None] - w.astype(np.float64)
    np.testing.assert_array_equal(weight_error_mean(w, qw, s_w, mean), (err * mean[None]).sum(axis=1))


def test_the_cli_flags_turn_it_on_and_off():
    """``--bias-correction`` / ``--no-bias-correction`` of `build` and `export-onnx` alike (the ONNX
    file carries the plan's corrected biases: ``test_export_onnx_writes_the_plans_corrected_biases``);
    neither: None, the default decided by the build (on where it calibrates)."""
    def scheme(*argv):
        return deploy.quant_config(deploy.build_parser().parse_args([*argv, "--model", "resnet18", "-o", "x.so"]))
    assert scheme("build", "--bias-correction").bias_correction is True
    assert scheme("build", "--no-bias-correction").bias_correction is False
    assert scheme("build").bias_correction is None and scheme("build").unsigned_activations is None
    assert scheme("build", "--no-unsigned-activations").unsigned_activations is False
    assert scheme("export-onnx", "--bias-correction").bias_correction is True


@pytest.mark.parametrize("config, ranges, unsigned, corrected", [
    (QuantConfig(), "calibrate", True, True),                           # the default, calibrated
    (QuantConfig(weight_rounding="gptq"), "calibrate", True, False),    # GPTQ corrects the mean itself
    (QuantConfig(), "given", False, False),                             # given ranges: as they were made
    (QuantConfig(unsigned_activations=True), "given", True, False),     # a value set stays
    (QuantConfig(bias_correction=False, unsigned_activations=False), "calibrate", False, False),
])
def test_the_default_scheme_is_decided_by_where_the_ranges_come_from(tmp_path, config, ranges, unsigned, corrected):
    """``QuantConfig()``: unsigned activations and bias correction where the build calibrates (the
    best scheme held out on trained networks, issue 58), off for given / learned / file ranges; the
    library's json records the scheme as decided."""
    torch.manual_seed(0)
    photos = skimage_photos(SIZE)[:4]
    source = Calibrate(photos) if ranges == "calibrate" else GivenRanges(
        compile_model(Biased().eval(), str(tmp_path / "r.so"), options=BuildOptions(image_size=SIZE, verify=False),
                      ranges=Calibrate(photos), progress=False).meta["amax"])
    res = compile_model(Biased().eval(), str(tmp_path / "m.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=config, ranges=source, progress=False)
    assert (res.meta["config"]["unsigned_activations"], res.meta["config"]["bias_correction"]) == (unsigned, corrected)
    assert bool(res.report["unsigned"]) == unsigned
    assert any(row.get("bias_corrected") for row in res.report["layers"]) == corrected


def test_export_onnx_writes_the_plans_corrected_biases(tmp_path):
    """The ONNX file's conv biases are the plan's (``LayerPlan.bias``), corrected with
    ``bias_correction``: before, the ONNX lowering read the graph's and wrote them uncorrected."""
    import onnx
    from onnx import numpy_helper

    from tvm_qconv.onnx_export import export_onnx

    torch.manual_seed(0)
    photos = skimage_photos(SIZE)
    biases = {}
    for correct in (False, True):
        path = str(tmp_path / f"biased_{correct}.onnx")
        export_onnx(Biased().eval(), path, input_shape=(1, 3, SIZE, SIZE), config=QuantConfig(bias_correction=correct),
                    ranges=Calibrate(photos), progress=False)
        inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
        biases[correct] = inits["conv.bias"]
    assert np.all(biases[False] == 0)                 # the model's own bias (zero)
    # corrected: each channel's bias lowered by its weights' mean error on the inputs' mean (~0.7, the
    # docstring of Biased); the same in every channel, as every channel has the same weights
    assert np.all(biases[True] < -0.3) and np.ptp(biases[True]) < 1e-6, biases[True]


def test_build_and_export_onnx_print_the_scheme_they_ran(tmp_path, capsys):
    """The CLI says the scheme as the build decided it: a user of the default learns that it
    calibrated unsigned with bias correction, and on how many tensors and layers."""
    (tmp_path / "tiny.py").write_text("import torch\nfrom torch import nn\n\ndef make():\n    torch.manual_seed(0)\n"
                                      "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),"
                                      " nn.Linear(8 * 16 * 16, 5)).eval()\n")
    model = str(tmp_path / "tiny.py") + ":make"
    assert deploy.main(["build", "--model", model, "--image-size", str(SIZE), "-q", "-o", str(tmp_path / "a.so")]) == 0
    assert "scheme: unsigned activations (2 tensors at zero point -128); bias correction (2 layers); weights " \
           "rounded to nearest" in capsys.readouterr().out
    assert deploy.main(["build", "--model", model, "--image-size", str(SIZE), "-q", "--no-unsigned-activations",
                        "--no-bias-correction", "-o", str(tmp_path / "b.so")]) == 0
    assert "scheme: symmetric activations; no bias correction; weights rounded to nearest" in capsys.readouterr().out
    assert deploy.main(["export-onnx", "--model", model, "--image-size", str(SIZE), "-q",
                        "-o", str(tmp_path / "a.onnx")]) == 0
    out = capsys.readouterr().out
    assert "(per tensor, zero point -128 where unsigned, else 0)" in out
    assert "scheme: unsigned activations; bias correction; weights rounded to nearest" in out
