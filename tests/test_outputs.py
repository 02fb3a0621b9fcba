"""What `run` and `eval` do with what a library outputs (issue 56, items 3 and 5):

- a network whose output is not class scores ``[N, classes]`` (a feature map, a segmentation map,
  a tuple whose first entry is 4-D) builds, and `run` prints its shape and a summary instead of a
  top-5 (it was an internal failure); `eval` refuses it in one line (it printed a top-5 of 100 %);
- `eval --model` makes the random init the library was built from (the build's seed and class
  count, from the library's record): its digest matches, so agreement and SQNR compare the same
  model (it was unseeded: a warning every time, an SQNR that changed run to run); a model of
  another class count or image size is one line (it was an internal failure)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import deploy
from tvm_qconv.data import skimage_photos

MODELS = '''
import torch
from torch import nn


def feature_map():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))


class TwoHeads(nn.Module):
    """(a segmentation map, class scores): the library computes the first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.seg = nn.Conv2d(8, 3, 1)
        self.cls = nn.Linear(8, 5)

    def forward(self, x):
        y = self.body(x)
        return self.seg(y), self.cls(y.mean((2, 3)))


def two_heads():
    return TwoHeads()


def five_classes():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "models.py"
    path.write_text(MODELS)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A labelled folder: six of scikit-image's photos under class folders 0, 1, 2."""
    root = tmp_path_factory.mktemp("labelled")
    for i, photo in enumerate(skimage_photos(64)[:6]):
        (root / str(i % 3)).mkdir(exist_ok=True)
        rgb = np.clip(photo.transpose(1, 2, 0) * [0.229, 0.224, 0.225] + [0.485, 0.456, 0.406], 0, 1)
        Image.fromarray((rgb * 255).astype(np.uint8)).save(root / str(i % 3) / f"{i}.png")
    return str(root)


@pytest.mark.parametrize("factory, batch, shape", [("feature_map", 2, (2, 4, 32, 32)),
                                                   ("two_heads", 1, (1, 3, 32, 32))],
                         ids=["feature-map", "tuple-with-a-4d-first-output"])
def test_a_map_output_builds_runs_with_a_summary_and_eval_refuses_it(factory, batch, shape, models, data, tmp_path,
                                                                     capsys):
    lib = str(tmp_path / "m.so")
    assert deploy.main(["build", "--model", f"{models}:{factory}", "--image-size", "32", "--batch", str(batch),
                        "-q", "-o", lib]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["output_shape"] == list(shape)
    capsys.readouterr()
    images = ["skimage:coffee", "skimage:astronaut"][:batch]
    assert deploy.main(["run", "--lib", lib, "--image", *images, "--repeat", "1", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"output: {shape} float32, not class scores [batch, classes]: no top-5; a summary instead" in out
    for image in images:   # each image's map: its shape, range and which channel wins where
        assert f"{image}:\n  shape {shape[1:]} float32: min " in out
    assert f"argmax over its {shape[1]} channels, per position: channel " in out
    assert deploy.main(["eval", "--lib", lib, "--data", data]) == 2
    err = capsys.readouterr().err
    assert f"{lib} outputs {shape}, not class scores [batch, classes]: eval measures top-1 / top-5" in err


def test_a_classifier_records_its_output_shape_and_runs_its_top5(models, tmp_path, capsys):
    lib = str(tmp_path / "c.so")
    assert deploy.main(["build", "--model", f"{models}:five_classes", "--image-size", "32", "-q", "-o", lib]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["output_shape"] == [1, 5]
    capsys.readouterr()
    assert deploy.main(["run", "--lib", lib, "--image", "skimage:coffee", "--repeat", "1", "-q"]) == 0
    assert "class 4" in capsys.readouterr().out and "not class scores" not in capsys.readouterr().out


def test_eval_model_makes_the_random_init_the_library_was_built_from(data, tmp_path, capsys):
    # a random init at another seed and class count than the defaults: eval must make the same one
    lib = str(tmp_path / "r.so")
    assert deploy.main(["build", "--model", "resnet18", "--num-classes", "3", "--seed", "7", "--image-size", "32",
                        "-q", "-o", lib]) == 0
    capsys.readouterr()
    runs = []
    for _ in range(2):
        assert deploy.main(["eval", "--lib", lib, "--data", data, "--model", "resnet18", "--json",
                            str(tmp_path / "r_eval.json")]) == 0
        captured = capsys.readouterr()
        assert "does not hold the weights" not in captured.err, captured.err
        runs.append(json.loads((tmp_path / "r_eval.json").read_text())["logits_sqnr_db"])
    # the same float model both times, and the library's: a random ResNet-18 at 32 px is far from its
    # own int8 library (measured 13.2 dB: nearly flat logits), but the digest check passes and the runs agree
    assert runs[0] == runs[1] and runs[0] > 10


def test_eval_model_of_another_class_count_or_image_size_is_one_line(models, data, tmp_path, capsys):
    lib = str(tmp_path / "c.so")
    assert deploy.main(["build", "--model", f"{models}:five_classes", "--image-size", "32", "-q", "-o", lib]) == 0
    capsys.readouterr()
    # a model file of another class count (three) than the library's five
    (tmp_path / "other.py").write_text(MODELS.replace("nn.Linear(8, 5)", "nn.Linear(8, 3)"))
    assert deploy.main(["eval", "--lib", lib, "--data", data, "--model", f"{tmp_path / 'other.py'}:five_classes"]) == 2
    err = capsys.readouterr().err
    assert "the float model gives outputs of shape (3,) per image" in err and "(5,)" in err
    # a model that cannot take the library's 32 px input (VGG's classifier is fixed at 7x7 of 512 features
    # only after its adaptive pool, so use AlexNet's 11x11 stride-4 stem: too small at 8 px)
    small = str(tmp_path / "s.so")
    assert deploy.main(["build", "--model", f"{models}:five_classes", "--image-size", "8", "-q", "-o", small]) == 0
    capsys.readouterr()
    assert deploy.main(["eval", "--lib", small, "--data", data, "--model", "alexnet"]) == 2
    assert "--model alexnet cannot take input (1, 3, 8, 8)" in capsys.readouterr().err
