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
from tvm_qconv.errors import InputError
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


def test_a_failed_build_with_bias_correction_is_diagnosed_layer_by_layer(tmp_path):
    """The per-layer twin of a failed build takes the build's channel means with its ranges: it
    used to stop with 'bias correction needs the inputs' means' (found on trained MobileNet-V2 with
    max calibration, 2026-12-07, benchmarks/scheme_heldout.py)."""
    from tvm_qconv.config import QuantConfig
    res = compile_model(small_net(), str(tmp_path / "m.so"), name="small", progress=False,
                        options=BuildOptions(image_size=SIZE, verify_floor_db=25),
                        config=QuantConfig(bias_correction=True), ranges=OneRangeBroken(BROKEN + ".out"))
    v = res.report["verify"]
    assert v["status"] == "failed" and v["first_bad_layer"] == BROKEN


def test_under_the_accuracy_target_the_report_ranks_the_broken_layer_first(tmp_path):
    # floor 0: the build passes; target infinite: the per-layer twin always runs
    v = build(tmp_path, verify_floor_db=0, accuracy_target_db=float("inf")).report["verify"]
    assert v["status"] == "ok"
    ranked = v["losses"]
    assert ranked[0]["layer"] == BROKEN and ranked[0]["loss_db"] > 25
    own = {ly["layer"]: ly["sqnr_db"] for ly in v["layers"]}
    # the broken conv reads the max-pool, which reads conv 2: its input SQNR is the pool's
    assert ranked[0]["input_db"] == pytest.approx(own["max_pool2d_0"], abs=0.01)
    first = next(r for r in ranked if r["layer"] == "0")
    assert first["input_db"] is None and first["loss_db"] is None  # reads the image
    lines = format_verification(v)
    assert lines[1].startswith("accuracy: logits") and lines[2].strip().startswith(f"{BROKEN}: -")


def test_no_per_layer_build_at_or_above_the_target(tmp_path):
    # the broken build measures ~20 dB: a 5 dB target is met, so no second build
    v = build(tmp_path, verify_floor_db=0, accuracy_target_db=5.0).report["verify"]
    assert v["logits_sqnr_db"] >= 5.0 and "losses" not in v and v["target_db"] == 5.0


def _row(layer, db, signal=1.0):
    return dict(layer=layer, sqnr_db=db, signal=signal, noise=signal / 10 ** (db / 10))


def test_a_concat_is_counted_from_its_inputs_together_and_a_pool_passes_them_on():
    # c = concat(a, b), equal power at 30 and 20 dB: its inputs together are at
    # 10 log10(2 / (1e-3 + 1e-2)) = 22.6 dB, so c at 22.0 dB lost 0.6 (not 8, counted from a alone);
    # p has no float tensor of its own (no row): d reads c's energy through it
    layers = [_row("a", 30.0), _row("b", 20.0), _row("c", 22.0, signal=2.0), _row("d", 17.0)]
    exposed = [dict(layer="a", inputs=[]), dict(layer="b", inputs=["a"]), dict(layer="c", inputs=["a", "b"]),
               dict(layer="p", inputs=["c"]), dict(layer="d", inputs=["p"])]
    rows = {r["layer"]: r for r in losses(layers, exposed)}
    assert rows["c"]["input_db"] == pytest.approx(22.60, abs=0.01) and rows["c"]["loss_db"] == pytest.approx(0.60, abs=0.01)
    assert (rows["b"]["loss_db"], rows["d"]["loss_db"]) == (10.0, 5.0)
    assert rows["a"]["loss_db"] is None
    assert [r["layer"] for r in losses(layers, exposed)] == ["b", "d", "c", "a"]


def test_exact_or_empty_tensors_get_no_loss_instead_of_nan():
    # an exact tensor (no noise) is +inf dB, an all-zero one with noise -inf: no finite loss
    layers = [dict(layer="a", sqnr_db=float("inf"), signal=1.0, noise=0.0),
              dict(layer="b", sqnr_db=float("inf"), signal=1.0, noise=0.0),
              dict(layer="c", sqnr_db=float("-inf"), signal=0.0, noise=1.0)]
    exposed = [dict(layer="a", inputs=[]), dict(layer="b", inputs=["a"]), dict(layer="c", inputs=["b"])]
    rows = losses(layers, exposed)
    assert all(r["loss_db"] is None for r in rows)
    v = dict(status="ok", logits_sqnr_db=20.0, images=4, floor_db=15.0, target_db=30.0, losses=rows)
    assert "nan" not in "\n".join(format_verification(v))


def test_a_failed_build_shows_its_losses_whatever_the_target():
    v = dict(status="failed", logits_sqnr_db=12.0, images=4, floor_db=15.0, target_db=10.0, first_bad_layer="b",
             layers=[dict(layer="b", sqnr_db=3.0)],
             losses=[dict(layer="b", sqnr_db=3.0, input_db=30.0, loss_db=27.0)])
    text = "\n".join(format_verification(v))
    assert "VERIFICATION FAILED" in text and "b: -27.0 dB (30.0 -> 3.0)" in text and "under the" not in text


def test_a_bad_accuracy_target_is_refused():
    for bad in (-1.0, float("nan")):
        with pytest.raises(InputError, match="accuracy_target_db is a logits SQNR"):
            BuildOptions(accuracy_target_db=bad)


def test_the_cli_refuses_a_negative_target_and_one_without_verification(capsys, tmp_path):
    assert deploy.main(["build", "--model", "vgg11", "--accuracy-target", "-3", "-o", str(tmp_path / "m.so")]) == 2
    assert "--accuracy-target '-3': give a logits SQNR in dB (e.g. 30) or top1:PCT" in capsys.readouterr().err
    assert deploy.main(["build", "--model", "vgg11", "--accuracy-target", "30", "--no-verify",
                        "-o", str(tmp_path / "m.so")]) == 2
    assert "--no-verify turns off" in capsys.readouterr().err


@pytest.mark.parametrize("flags, target", [
    (["--model", "vgg16"], (None, None)),                               # random init: off
    (["--model", "vgg16", "--weights", "w.pt"], (30.0, None)),          # trained: the report's default
    (["--model", "net.py:make"], (30.0, None)),                         # a user's model file
    (["--checkpoint", "c.pt"], (30.0, None)),
    (["--model", "vgg16", "--accuracy-target", "25"], (25.0, "25")),    # asked for: layers kept in float to reach it
    (["--model", "vgg16", "--weights", "w.pt", "--accuracy-target", "top1:99", "--data", "d"], (30.0, "top1:99")),
    (["--model", "vgg16", "--weights", "w.pt", "--accuracy-target", "0"], (None, None)),
    (["--model", "vgg16", "--weights", "w.pt", "--no-verify"], (None, None)),
])
def test_the_cli_target_is_on_for_trained_weights_and_off_for_a_random_init(flags, target):
    """``(the report's threshold, the mixed-precision target)``: the report names the layers that
    lose the most under 30 dB for trained weights; layers are kept in float only where asked."""
    args = deploy.build_parser().parse_args(["build", *flags, "-o", "m.so"])
    assert deploy.accuracy_target(args) == target


@pytest.mark.parametrize("options,says", [
    (dict(accuracy_target_db=30, verify=False), "verification that verify=False turns off"),
    (dict(cuda_graph=True), "cuda_graph is for target='cuda'"),
    (dict(arch="sm_90"), "arch is for target='cuda'"),
])
def test_the_python_api_refuses_what_the_cli_refuses(options, says):
    """``BuildOptions`` refuses the combinations ``deploy.py build`` refuses (issue 57: the
    validation is in the options, not only in the CLI), before any work."""
    with pytest.raises(InputError, match=says):
        BuildOptions(**options)


def test_the_python_api_refuses_a_percentile_its_observer_does_not_use():
    """``--percentile`` with another observer is refused by the CLI; ``QuantConfig`` refuses the same
    (a cut other than the default, 99.99, under an observer that is not the percentile one)."""
    from tvm_qconv.config import QuantConfig
    with pytest.raises(ValueError, match="calibration='max' does not use it"):
        QuantConfig(calibration="max", percentile=99.9)
    assert QuantConfig(calibration="search", percentile=99.9).percentile == 99.9   # search tries it too
    assert QuantConfig(calibration="max").percentile == 99.99


def test_the_python_api_refuses_a_class_count_beside_named_weights():
    """``--num-classes`` with ``--weights DEFAULT`` is refused by the CLI; the loader the API calls
    refuses it too (it used to drop num_classes in silence)."""
    from tvm_qconv.frontend import load_model
    with pytest.raises(InputError, match="num_classes sets the classifier's width for random init"):
        load_model("resnet18", weights="DEFAULT", num_classes=10)
