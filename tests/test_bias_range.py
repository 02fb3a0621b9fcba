"""A conv whose float bias int32 cannot hold at its accumulator's scale ``s_x * s_w``: an input
faded to ~1e-9 of the bias (deep random-init networks), where the bias saturated and the layer
wrote zeros (``quantization/scales.py: bias_weight_scales``)."""
import json

import numpy as np

import deploy
from tvm_qconv.quantization.scales import BIAS_ACC_LIMIT, bias_weight_scales
from tvm_qconv.schedules.requantize import quantize_multiplier


def test_only_a_bias_beyond_int32_raises_its_channels_weight_scale():
    s_w = np.full(3, 0.003, np.float32)
    bias = np.array([0.05, 0.0, -0.05])
    # at a usual input scale every bias fits: the weight steps (and so the integers) are unchanged
    assert np.array_equal(bias_weight_scales(bias, 0.02, s_w), s_w)
    # at 1e-11 the biases are ~1.7e12 accumulator steps: raised to the step where they are
    # BIAS_ACC_LIMIT; the bias-free channel keeps its own
    faded = bias_weight_scales(bias, 1e-11, s_w)
    assert faded[1] == s_w[1] and faded[0] == faded[2] > s_w[0]
    np.testing.assert_allclose(np.abs(bias[[0, 2]]) / (1e-11 * faded[[0, 2]].astype(np.float64)), BIAS_ACC_LIMIT,
                               rtol=1e-6)   # float32 rounding of the scale
    # the requantize multiplier s_x * s_w / s_y (s_y: the bias at 127 steps) rounded to 0 before;
    # now it is a 31-bit integer
    s_y = 0.05 / 127
    assert np.all(quantize_multiplier(1e-11 * s_w[[0, 2]] / s_y)[0] == 0)
    assert np.all(quantize_multiplier(1e-11 * faded[[0, 2]] / s_y)[0] >= 2 ** 30)


# LR-ASPP's head in small (torchvision's lraspp_mobilenet_v3_large, random init): the sum of a
# classifier of the image and a biased classifier of a feature map whose activations have faded
# to ~1e-9, as a deep random-init backbone's do; the second classifier's output is its bias.
FADED_BRANCH_MODEL = '''
import torch
from torch import nn


class FadedBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.low = nn.Conv2d(3, 6, 1)
        self.faded = nn.Conv2d(3, 8, 3, padding=1)
        self.high = nn.Conv2d(8, 6, 1)
        with torch.no_grad():
            self.faded.weight *= 1e-9
            self.faded.bias *= 1e-9

    def forward(self, x):
        return self.low(x) + self.high(torch.relu(self.faded(x)))


def make():
    return FadedBranch()
'''


def test_a_bias_that_fits_no_int32_at_a_faded_input_scale_is_kept(tmp_path, capsys):
    # Was 0.0 dB at `high` (LR-ASPP's classifier.high_classifier at 0.0 dB, logits 6.9 dB): at the
    # input's scale ~1e-11, bias / (s_x * s_w) is ~1e12, beyond int32, so the bias saturated and
    # the requantize multiplier s_x * s_w / s_y (~1e-11) underflowed to 0: the layer wrote zeros
    # where the float model has its bias.  The layer now quantizes its weights at a scale that
    # holds the bias (the faded input's products are below an output step either way).
    (tmp_path / "net.py").write_text(FADED_BRANCH_MODEL)
    out = tmp_path / "net.so"
    # accuracy_target_db=100: the per-layer build runs, and measures `high` on its own (from the
    # CLI, --accuracy-target would also keep layers in float to reach it)
    from tvm_qconv.build import BuildOptions, compile_model
    compile_model(f"{tmp_path / 'net.py'}:make", str(out), options=BuildOptions(image_size=16, accuracy_target_db=100),
                  progress=False)
    report = json.loads(out.with_suffix(".json").read_text())["report"]
    verify = report["verify"]
    high = next(r for r in report["layers"] if r["layer"] == "high")
    layers = {ly["layer"]: ly["sqnr_db"] for ly in verify["layers"]}
    assert high["in_scale"] < 1e-9 and not high.get("bias_saturated")
    assert high["weight_scale_raised"] == 6                 # every channel's bias needed it
    assert verify["status"] == "ok" and verify["logits_sqnr_db"] > 30.0, verify   # measured 37.1; before: 10.3
    assert layers["high"] > 40.0, layers                    # measured 51.0; before: 0.0 (all zeros)
    assert verify["first_bad_layer"] is None
