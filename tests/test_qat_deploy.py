"""One path from training to deployment: a QAT checkpoint compiles with its learned scales, its int8
weights, and the QAT model's accuracy on the digits test split."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import deploy
from tvm_qconv.build import BuildOptions, compile_checkpoint
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import evaluate_library
from tvm_qconv.models import SmallVGG
from tvm_qconv.nn import QuantizedConv2d, QuantizedLinear, quantize_weight
from tvm_qconv.schedules.nchw4c.conv2d import pack_oihw4o4i
from tvm_qconv.schedules.nchw4c.layout import ceil4
from tvm_qconv.training import (TrainConfig, build_model, evaluate, load_checkpoint, load_digits,
                             run_training, save_checkpoint)

# 3 epochs: ~91 % on the 360 test digits in ~6 s on one core (5 epochs: 97.5 % in ~10 s); enough
# for the comparison to mean something, since one digit is 0.28 points.
QAT_CONFIG = TrainConfig(model="small_vgg", epochs=3, qat=True, seed=0)


@pytest.fixture(scope="module")
def qat_lib(tmp_path_factory):
    """A QAT checkpoint and the llvm library deploy.py builds from it (``compile_checkpoint``)."""
    folder = tmp_path_factory.mktemp("qat_deploy")
    ckpt = str(folder / "ckpt.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_train.py: OpenMP spinning on a shared 2-core machine
    try:
        run_training(QAT_CONFIG, out=ckpt, baseline=False, report=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    res = compile_checkpoint(ckpt, str(folder / "small_vgg.so"), progress=False)
    return ckpt, res


def test_compiled_int8_accuracy_equals_qat_accuracy_on_digits(qat_lib, capsys):
    ckpt, res = qat_lib
    model, _ = load_checkpoint(ckpt)
    acc_qat = evaluate(model, load_digits(QAT_CONFIG)[1])
    acc_int8 = evaluate_library(res.lib_path)
    with capsys.disabled():
        print(f"\ndigits test split ({acc_int8['total']} images): QAT (PyTorch) {acc_qat:.2f}%  "
              f"compiled int8 (llvm) {acc_int8['accuracy']:.2f}%")
    assert acc_qat > 80.0  # the checkpoint really trained
    # Both run the same int8 weights and input scales; what differs is the epilogue: PyTorch adds the
    # float bias to acc * s_x * s_w in float32, the kernel adds an int32 bias rounded to the
    # accumulator's scale (error <= 0.5 acc units, ~1e-4 output units) and requantizes in fixed point.
    # The input quantizers agree bit for bit (both round half to even: digits' pixel levels 4/16
    # and 12/16 are ties, -63.5 and 63.5).  0.02 % of activations move by one int8 step (each conv
    # alone: 48-241 values, all within 3e-4 of a rounding midpoint), which moved no prediction
    # on this split (logits within ~0.05 of each other).  0.1 point
    # is less than one digit (0.28): the two must classify the same number of digits correctly.
    assert abs(acc_int8["accuracy"] - acc_qat) <= 0.1


def test_build_takes_every_activation_scale_from_the_checkpoint(qat_lib):
    ckpt, res = qat_lib
    learned = torch.load(ckpt, weights_only=True)["amax"]
    with open(res.lib_path[:-3] + ".json") as f:
        meta = json.load(f)
    ranges = meta["report"]["ranges"]
    assert ranges["source"] == "checkpoint" and ranges["calibrated"] is False and ranges["checkpoint"] == ckpt
    assert all(meta["amax"][point] == learned[key] for point, key in ranges["points"].items())
    rows = {r["layer"]: r for r in meta["report"]["layers"]}
    # Exactly learned_amax / 127 in float32: the scale QAT quantized this layer's input with.
    def f32(v):
        return float(np.float32(v))
    assert rows["features.0"]["in_scale"] == f32(learned["features.0.in0"] / 127)
    # A conv's output is requantized to the scale the *next* layer's input quantizer learned (QAT
    # quantizes where a tensor is consumed), carried through the max-pool unchanged.
    assert rows["features.0"]["out_scale"] == f32(learned["features.3.in0"] / 127)
    assert rows["features.3"]["in_scale"] == f32(learned["features.3.in0"] / 127)
    assert rows["classifier.1"]["in_scale"] == f32(learned["classifier.1.in0"] / 127)
    assert meta["dataset"] == {"name": "digits", "seed": QAT_CONFIG.seed, "image_size": QAT_CONFIG.image_size}


def test_int8_weights_are_bit_identical_to_the_trained_ones(qat_lib):
    ckpt, res = qat_lib
    model, _ = load_checkpoint(ckpt)
    expected = []
    for m in model.modules():
        if isinstance(m, QuantizedConv2d):
            expected.append(pack_oihw4o4i(quantize_weight(m.weight)[0].numpy()))
        elif isinstance(m, QuantizedLinear):
            w = quantize_weight(m.weight)[0].numpy()
            padded = np.zeros((w.shape[0], ceil4(w.shape[1])), np.int8)  # K padded to 4, as the kernel takes it
            padded[:, : w.shape[1]] = w
            expected.append(padded)
    with np.load(res.lib_path[:-3] + ".params.npz") as npz:
        built = [npz[n] for n in res.meta["param_names"] if npz[n].dtype == np.int8]
    assert len(built) == len(expected) == 6  # 4 convs, 2 linear layers
    for got, want in zip(built, expected):
        np.testing.assert_array_equal(got, want)


def cli_error(capsys, *argv) -> str:
    assert deploy.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err  # one line
    return err


def test_eval_cli_prints_the_compiled_and_the_recorded_accuracy(qat_lib, capsys):
    _, res = qat_lib
    assert deploy.main(["eval", "--lib", res.lib_path, "--dataset", "digits"]) == 0
    out = capsys.readouterr().out
    assert "digits test split (seed 0, 360 images): compiled int8" in out and "qat " in out


def test_float_trained_checkpoint_is_refused(tmp_path, capsys):
    config = TrainConfig(model="small_vgg", qat=False)
    path = str(tmp_path / "float.pt")
    save_checkpoint(path, build_model(config), config, {})
    with pytest.raises(InputError, match=r"trained in float .* retrain with `python train.py --model small_vgg --qat"):
        compile_checkpoint(path, str(tmp_path / "m.so"), progress=False)
    err = cli_error(capsys, "build", "--checkpoint", path, "-o", str(tmp_path / "m.so"))
    assert "trained in float" in err
    assert not list(tmp_path.glob("m.*"))  # nothing was written


def test_plain_state_dict_is_not_a_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "sd.pt")
    torch.save(SmallVGG().state_dict(), path)
    err = cli_error(capsys, "build", "--checkpoint", path, "-o", str(tmp_path / "m.so"))
    assert "is not a train.py checkpoint" in err and "--model NAME --weights FILE" in err


MISSING = [("drop", "features.6.in0", r"no learned range for \['features\.6\.in0'\]"),
           ("zero", "classifier.1.in0", r"range of 0 or NaN for \['classifier\.1\.in0'\]")]


@pytest.mark.parametrize("how, key, message", MISSING, ids=["missing", "never_observed"])
def test_checkpoint_lacking_a_range_names_it(qat_lib, tmp_path, how, key, message):
    ckpt = torch.load(qat_lib[0], weights_only=True)
    if how == "drop":
        del ckpt["amax"][key]
    else:
        ckpt["amax"][key] = 0.0
    path = str(tmp_path / "bad.pt")
    torch.save(ckpt, path)
    with pytest.raises(InputError, match=message):
        compile_checkpoint(path, str(tmp_path / "m.so"), progress=False)


REFUSED = [(["--calibration", "max"], "--calibration cannot be used with --checkpoint"),
           (["--weights", "x.pt"], "--weights cannot be used with --checkpoint"),
           (["--image-size", "64"], "was trained at 32x32")]


@pytest.mark.parametrize("flags, message", REFUSED, ids=["calibration", "weights", "image_size"])
def test_checkpoint_build_refuses_flags_it_would_ignore(qat_lib, tmp_path, capsys, flags, message):
    err = cli_error(capsys, "build", "--checkpoint", qat_lib[0], *flags, "-o", str(tmp_path / "m.so"))
    assert message in err


def test_build_needs_a_model_or_a_checkpoint(capsys):
    with pytest.raises(SystemExit):
        deploy.main(["build", "-o", "m.so"])
    assert "one of the arguments --model --checkpoint is required" in capsys.readouterr().err


def test_checkpoint_build_keeps_the_given_options_and_takes_the_trained_size(qat_lib, tmp_path):
    """Options without an image size: the checkpoint's size, and every other option kept (a build
    once fell back to the default options when no size was given)."""
    ckpt, _ = qat_lib
    res = compile_checkpoint(ckpt, str(tmp_path / "m.so"), progress=False,
                             options=BuildOptions(batch=2, verify=False, families=("cpu",)))
    assert res.meta["input_shape"] == [2, 3, QAT_CONFIG.image_size, QAT_CONFIG.image_size]
    assert tuple(res.meta["options"]["families"]) == ("cpu",) and "verify" not in res.report
