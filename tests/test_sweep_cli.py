"""Issue 56's sweep, as a new user would try it: files of the wrong kind in every slot, flags in
combination, paths that name no file.  Each case ends in one line naming the problem and what to
do, exit 2, before any work (the build would have run first, or the line was torch's or TVM's);
docs/reliability.md lists the whole sweep, interrupts included (tests/test_interrupts.py)."""
from __future__ import annotations

import pytest
import torch

import deploy

MODEL = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's folder: a model file, a built library, a float ONNX file, a photo, a text file."""
    d = tmp_path_factory.mktemp("sweep")
    (d / "m.py").write_text(MODEL)
    (d / "notes.txt").write_text("my notes\n")
    (d / "fake.jpg").write_text("not an image\n")
    (d / "empty.jpg").write_bytes(b"")
    from PIL import Image
    Image.new("RGB", (40, 40), (120, 80, 40)).save(d / "photo.png")
    assert deploy.main(["build", "--model", f"{d / 'm.py'}:make", "--image-size", "32", "-q", "-o",
                        str(d / "lib.so")]) == 0
    torch.onnx.export(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), (torch.randn(1, 3, 16, 16),),
                      str(d / "f.onnx"), dynamo=False, input_names=["image"])
    return d


M = "{d}/m.py:make"
SWEEP = [
    # files of the wrong kind in every slot
    ("model-text-file", ["build", "--model", "{d}/notes.txt", "-o", "{d}/o.so"],
     "--model {d}/notes.txt is a text file, not a model: give path/to/file.py:factory"),
    ("model-py-without-factory", ["build", "--model", "{d}/m.py", "-o", "{d}/o.so"],
     "--model {d}/m.py names a Python file but no factory: give path/to/file.py:factory, the function that "
     "returns the module ({d}/m.py:FACTORY)"),
    ("model-a-library", ["export-onnx", "--model", "{d}/lib.so", "-o", "{d}/o.onnx"],
     "--model {d}/lib.so is a library built by deploy.py, not a model"),
    ("weights-an-image", ["build", "--model", "resnet18", "--weights", "{d}/photo.png", "-o", "{d}/o.so"],
     "weights file {d}/photo.png is an image (PNG), not a state dict"),
    ("weights-an-onnx-file", ["build", "--model", "resnet18", "--weights", "{d}/f.onnx", "-o", "{d}/o.so"],
     "is an ONNX model, not a state dict: give a file saved with torch.save(model.state_dict(), path); an ONNX "
     "file is a model: give it as --model"),
    ("checkpoint-a-library", ["build", "--checkpoint", "{d}/lib.so", "-o", "{d}/o.so"],
     "{d}/lib.so is a library built by deploy.py, not a checkpoint"),
    ("checkpoint-missing", ["build", "--checkpoint", "{d}/nope.pt", "-o", "{d}/o.so"],
     "checkpoint {d}/nope.pt not found"),
    ("lib-an-onnx-file", ["run", "--lib", "{d}/f.onnx", "--image", "{d}/photo.png"],
     "{d}/f.onnx is an ONNX model, not a library built by deploy.py (no f.onnx.json beside it): build one with "
     "`python deploy.py build --model {d}/f.onnx -o NAME.so`"),
    ("lib-a-python-file", ["accept", "{d}/m.py"], "{d}/m.py is a text file, not a library built by deploy.py"),
    ("image-a-text-file", ["run", "--lib", "{d}/lib.so", "--image", "{d}/fake.jpg"],
     "cannot read image {d}/fake.jpg: it is a text file; give an image file (JPEG, PNG, BMP, WebP, GIF, TIFF)"),
    ("image-empty", ["run", "--lib", "{d}/lib.so", "--image", "{d}/empty.jpg"], "it is an empty file"),
    ("data-a-file", ["eval", "--lib", "{d}/lib.so", "--data", "{d}/notes.txt"],
     "--data {d}/notes.txt: a file, not a folder"),
    ("debug-dump-a-file", ["build", "--model", M, "--image-size", "32", "--debug-dump", "{d}/notes.txt",
                           "-o", "{d}/o.so"], "--debug-dump folder {d}/notes.txt cannot be written"),
    # flags that were ignored in silence
    ("cuda-graph-on-llvm", ["build", "--model", M, "--image-size", "32", "--cuda-graph", "-o", "{d}/o.so"],
     "--cuda-graph is for --target cuda; this build is for llvm"),
    ("arch-on-llvm", ["build", "--model", M, "--image-size", "32", "--arch", "sm_90a", "-o", "{d}/o.so"],
     "--arch is for --target cuda; this build is for llvm"),
    ("percentile-with-max", ["build", "--model", M, "--image-size", "32", "--calibration", "max", "--percentile",
                             "99.9", "-o", "{d}/o.so"], "--percentile sets the percentile observer's cut; this build "
     "calibrates with max"),
    ("num-classes-with-named-weights", ["build", "--model", "resnet18", "--num-classes", "10", "--weights",
                                        "DEFAULT", "-o", "{d}/o.so"], "torchvision's --weights DEFAULT come with "
     "their own (1000 ImageNet classes): drop --num-classes"),
    # output paths that name no file (the whole build ran, then the publish failed)
    ("output-empty", ["build", "--model", M, "--image-size", "32", "-o", ""], "library path '' names no file"),
    ("output-a-folder-to-be", ["build", "--model", M, "--image-size", "32", "-o", "{d}/new/"],
     "library path '{d}/new/' names no file: give a file path (e.g. {d}/new/model.so)"),
    ("eval-model-of-another-size", ["eval", "--lib", "{d}/lib.so", "--data", "{d}", "--model", "{d}/f.onnx"],
     "--model {d}/f.onnx takes inputs (1, 3, 16, 16), {d}/lib.so takes (1, 3, 32, 32): it is not the model"),
]


@pytest.mark.parametrize("argv, says", [c[1:] for c in SWEEP], ids=[c[0] for c in SWEEP])
def test_a_wrong_input_is_one_line_naming_it_before_any_work(argv, says, user, capsys):
    before = sorted(p.name for p in user.iterdir())
    assert deploy.main([a.format(d=user) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert says.format(d=user) in err, err
    assert sorted(p.name for p in user.iterdir()) == before   # nothing written, nothing removed


def test_a_family_no_layer_can_run_is_said_in_one_line(user, tmp_path, capsys):
    assert deploy.main(["build", "--model", f"{user / 'm.py'}:make", "--image-size", "32", "--family", "wgmma", "-q",
                        "-o", str(tmp_path / "w.so")]) == 0
    err = capsys.readouterr().err
    assert "warning: --family wgmma: no layer of this build runs it (none of its kernels takes these layers on " \
           "llvm)" in err, err
