"""``--accuracy-target`` (``tvm_qconv/mixed_precision.py``): the fewest conv / linear layers kept
in float until the library reaches the target on images held out from calibration."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import AccuracyTarget
from tvm_qconv.errors import InputError
from tvm_qconv.frontend import as_frontend
from tvm_qconv.mixed_precision import LayerSim

SIZE = 16
NET = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 16 * 16, 10)).eval()
'''


@pytest.fixture
def net(tmp_path):
    (tmp_path / "net.py").write_text(NET)
    return f"{tmp_path / 'net.py'}:make"


@pytest.mark.parametrize("text, metric, value", [("30", "sqnr_db", 30.0), (" 22.5", "sqnr_db", 22.5),
                                                 ("top1:99", "top1_agreement", 99.0)])
def test_a_target_is_a_logits_sqnr_or_a_top1_agreement(text, metric, value):
    assert AccuracyTarget.parse(text) == AccuracyTarget(metric, value)


@pytest.mark.parametrize("bad", ["abc", "-3", "0", "nan", "top1:0", "top1:101", "top1:"])
def test_a_bad_target_is_refused_with_the_forms_it_takes(bad):
    with pytest.raises(InputError, match="give a logits SQNR in dB .* or top1:PCT"):
        AccuracyTarget.parse(bad)


def test_the_target_is_reached_with_the_fewest_layers_kept(tmp_path, net):
    """All int8 misses the target; the build keeps some (not all) layers in float, reaches it on
    the held-out images, and says which layers and why, in its report and its plan's rows."""
    all_int8 = compile_model(net, str(tmp_path / "a.so"), options=BuildOptions(image_size=SIZE, mixed_precision="200"),
                             progress=False).report["mixed_precision"]["all_int8"]["sqnr_db"]
    goal = all_int8 + 2.0     # measured 2026-12-07: 42.8 dB all int8; 2 to 3 of 5 layers reach +2 dB
    res = compile_model(net, str(tmp_path / "m.so"), options=BuildOptions(image_size=SIZE, mixed_precision=f"{goal}"),
                        progress=False)
    mp = res.report["mixed_precision"]
    assert mp["reached"] and mp["final"]["sqnr_db"] >= goal and mp["all_int8"]["sqnr_db"] == all_int8
    kept = [n for k in mp["kept"] for n in k["layers"]]
    assert 0 < len(kept) < mp["candidates"] == 5
    rows = {row["layer"]: row for row in res.report["layers"]}
    assert all(rows[k]["kernel"].startswith("float (kept in float for the accuracy target") for k in kept)
    assert all(not rows[n]["kernel"].startswith("float") for n in rows if n not in kept and rows[n]["kind"] == "conv2d")
    assert set(kept) <= set(res.meta["config"]["skip"])      # rebuilt from its json, it is the same library
    assert mp["images"] == 4 and "held-out" in mp["images_from"]


def test_a_target_no_build_reaches_writes_the_closest_library_and_exits_4(tmp_path, net, capsys):
    out = tmp_path / "m.so"
    assert deploy.main(["build", "--model", net, "--image-size", str(SIZE), "--accuracy-target", "400", "-q",
                        "-o", str(out)]) == 4
    captured = capsys.readouterr()
    assert "accuracy target: 400 dB logits SQNR" in captured.out and "NOT reached" in captured.out
    assert "--accuracy-target 400: not reached" in captured.err and out.exists()
    mp = json.loads(out.with_suffix(".json").read_text())["report"]["mixed_precision"]
    assert not mp["reached"] and mp["final"]["sqnr_db"] > mp["all_int8"]["sqnr_db"]   # the closest: better than int8


def test_top1_agreement_is_measured_on_the_data_folder(tmp_path, net, capsys):
    data = tmp_path / "data" / "3"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(data / f"{i}.png")
    out = tmp_path / "m.so"
    assert deploy.main(["build", "--model", net, "--image-size", str(SIZE), "--accuracy-target", "top1:100",
                        "--data", str(tmp_path / "data"), "-q", "-o", str(out)]) == 0, capsys.readouterr()
    mp = json.loads(out.with_suffix(".json").read_text())["report"]["mixed_precision"]
    assert mp["metric"] == "top1_agreement" and mp["images"] == 6 and mp["final"]["top1_agreement"] == 100.0


@pytest.mark.parametrize("flags, says", [
    (["--accuracy-target", "top1:99"], "top-1 agreement on a labelled folder: give it with --data DIR"),
    (["--data", "d"], "--data DIR is the folder --accuracy-target is measured on"),
    (["--accuracy-target", "30", "--no-verify"], "--no-verify turns off"),
])
def test_the_cli_refuses_a_target_it_cannot_measure(tmp_path, net, capsys, flags, says):
    assert deploy.main(["build", "--model", net, "--image-size", str(SIZE), *flags, "-q",
                        "-o", str(tmp_path / "m.so")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "m.so").exists()


def test_a_model_whose_output_does_not_depend_on_its_input_is_refused(tmp_path):
    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)) * 0.0)
    with pytest.raises(InputError, match="does not depend on the input"):
        compile_model(Constant().eval(), str(tmp_path / "m.so"),
                      options=BuildOptions(image_size=SIZE, mixed_precision="30"), progress=False)


def test_the_simulation_rounds_a_tensor_only_where_an_int8_layer_writes_or_reads_it(net):
    """Keeping one conv float leaves the tensors around it rounded (its neighbours are int8); keeping
    two adjacent ones leaves the one between them as it is."""
    graph = as_frontend(net).export((1, 3, SIZE, SIZE)).at(1).graph
    convs = [ly for ly in graph.layers if ly.kind in ("conv2d", "dense")]
    names = [ly.name for ly in convs]
    amax = {name: 1.0 for name in graph.points.values()}
    sim = LayerSim(graph, amax, (), names, np.zeros((2, 3, SIZE, SIZE), np.float32) + 0.1)
    between = convs[1].output          # written by the second conv, read by the third
    assert between in sim.rounded(set()) and between in sim.rounded({names[1]})
    assert between not in sim.rounded({names[1], names[2]})
    assert sim.rounded(set(names)) == set()
    assert sim.neighbours(names[1]) == {names[0], names[2]}
    assert sim.needed_for(between) == {names[1], names[2]}
    assert frozenset({names[1], names[2]}) in sim.moves() and frozenset({names[0]}) in sim.moves()


class Residual(nn.Module):
    """stem -> [a -> b, + skip] -> head: the add's output is int8 while either addend's writer is."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.head(x + self.b(torch.relu(self.a(x)))).mean((2, 3))


def test_a_residual_sum_is_left_unrounded_only_with_every_layer_writing_into_it():
    torch.manual_seed(0)
    graph = as_frontend(Residual().eval()).export((1, 3, SIZE, SIZE)).at(1).graph
    names = [ly.name for ly in graph.layers if ly.kind == "conv2d"]
    add = next(ly for ly in graph.layers if ly.kind == "add")
    sim = LayerSim(graph, {n: 1.0 for n in graph.points.values()}, (), names, np.zeros((1, 3, SIZE, SIZE), np.float32))
    # the sum: its reader (head), and the add's inputs' writers: b, and stem (the skip)
    assert sim.needed_for(add.output) == {"stem", "b", "head"}
    assert add.output in sim.rounded({"b", "head"})           # the stem still writes int8 into the sum
    assert add.output not in sim.rounded({"stem", "b", "head"})
