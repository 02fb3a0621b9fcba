"""`-o` never destroys what the user made (issue 56, item 2): a command refuses, in one line and
before any work, to write over its own inputs (with or without --force), and over an existing file
that is not one this project wrote as that output (unless --force); over its own kind of file it
stays atomic as before.  Each case goes through the command line, where the user met it: every one
of them used to exit 0 with the file gone."""
from __future__ import annotations

import hashlib
import json

import pytest

import deploy
import train

MODEL = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))
'''


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def files(tmp_path):
    """A user's folder: a model file, a float ONNX file, a checkpoint-like file, notes."""
    (tmp_path / "m.py").write_text(MODEL)
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "ck.pt").write_bytes(b"not really a checkpoint, but the user's")
    (tmp_path / "settings.json").write_text('{"lr": 0.1}\n')
    return tmp_path


def _refused(argv, capsys, *kept, main=deploy.main) -> str:
    before = {p: _sha(p) for p in kept}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert {p: _sha(p) for p in kept} == before, "a refused command changed the user's file"
    return err


def test_build_refuses_to_write_its_library_over_its_model_file(files, capsys):
    m = files / "m.py"
    err = _refused(["build", "--model", f"{m}:make", "--image-size", "32", "-o", str(m)], capsys, m)
    assert f"library {m} is the --model {m} of this command: writing there would destroy it" in err
    # --force does not change that: what the command reads is never its output
    _refused(["build", "--model", f"{m}:make", "--image-size", "32", "--force", "-o", str(m)], capsys, m)


def test_build_refuses_its_onnx_model_and_checkpoint_and_weights_as_output(files, capsys):
    import torch
    onnx_path = files / "f.onnx"
    torch.onnx.export(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), (torch.randn(1, 3, 16, 16),),
                      str(onnx_path), dynamo=False, input_names=["image"])
    err = _refused(["build", "--model", str(onnx_path), "-o", str(onnx_path)], capsys, onnx_path)
    assert f"is the --model {onnx_path} of this command" in err
    ck = files / "ck.pt"
    err = _refused(["build", "--checkpoint", str(ck), "-o", str(ck)], capsys, ck)
    assert f"is the --checkpoint {ck} of this command" in err
    # the record written beside the library is an output too: -o m.so writes m.json
    w = files / "settings.json"
    err = _refused(["build", "--model", "resnet18", "--weights", str(w), "-o", str(files / "settings.so")], capsys, w)
    assert f"the library's record {w} is the --weights {w} of this command" in err


def test_build_refuses_to_replace_a_file_that_is_not_a_library_unless_forced(files, capsys):
    m, notes = files / "m.py", files / "notes.txt"
    err = _refused(["build", "--model", f"{m}:make", "--image-size", "32", "-o", str(notes)], capsys, notes)
    assert f"library {notes} already exists and is not one this project wrote" in err and "--force" in err
    # a user's own JSON where the library's record would go (m2.so -> m2.json)
    (files / "m2.json").write_text('{"mine": true}')
    (files / "m2.so").write_bytes(b"\x7fELF a library of somebody else's")
    err = _refused(["build", "--model", f"{m}:make", "--image-size", "32", "-o", str(files / "m2.so")], capsys,
                   files / "m2.json", files / "m2.so")
    assert "m2.json beside it is not the JSON record of a build" in err
    assert deploy.main(["build", "--model", f"{m}:make", "--image-size", "32", "-q", "--force",
                        "-o", str(notes)]) == 0
    assert json.loads((files / "notes.txt.json").read_text())["input_shape"] == [1, 3, 32, 32]


def test_build_replaces_its_own_library_atomically_without_force(files, capsys):
    m, lib = files / "m.py", files / "lib.so"
    argv = ["build", "--model", f"{m}:make", "--image-size", "32", "-q", "-o", str(lib)]
    assert deploy.main(argv) == 0
    assert deploy.main(argv[:-2] + ["--seed", "3", "-o", str(lib)]) == 0
    assert sorted(p.name for p in files.iterdir() if p.name.startswith("lib")) == ["lib.json", "lib.params.npz",
                                                                                    "lib.so"]


def test_export_onnx_refuses_to_write_over_a_library_or_a_foreign_onnx_file(files, capsys):
    m, lib = files / "m.py", files / "lib.so"
    assert deploy.main(["build", "--model", f"{m}:make", "--image-size", "32", "-q", "-o", str(lib)]) == 0
    kept = [lib, files / "lib.params.npz", files / "lib.json"]
    err = _refused(["export-onnx", "--model", f"{m}:make", "--image-size", "32", "-o", str(lib)], capsys, *kept)
    assert f"ONNX file {lib} already exists and is not one this project wrote (not an ONNX file)" in err
    # its own output is replaced without a word; the --model file is never
    out = files / "q.onnx"
    assert deploy.main(["export-onnx", "--model", f"{m}:make", "--image-size", "32", "-q", "-o", str(out)]) == 0
    assert deploy.main(["export-onnx", "--model", f"{m}:make", "--image-size", "32", "-q", "-o", str(out)]) == 0
    err = _refused(["export-onnx", "--model", str(out), "-o", str(out)], capsys, out)
    assert f"is the --model {out} of this command" in err


def test_train_refuses_an_out_file_that_is_not_a_checkpoint(files, capsys):
    m = files / "m.py"
    err = _refused(["--model", "small_vgg", "--epochs", "1", "--out", str(m)], capsys, m, main=train.main)
    assert f"checkpoint {m} already exists and is not one this project wrote (not a train.py checkpoint)" in err


def test_accept_and_eval_json_refuse_foreign_files(files, capsys):
    notes = files / "notes.txt"
    err = _refused(["accept", str(files / "x.unverified.so"), "-o", str(notes)], capsys, notes)
    assert "already exists and is not one this project wrote" in err
    (files / "data").mkdir()
    err = _refused(["eval", "--lib", str(files / "lib.so"), "--data", str(files / "data"), "--json", str(notes)],
                   capsys, notes)
    assert f"JSON result {notes} already exists and is not one this project wrote (not a JSON file)" in err
    err = _refused(["eval", "--lib", str(files / "lib.so"), "--data", str(files / "data"),
                    "--json", str(files / "settings.json")], capsys, files / "settings.json")
    assert "(not an `eval` result)" in err
