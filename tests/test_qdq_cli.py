"""A Q/DQ ONNX file keeps its scales through the command line, as through the Python API: `build`,
`export-onnx` and `compare` take the file's ranges, never a calibration (issue 56, item 1: the CLI
passed calibrated ranges that overrode the file's, and a file written by `export-onnx` built into a
library whose parameters differed from the one it came from).

llvm builds at 32-64 px on the CPU; the photos are scikit-image's."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torchvision
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.data import skimage_photos

MODEL = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(16, 8, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))
'''
SIZE = 32


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qdq_cli") / "net.py"
    path.write_text(MODEL)
    return f"{path}:make"


def _params(stem) -> dict:
    with np.load(f"{stem}.params.npz") as f:
        return {k: f[k] for k in f.files}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert len(pa) == len(pb)
    for (ka, va), (kb, vb) in zip(pa.items(), pb.items()):
        np.testing.assert_array_equal(va, vb, err_msg=f"{ka} / {kb}")


def test_export_onnx_output_builds_from_the_cli_into_the_library_it_came_from(model_file, tmp_path, capsys):
    assert deploy.main(["build", "--model", model_file, "--image-size", str(SIZE), "-q",
                        "-o", str(tmp_path / "a.so")]) == 0
    assert deploy.main(["export-onnx", "--model", model_file, "--image-size", str(SIZE), "-q",
                        "-o", str(tmp_path / "q.onnx")]) == 0
    capsys.readouterr()
    assert deploy.main(["build", "--model", str(tmp_path / "q.onnx"), "-q", "-o", str(tmp_path / "b.so")]) == 0
    out = capsys.readouterr().out
    # the range source is the file, in the report's line and in the library's record
    assert f"activation ranges: the Q/DQ file's own scales, from {tmp_path / 'q.onnx'}" in out
    ranges = json.loads((tmp_path / "b.json").read_text())["report"]["ranges"]
    assert ranges["source"] == "file" and ranges["calibrated"] is False and not ranges["notes"]
    # every parameter of the rebuilt library is the original's (weights, biases, multipliers)
    _assert_same_params(tmp_path / "a", tmp_path / "b")
    # export-onnx of the Q/DQ file writes the same scales back (its ranges are the file's, not calibrated)
    assert deploy.main(["export-onnx", "--model", str(tmp_path / "q.onnx"), "-q", "-o", str(tmp_path / "r.onnx")]) == 0
    assert "the Q/DQ file's own scales" in capsys.readouterr().out
    assert deploy.main(["build", "--model", str(tmp_path / "r.onnx"), "-q", "-o", str(tmp_path / "c.so")]) == 0
    _assert_same_params(tmp_path / "a", tmp_path / "c")


class _Photos(CalibrationDataReader):
    def __init__(self, photos):
        self.it = iter([{"image": p[None]} for p in photos])

    def get_next(self):
        return next(self.it, None)


def test_onnx_runtimes_quantize_static_output_keeps_its_scales_from_the_cli(tmp_path, capsys):
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    torch.onnx.export(model, (torch.randn(1, 3, 64, 64),), str(tmp_path / "f.onnx"), opset_version=17,
                      dynamo=False, input_names=["image"], output_names=["logits"])
    # calibrated on other photos than the CLI's default (scikit-image's first 8): a recalibration shows
    quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), _Photos(skimage_photos(64)[8:16]),
                    quant_format=QuantFormat.QDQ, per_channel=True, weight_type=QuantType.QInt8,
                    activation_type=QuantType.QInt8, extra_options={"ActivationSymmetric": True})
    assert deploy.main(["build", "--model", str(tmp_path / "q.onnx"), "-q", "-o", str(tmp_path / "cli.so")]) == 0
    assert json.loads((tmp_path / "cli.json").read_text())["report"]["ranges"]["source"] == "file"
    # the Python API keeps the file's scales (tests/test_onnx_qdq.py: it agrees with ONNX Runtime's run
    # of the file); the command line's library is that one, parameter for parameter
    compile_model(str(tmp_path / "q.onnx"), str(tmp_path / "api.so"), options=BuildOptions(image_size=64),
                  progress=False)
    _assert_same_params(tmp_path / "api", tmp_path / "cli")


@pytest.mark.parametrize("flag", [["--calib-dir", "."], ["--calibration", "entropy"], ["--num-calib", "4"],
                                  ["--percentile", "99.9"], ["--bias-correction"]],
                         ids=["calib-dir", "calibration", "num-calib", "percentile", "bias-correction"])
def test_calibration_flags_with_a_qdq_file_are_refused_by_name(flag, model_file, tmp_path, capsys):
    assert deploy.main(["export-onnx", "--model", model_file, "--image-size", str(SIZE), "-q",
                        "-o", str(tmp_path / "q.onnx")]) == 0
    capsys.readouterr()
    assert deploy.main(["build", "--model", str(tmp_path / "q.onnx"), *flag, "-o", str(tmp_path / "b.so")]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} cannot be used with {tmp_path / 'q.onnx'}: it is a quantized (Q/DQ) file" in err
    assert not (tmp_path / "b.so").exists()


def test_compare_builds_a_qdq_file_with_its_own_scales_and_size(model_file, tmp_path, capsys):
    # no --image-size: the file fixes its size (compare used to ask for 224 and stop)
    assert deploy.main(["export-onnx", "--model", model_file, "--image-size", str(SIZE), "--static-batch", "-q",
                        "-o", str(tmp_path / "q.onnx")]) == 0
    assert deploy.main(["build", "--model", str(tmp_path / "q.onnx"), "-q", "-o", str(tmp_path / "b.so")]) == 0
    capsys.readouterr()
    assert deploy.main(["compare", "--model", str(tmp_path / "q.onnx"), "--device", "cpu", "--batch", "1",
                        "--baselines", "int8", "--budget", "0.2", "--out", str(tmp_path / "out"),
                        "--work-dir", str(tmp_path / "work")]) == 0
    assert "took the Q/DQ file's scales of" in capsys.readouterr().out
    _assert_same_params(tmp_path / "b", tmp_path / "work" / "q_b1")
    assert deploy.main(["compare", "--model", str(tmp_path / "q.onnx"), "--device", "cpu", "--calib-dir", ".",
                        "--out", str(tmp_path / "out")]) == 2
    assert "--calib-dir cannot be used with" in capsys.readouterr().err
