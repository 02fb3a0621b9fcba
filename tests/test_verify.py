"""The build's self-check (``tvm_qconv/verify.py``): a build that computes something other than the
float model fails loudly and names the first layer that diverges; under the accuracy target the
report names the layers that lose the most.

The fault is made on purpose: one activation's calibrated range divided by 1000, so that layer's
int8 output clips everything (its SQNR against float falls to ~0 dB) while every layer before it
keeps its ~34-38 dB.
"""
import pytest
import torch
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.data import skimage_photos
from tvm_qconv.ranges import Calibrate
from tvm_qconv.report import format_verification
from tvm_qconv.verify import losses

SIZE = 32
BROKEN = "5"  # the third conv, after the max-pool


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()


class OneRangeBroken:
    """Calibrated ranges with ``point``'s divided by 1000 (a range source: ``resolve``)."""

    def __init__(self, point: str):
        self.inner, self.point = Calibrate(skimage_photos(SIZE)[:4]), point

    def resolve(self, ctx):
        amax, report = self.inner.resolve(ctx)
        amax[self.point] /= 1000
        return amax, report


def build(tmp_path, **options):
    return compile_model(small_net(), str(tmp_path / "m.so"), name="small", progress=False,
                         options=BuildOptions(image_size=SIZE, **options), ranges=OneRangeBroken(BROKEN + ".out"))


def test_a_layer_that_clips_everything_fails_the_build_and_is_named(tmp_path):
    # 25 dB: above every healthy layer of this net (34-38 dB), under the broken one's (~0 dB)
    v = build(tmp_path, verify_floor_db=25).report["verify"]
    assert v["status"] == "failed" and v["first_bad_layer"] == BROKEN
    text = "\n".join(format_verification(v))
    assert "VERIFICATION FAILED" in text and f"first layer whose int8 activations diverge: {BROKEN}" in text


def test_under_the_accuracy_target_the_report_ranks_the_broken_layer_first(tmp_path):
    # floor 0: the build passes; target infinite: the per-layer twin always runs
    v = build(tmp_path, verify_floor_db=0, accuracy_target_db=float("inf")).report["verify"]
    assert v["status"] == "ok"
    ranked = v["losses"]
    assert ranked[0]["layer"] == BROKEN and ranked[0]["loss_db"] > 25
    own = {ly["layer"]: ly["sqnr_db"] for ly in v["layers"]}
    # the broken conv reads the max-pool, which reads conv 2: its input SQNR is the pool's
    assert ranked[0]["input_db"] == round(own["max_pool2d_0"], 2)
    first = next(r for r in ranked if r["layer"] == "0")
    assert first["input_db"] is None and first["loss_db"] is None  # reads the image
    lines = format_verification(v)
    assert lines[1].startswith("accuracy: logits") and lines[2].strip().startswith(f"{BROKEN}: -")


def test_no_per_layer_build_at_or_above_the_target(tmp_path):
    v = build(tmp_path, verify_floor_db=0, accuracy_target_db=-1.0).report["verify"]
    assert "losses" not in v and v["target_db"] == -1.0


def test_losses_take_the_best_input_and_pass_through_layers_without_a_float_tensor():
    # c = concat(a, b) reads a (30 dB) and b (20 dB): counted from 30; p is a pool with no
    # float tensor of its own (no row), so d reads c's SQNR through it
    layers = [dict(layer="a", sqnr_db=30.0), dict(layer="b", sqnr_db=20.0), dict(layer="c", sqnr_db=18.0),
              dict(layer="d", sqnr_db=17.0)]
    exposed = [dict(layer="a", inputs=[]), dict(layer="b", inputs=["a"]), dict(layer="c", inputs=["a", "b"]),
               dict(layer="p", inputs=["c"]), dict(layer="d", inputs=["p"])]
    rows = {r["layer"]: r for r in losses(layers, exposed)}
    assert (rows["b"]["loss_db"], rows["c"]["loss_db"], rows["d"]["loss_db"]) == (10.0, 12.0, 1.0)
    assert rows["a"]["loss_db"] is None
    assert [r["layer"] for r in losses(layers, exposed)] == ["c", "b", "d", "a"]


def test_a_negative_accuracy_target_is_refused(capsys, tmp_path):
    assert deploy.main(["build", "--model", "vgg11", "--accuracy-target", "-3", "-o", str(tmp_path / "m.so")]) == 2
    assert "--accuracy-target is a logits SQNR in dB" in capsys.readouterr().err
