"""``calibration="search"``: per tensor, the observer whose range gives logits closest to float
(``tvm_qconv/ranges/search.py``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tvm_qconv.ranges import search as range_search
from tvm_qconv.ranges.calibrate import calibrate_candidates
from tvm_qconv.config import OBSERVERS, QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.graph import analyze
from tvm_qconv.frontend import export_to_relax, simplify
from tvm_qconv.int8_module import quantize_module
from tvm_qconv.ranges import Calibrate
from tvm_qconv.target import TargetInfo, make_target

SIZE = 16
LLVM = TargetInfo.from_target(make_target("llvm"))


class Net(nn.Module):
    """Conv + ReLU, a residual add, a max-pool and a linear layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16 * (SIZE // 2) ** 2, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(nn.functional.max_pool2d(x, 2).flatten(1))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Net().eval()
    mod, names = export_to_relax(model, (1, 3, SIZE, SIZE))
    graph = analyze(simplify(mod)["main"], names)
    photos = skimage_photos(SIZE)[:6]
    candidates, *_ = calibrate_candidates(graph, photos, QuantConfig(), OBSERVERS, progress=False)
    return model, graph, photos, candidates


def test_the_simulation_without_rounding_is_the_float_model(setup):
    model, graph, photos, _ = setup
    with torch.no_grad():
        want = model(torch.from_numpy(photos)).numpy()
    # the same float32 convs (torch) and Relax's own elementwise ops: ~1e-6 relative
    np.testing.assert_allclose(range_search.FakeQuantModel(graph).logits(photos), want, rtol=1e-4, atol=1e-5)


def test_every_point_gets_one_range_per_observer_and_its_channel_means_from_one_pass(setup):
    model, graph, photos, candidates = setup
    assert set(candidates) == set(graph.points.values())
    for ranges in candidates.values():
        assert set(ranges) == set(OBSERVERS) and all(a >= 0 for a in ranges.values())
        assert ranges["max"] == max(ranges.values())  # no observer goes past the largest |x|
    # the means bias correction uses: the model's input point's is the photos' channel mean
    _, means, _ = calibrate_candidates(graph, photos, QuantConfig(), ("max",), progress=False)
    point = graph.points[graph.func.params[0]]
    np.testing.assert_allclose(means[point], photos.mean(axis=(0, 2, 3)), rtol=1e-5)


def test_the_search_replaces_a_range_that_ruins_the_logits(setup):
    # every point starts at START's range; one of them 1000x too small (everything clips), with
    # the max observer's range beside it: the search must take that one, and gain many dB
    _, graph, photos, candidates = setup
    bad_point = next(iter(candidates))
    rigged = {p: {range_search.START: c[range_search.START]} for p, c in candidates.items()}
    rigged[bad_point] = {range_search.START: candidates[bad_point]["max"] / 1000, "max": candidates[bad_point]["max"]}
    amax, report = range_search.search(graph, photos, rigged, progress=False)
    assert report["choices"][bad_point] == "max" and amax[bad_point] == candidates[bad_point]["max"]
    assert report["sqnr_db"] > report["sqnr_start_db"] + 10


def test_the_search_never_ends_worse_than_it_starts(setup):
    _, graph, photos, candidates = setup
    amax, report = range_search.search(graph, photos, candidates, progress=False)
    assert report["sqnr_db"] >= report["sqnr_start_db"]
    assert set(report["choices"].values()) <= set(OBSERVERS) and sum(report["counts"].values()) == len(amax)
    for point, method in report["choices"].items():
        assert amax[point] == candidates[point][method]
    # the simulated SQNR is the fake-quantized model's on these photos, recomputed here
    model = range_search.FakeQuantModel(graph)
    got = sqnr_db(model.logits(photos), model.logits(photos, amax))
    assert got == pytest.approx(report["sqnr_db"], abs=0.01)


def test_the_unsigned_grid_and_int8_weights_round_as_the_scheme_says(setup):
    """``benchmarks/unsigned_activations.py``'s two knobs.  A point on the 0..255 grid has half
    the step of -127..127 at the same range (the script gives it only to never-negative points,
    where the two grids cover the values alike); given to every point, all the rounding noise
    falls 4x, so the logits' SQNR rises ~6 dB.  ``int8_weights`` rounds every conv / linear
    weight per output channel: the network with its weights rounded by hand gives the same
    logits."""
    model, graph, photos, candidates = setup
    amax = {p: c["max"] for p, c in candidates.items()}
    sim = range_search.FakeQuantModel(graph)
    ref = sim.logits(photos)
    signed = sqnr_db(ref, sim.logits(photos, amax))
    finer = sqnr_db(ref, sim.logits(photos, amax, set(amax)))
    assert 4.5 < finer - signed < 7.5, (signed, finer)  # 20 log10(2) = 6.02 dB, +-1.5 for 6 photos
    rounded = Net().eval()  # the same network with its weights rounded by hand
    rounded.load_state_dict(model.state_dict())
    for m in rounded.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            w = m.weight.detach()
            step = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True) / 127
            m.weight.data = torch.clamp(torch.round(w / step), -127, 127) * step
    mod, names = export_to_relax(rounded, (1, 3, SIZE, SIZE))
    by_hand = range_search.FakeQuantModel(analyze(simplify(mod)["main"], names)).logits(photos, amax)
    got = range_search.FakeQuantModel(graph, int8_weights=True).logits(photos, amax)
    # the same roundings; an activation landing on a rounding tie may differ by one step: > 50 dB
    assert sqnr_db(by_hand, got) > 50
    assert sqnr_db(by_hand, sim.logits(photos, amax)) < 45  # and the weights' rounding shows


@pytest.fixture(scope="module")
def searched(setup):
    model, _, photos, _ = setup
    return quantize_module(model, (1, 3, SIZE, SIZE), LLVM, config=QuantConfig(calibration="search"),
                           ranges=Calibrate(photos), progress=False)


def test_a_build_with_search_records_its_choices(searched):
    report = searched.report["ranges"]
    assert report["calibration"] == "search" and set(report["search"]["choices"]) == set(searched.amax)
    assert all(a > 0 for a in searched.amax.values())


def test_the_build_report_says_what_the_search_chose(searched):
    from tvm_qconv.report import format_report
    text = format_report(dict(report=searched.report))
    assert "ranges searched per tensor: " in text and f"-> {searched.report['ranges']['search']['sqnr_db']} dB" in text
