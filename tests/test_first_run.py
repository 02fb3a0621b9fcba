"""What a first run shows and keeps: each phase of a build as it starts (none with --quiet), a
seeded random init that says its classes are meaningless, image counts that agree with the
scheme, a verification on held-out images where there are some, a float model whose output does
not depend on the input reported as "cannot judge" (never a pass), and a library that fails its
verification written beside the output, never over a verified one, with the command that takes
it anyway."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

import deploy
from tvm_qconv.errors import UnverifiedLibraryWarning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def blind():
    """Logits that do not depend on the input: the first conv's weights are zero, its bias is not."""
    model = make()
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(0.5)
    return model
'''
PHASES = ["export", "simplify", "ranges", "quantize", "schedule", "compile", "verify", "save"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("first_run") / "models.py"
    path.write_text(MODELS)
    return str(path)


def _build(tmp_path, capsys, *extra, model="squeezenet1_1", out="m.so", code=0):
    argv = ["build", "--model", model, "--image-size", "32", "-o", str(tmp_path / out), *extra]
    assert deploy.main(argv) == code
    return capsys.readouterr()


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_build_prints_each_phase_as_it_starts_with_the_time_since_it_began(tmp_path, capsys, models):
    out = _build(tmp_path, capsys, model=f"{models}:make").out
    lines = [ln for ln in out.splitlines() if ln.startswith("[build ") and " s] " in ln]
    assert [ln.split("] ", 1)[1].split(":")[0] for ln in lines] == PHASES
    elapsed = [float(ln.split()[1]) for ln in lines]
    assert elapsed == sorted(elapsed)  # the time since the build began, growing
    assert "built in " in out and all(f"{p} " in out.split("built in ", 1)[1] for p in PHASES[:-1])


def test_quiet_prints_no_progress_only_the_report(tmp_path, capsys, models):
    out = _build(tmp_path, capsys, "--quiet", model=f"{models}:make").out
    assert "[build " not in out.replace("[build] ", "")
    assert "layers in int8" in out


def test_the_random_init_is_seeded_and_says_its_classes_are_meaningless(tmp_path, capsys):
    out = _build(tmp_path, capsys, out="a.so").out
    assert "weights: random init (seed 0): the classes it predicts are meaningless; pass --weights FILE" in out
    _build(tmp_path, capsys, out="b.so")
    _build(tmp_path, capsys, "--seed", "1", out="c.so")
    a, b, c = (json.load(open(tmp_path / f"{n}.json")) for n in "abc")
    assert a["float_weights"] == b["float_weights"] != c["float_weights"]  # the same command, the same model
    assert _sha(tmp_path / "a.params.npz") == _sha(tmp_path / "b.params.npz")  # ... and the same library
    run = deploy.main(["run", "--lib", str(tmp_path / "a.so"), "--image", "skimage:coffee", "--repeat", "2"])
    assert run == 0
    out = capsys.readouterr().out
    assert "(built from a random init (seed 0): the classes it predicts are meaningless" in out
    assert re.search(r"timing: 2 repeats of \d+ calls? on cpu", out), out


def test_the_image_counts_agree_with_the_scheme_and_verification_uses_held_out_images(tmp_path, capsys, models):
    out = _build(tmp_path, capsys, "--num-calib", "4", model=f"{models}:make").out
    assert ("calibrated (percentile 99.99) on 4 images of scikit-image's photos (the scheme takes up to 4; 4 more "
            "held out to verify on)") in out
    assert "on 4 held-out images (not used by calibration)" in out
    verify = json.load(open(tmp_path / "m.json"))["report"]["verify"]
    assert verify["held_out"] is True and verify["images"] == 4 and verify["status"] == "ok"


def test_with_no_image_to_spare_it_says_it_verifies_on_calibration_images(tmp_path, capsys, models):
    out = _build(tmp_path, capsys, model=f"{models}:make").out
    assert ("on 15 images of scikit-image's photos (the scheme takes up to 32; 15 were there, none left to hold out "
            "for the verification)") in out
    assert "on 4 calibration images" in out


def test_a_float_model_blind_to_its_input_cannot_judge_the_library(tmp_path, capsys, models):
    # it used to report "ok, inf dB": a library that agrees with a constant agrees with anything
    out = _build(tmp_path, capsys, model=f"{models}:blind").out
    assert "verification: CANNOT JUDGE the library: the float model gives the same logits for all 4 images" in out
    assert json.load(open(tmp_path / "m.json"))["report"]["verify"]["status"] == "cannot judge"
    assert deploy.main(["run", "--lib", str(tmp_path / "m.so"), "--image", "skimage:coffee", "--repeat", "1"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: ") and "is unverified: its build could not judge it" in err and "\n" not in err


def test_a_library_that_fails_verification_never_replaces_a_verified_one(tmp_path, capsys, models):
    _build(tmp_path, capsys, model=f"{models}:make")
    verified = {f: _sha(tmp_path / f) for f in ("m.so", "m.params.npz", "m.json")}
    # a floor no int8 library reaches: the verification fails
    out, err = _build(tmp_path, capsys, "--verify-floor-db", "200", model=f"{models}:make", code=3)
    assert "VERIFICATION FAILED" in out
    unverified = tmp_path / "m.unverified.so"
    assert f"it was written as {unverified}, {tmp_path / 'm.so'} is unchanged; to use it anyway: python deploy.py " \
           f"accept {unverified}" in err
    assert {f: _sha(tmp_path / f) for f in verified} == verified  # byte for byte
    assert sorted(os.listdir(tmp_path)) == sorted([*verified, "m.unverified.so", "m.unverified.params.npz",
                                                   "m.unverified.json"])
    # the command it names: the set moves into place, and every load of it warns in one line
    assert deploy.main(["accept", str(unverified)]) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(verified)
    capsys.readouterr()
    assert deploy.main(["run", "--lib", str(tmp_path / "m.so"), "--image", "skimage:coffee", "--repeat", "1"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"warning: {tmp_path / 'm.so'} FAILED its verification against the float model") and \
        "\n" not in err
    from tvm_qconv.runtime import CompiledModel
    with pytest.warns(UnverifiedLibraryWarning, match="FAILED its verification"):
        CompiledModel(str(tmp_path / "m.so"))  # the Python loader warns too


def test_accept_refuses_a_library_that_did_not_fail(tmp_path, capsys, models):
    _build(tmp_path, capsys, model=f"{models}:make")
    assert deploy.main(["accept", str(tmp_path / "m.so")]) == 2
    assert "did not fail its verification (ok): there is nothing to accept" in capsys.readouterr().err


def test_help_texts_name_what_the_commands_do():
    build = deploy.build_parser()._subparsers._group_actions[0].choices["build"].format_help()
    assert "NCHW4c" not in build and "wgmma" in build and "unverified" in build


def test_a_whole_build_through_the_cli_prints_nothing_on_stderr(tmp_path, models):
    # torch's LeafSpec FutureWarning used to come twice with every build and export
    proc = subprocess.run([sys.executable, "deploy.py", "build", "--model", f"{models}:make", "--image-size", "32",
                           "-o", str(tmp_path / "m.so")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_verified_build_removes_the_failed_one_it_supersedes(tmp_path, capsys, models):
    # accepting the older, failed build later would put it back over the newer, verified one
    _build(tmp_path, capsys, "--verify-floor-db", "200", model=f"{models}:make", code=3)
    unverified = tmp_path / "m.unverified.so"
    assert unverified.exists()
    assert deploy.main(["accept", str(unverified), "-o", str(unverified)]) == 2
    assert f"library {unverified} is the --lib {unverified} of this command: writing there would destroy it" in \
        capsys.readouterr().err and unverified.exists()
    out = _build(tmp_path, capsys, model=f"{models}:make").out
    assert f"removed {unverified} (+ .params.npz, .json): an earlier build of {tmp_path / 'm.so'} that failed" in out
    assert sorted(os.listdir(tmp_path)) == ["m.json", "m.params.npz", "m.so"]
