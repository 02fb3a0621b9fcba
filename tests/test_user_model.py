"""A user's own nn.Module compiles from Python and from the CLI (``--model file.py:factory``)."""
import json

import numpy as np
import pytest
import torch

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.frontend import load_model
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel

MODEL_FILE = '''
import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Widths:  # a dataclass looks its module up in sys.modules while it is defined
    hidden: int = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU6(),
                                  nn.Conv2d(12, 12, 3, padding=1, groups=12), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def make():
    return Net()


def broken():
    raise RuntimeError("no weights here")


def silent():
    raise RuntimeError()
'''


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return str(path)


def test_users_module_compiles_from_python_and_matches_float(tmp_path, model_file):
    model = load_model(f"{model_file}:make")
    x = skimage_photos(16)[:4]
    lib = compile_model(model, str(tmp_path / "net.so"), options=BuildOptions(image_size=16), ranges=Calibrate(x),
                        progress=False)
    assert {r["kernel"] for r in lib.report["layers"]} >= {"conv2d.nchw4c.cpu", "conv2d.nchw4c.depthwise"}
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    got = np.concatenate([CompiledModel(lib.lib_path)(x[i:i + 1]) for i in range(4)])
    assert sqnr_db(ref, got) > 30.0  # 3 int8 layers: ~40 dB


def test_users_module_builds_from_the_cli(tmp_path, model_file, capsys):
    out = tmp_path / "net.so"
    assert deploy.main(["build", "--model", f"{model_file}:Net", "--image-size", "16", "-o", str(out)]) == 0
    assert "conv2d.nchw4c.depthwise" in capsys.readouterr().out
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["report"]["verify"]["status"] == "ok"


BAD_SPECS = [("missing.py:make", "does not exist"), ("{}:nope", "has no function or class 'nope'"),
             ("{}:broken", "broken() raised RuntimeError: no weights here"), ("{}", "path/to/file.py:factory"),
             ("{}:silent", "silent() raised RuntimeError: RuntimeError")]


@pytest.mark.parametrize("spec,message", BAD_SPECS, ids=["no_file", "no_factory", "factory_raises", "no_factory_given",
                                                        "factory_raises_without_message"])
def test_a_bad_user_model_spec_is_one_clear_line(tmp_path, model_file, capsys, spec, message):
    assert deploy.main(["build", "--model", spec.format(model_file), "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
