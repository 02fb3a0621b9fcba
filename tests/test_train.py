"""QAT on digits, the checkpoint format, and state-dict interchange between the float and int8 VGGs."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torchvision

from tvm_qconv.models import QuantizedVGG16, SmallQuantizedVGG, SmallVGG, quantized_resnet50
from tvm_qconv.nn import (
    QuantizedConv2d,
    QuantizedConv2dReLU,
    QuantizedLinear,
    TorchConv2dReLU,
    learned_amax,
    load_float_state_dict,
    to_float_state_dict,
)
from tvm_qconv.training import TrainConfig, evaluate, load_checkpoint, load_digits, run_training

# 5 epochs: the float SmallVGG is at ~98 % on the 360 test digits; one digit is 0.28 points.
QAT_CONFIG = TrainConfig(model="small_vgg", epochs=5, qat=True, seed=0)


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    """One QAT run with its float baseline, shared by the tests below."""
    path = tmp_path_factory.mktemp("qat") / "ckpt.pt"
    # One thread: on a 2-core machine shared with other jobs, OpenMP's spinning barriers made
    # the 2-thread run up to 10x slower (2 min) whenever a core was busy; one thread takes ~20 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_training(QAT_CONFIG, out=str(path), baseline=True, report=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    return result, path


def test_qat_small_vgg_reaches_float_accuracy_on_digits(qat_run):
    acc = qat_run[0]["accuracy"]
    assert acc["float"] > 90.0, acc  # the float baseline really trained
    # QAT within one point of float (3.6 of the 360 test digits): the int8 rounding costs little.
    assert acc["qat"] >= acc["float"] - 1.0, acc


def test_qat_with_int8_input_gradients_reaches_float_accuracy_on_digits(qat_run, tmp_path):
    # input_grad="int8": every layer's dx from its output gradient quantized to int8 (per tensor);
    # one thread, as the fixture (~10 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_training(dataclasses.replace(QAT_CONFIG, input_grad="int8"), str(tmp_path / "ckpt.pt"),
                              baseline=False, report=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    assert result["accuracy"]["qat"] >= qat_run[0]["accuracy"]["float"] - 1.0, result["accuracy"]
    ckpt = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["config"]["input_grad"] == "int8"


def test_checkpoint_has_learned_ranges_for_every_quantized_layer(qat_run):
    result, path = qat_run
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert set(ckpt) == {"state_dict", "amax", "config", "accuracy"}
    layers = [name for name, m in result["model"].named_modules()
              if isinstance(m, (QuantizedConv2dReLU, QuantizedLinear))]
    assert layers == ["features.0", "features.3", "features.6", "features.8", "classifier.1", "classifier.3"]
    expected = {f"{name}.{suffix}" for name in layers for suffix in ("in0", "out")}
    assert set(ckpt["amax"]) == expected
    assert all(math.isfinite(v) and v > 0 for v in ckpt["amax"].values())
    # The first conv sees the normalized digits, (x - 0.5) / 0.5 in [-1, 1]: every batch has both ends.
    assert ckpt["amax"]["features.0.in0"] == pytest.approx(1.0)
    # A 2x2 max-pool keeps the max: the next conv's input range is the previous conv's output range.
    assert ckpt["amax"]["features.3.in0"] == pytest.approx(ckpt["amax"]["features.0.out"], rel=1e-6)
    assert ckpt["config"] == QAT_CONFIG.to_dict() and ckpt["accuracy"] == result["accuracy"]


def test_checkpoint_loads_strictly_into_the_float_model(qat_run):
    ckpt = torch.load(qat_run[1], map_location="cpu", weights_only=True)
    SmallVGG().load_state_dict(ckpt["state_dict"], strict=True)


def test_reloaded_checkpoint_reproduces_qat_accuracy(qat_run):
    result, path = qat_run
    model, ckpt = load_checkpoint(str(path))
    assert learned_amax(model) == ckpt["amax"]
    assert evaluate(model, load_digits(QAT_CONFIG)[1]) == result["accuracy"]["qat"]


def test_float_small_vgg_state_dict_loads_into_quantized_and_back():
    torch.manual_seed(0)
    float_model, qat_model = SmallVGG(), SmallQuantizedVGG()
    # strict=False: exactly the learned-range buffers are missing, nothing else.
    missing, unexpected = qat_model.load_state_dict(float_model.state_dict(), strict=False)
    assert unexpected == [] and missing and all(k.endswith(("input_amax", "output_amax")) for k in missing)
    load_float_state_dict(qat_model, float_model.state_dict())  # the same, checked
    back = SmallVGG()
    back.load_state_dict(to_float_state_dict(qat_model.state_dict()), strict=True)
    for k, v in float_model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_float_and_quantized_twins_share_state_dicts():
    q, f = SmallQuantizedVGG(quantized=True), SmallQuantizedVGG(quantized=False)
    assert isinstance(f.features[0], TorchConv2dReLU)
    f.load_state_dict(q.state_dict(), strict=True)


def test_vgg16_parameter_names_match_torchvision():
    with torch.device("meta"):  # names and shapes only: no 138M-parameter allocation
        ours = QuantizedVGG16()
        tv = torchvision.models.vgg16(weights=None)
    ours_sd = to_float_state_dict(ours.state_dict())
    assert {k: v.shape for k, v in ours_sd.items()} == {k: v.shape for k, v in tv.state_dict().items()}


def test_resnet50_is_torchvisions_with_every_conv_and_the_classifier_int8():
    torch.manual_seed(0)
    ours = quantized_resnet50(num_classes=10)
    torch.manual_seed(0)
    tv = torchvision.models.resnet50(num_classes=10)
    convs = [m for m in ours.modules() if isinstance(m, torch.nn.Conv2d)]
    # 53 convs (the stem, 16 bottlenecks x 3, 4 downsamples), each followed by BatchNorm: no fused ReLU
    assert len(convs) == 53 and all(type(m) is QuantizedConv2d for m in convs)
    assert type(ours.fc) is QuantizedLinear
    sd = to_float_state_dict(ours.state_dict())
    assert sd.keys() == tv.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in tv.state_dict().items())   # the same weights, same seed
    twin = quantized_resnet50(num_classes=10, quantized=False)
    load_float_state_dict(twin, tv.state_dict())
    x = torch.randn(2, 3, 64, 64)
    ours.eval(), twin.eval(), tv.eval()
    with torch.no_grad():
        assert torch.equal(twin(x), tv(x))     # the float twin computes torchvision's model exactly


def test_vgg16_adapts_its_classifier_to_32x32():
    torch.manual_seed(0)
    model = QuantizedVGG16(num_classes=10, image_size=32, classifier_width=64)
    assert model.classifier[0].in_features == 512  # 1x1 after five pools, not 7x7
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    out.sum().backward()
    assert out.shape == (2, 10) and torch.isfinite(model.features[0].weight.grad).all()


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig(model="resnet")
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        TrainConfig(epochs=0)
    with pytest.raises(ValueError, match="input_grad must be one of"):
        TrainConfig(qat=True, input_grad="int4")
    with pytest.raises(ValueError, match="input_grad is the int8 layers'"):
        TrainConfig(input_grad="int8")                  # a float run has no int8 gradients
    with pytest.raises(ValueError, match="weight_grad is the int8 layers'"):
        TrainConfig(weight_grad="int8")
    with pytest.raises(ValueError, match="input_range must be one of"):
        TrainConfig(qat=True, input_range="ema")
    with pytest.raises(ValueError, match="input_range is the int8 layers'"):
        TrainConfig(input_range="delayed")
    assert TrainConfig.from_dict(QAT_CONFIG.to_dict()) == QAT_CONFIG
    # a config saved before weight_grad and input_range existed loads with their defaults
    old = {k: v for k, v in QAT_CONFIG.to_dict().items() if k not in ("weight_grad", "input_range")}
    assert TrainConfig.from_dict(old) == QAT_CONFIG


def test_cli_rejects_non_positive_epochs(capsys):
    import train

    with pytest.raises(SystemExit):
        train.main(["--epochs", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


def test_cli_refuses_int8_gradients_without_qat(capsys):
    import train

    with pytest.raises(SystemExit) as exit_info:
        train.main(["--input-grad", "int8"])
    assert exit_info.value.code == 2 and "add --qat" in capsys.readouterr().err
