"""Facts about the calibration observers and per-channel weight quantization."""
import numpy as np
import pytest

from tvm_qconv.ranges.observers import (
    EntropyObserver,
    MaxObserver,
    MSEObserver,
    PercentileObserver,
    make_observer,
    quantize_weight_per_channel,
    weight_scales_per_channel,
)

OBSERVER_FACTORIES = [MaxObserver, PercentileObserver, EntropyObserver, MSEObserver]
OBSERVER_IDS = ["max", "percentile", "entropy", "mse"]
NON_FINITE = [np.nan, np.inf, -np.inf]
NON_FINITE_IDS = ["nan", "inf", "-inf"]
PERCENTILES = [50.0, 99.0, 99.9, 99.99, 100.0]
BATCH_STDS = (0.5, 1.0, 1.5, 2.0, 3.0)  # each batch widens the range: forces 4 re-binnings
METHODS = [("max", MaxObserver), ("percentile", PercentileObserver), ("entropy", EntropyObserver),
           ("mse", MSEObserver)]
WEIGHT_SHAPES = [(8, 3, 3, 3), (16, 4, 1, 1), (10, 32)]
WEIGHT_SHAPE_IDS = ["conv3x3", "conv1x1", "dense"]


def gaussian_batches(seed=0, n=100_000):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * s).astype(np.float32) for s in BATCH_STDS]


def test_max_observer_is_exact_running_max_of_abs():
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((4, 8, 5, 5)).astype(np.float32) * s for s in (1, 3, 2)]
    obs = MaxObserver()
    for b in batches:
        obs.update(b)
    # Exact: no histogram involved.
    assert obs.amax() == float(max(np.abs(b).max() for b in batches))


@pytest.mark.parametrize("p", PERCENTILES, ids=[f"p{p:g}" for p in PERCENTILES])
def test_percentile_within_one_bin_of_numpy_over_growing_batches(p):
    batches = gaussian_batches()
    obs = PercentileObserver(p)
    for b in batches:
        obs.update(b)
    expected = np.percentile(np.abs(np.concatenate(batches)), p)
    # Re-binning merges whole bins (exact counts), so only in-bin interpolation errs.
    assert abs(obs.amax() - expected) <= obs.bin_width
    # Bounded memory: still num_bins bins after four range growths.
    assert obs._hist.size == 2048
    assert obs._hist.sum() == sum(b.size for b in batches)


def test_percentile_never_exceeds_true_max():
    batches = gaussian_batches(seed=2)
    obs = PercentileObserver(100.0)
    for b in batches:
        obs.update(b)
    assert obs.amax() <= max(np.abs(b).max() for b in batches)


def test_entropy_clips_huge_outliers_of_a_gaussian():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1_000_000).astype(np.float32)
    x[:5] = [50.0, -60.0, 80.0, 100.0, -120.0]
    obs = EntropyObserver()
    obs.update(x)
    amax = obs.amax()
    # Well below the max (the outliers are clipped) yet above the 99th percentile
    # (the Gaussian body is kept): 2.58 < amax < 120 / 4.
    assert np.percentile(np.abs(x), 99) < amax < np.abs(x).max() / 4


def test_entropy_on_plain_gaussian_keeps_the_body_and_clips_the_tail():
    obs = EntropyObserver()
    for b in gaussian_batches(seed=4, n=200_000)[:2]:
        obs.update(b)
    amax = obs.amax()
    body = np.abs(np.concatenate(gaussian_batches(seed=4, n=200_000)[:2]))
    assert np.percentile(body, 99.9) < amax < body.max()


def test_entropy_threshold_is_the_kl_minimum_over_every_candidate_of_2048_bins():
    # (How long the search takes is a benchmark's business, not a unit test's.)
    from tvm_qconv.ranges.observers import _kl_divergences
    obs = EntropyObserver(num_bins=2048)
    obs.update(np.random.default_rng(5).standard_normal(200_000).astype(np.float32))
    hist = obs._hist.astype(np.float64)
    stop = int(np.flatnonzero(hist)[-1]) + 1
    kl = _kl_divergences(hist, 128, stop)
    assert len(kl) == stop - 128 + 1 and np.isfinite(kl).all()
    chosen = round(obs.amax() / obs.bin_width)
    assert kl[chosen - 128] == kl.min()  # no candidate threshold loses less information
    assert 128 < chosen < stop  # a gaussian's tail is clipped, but not at the first candidate


def test_entropy_ignores_relu_zero_spike():
    rng = np.random.default_rng(6)
    relu = np.maximum(rng.standard_normal(500_000), 0).astype(np.float32)  # ~50% zeros
    obs = EntropyObserver()
    obs.update(relu)
    # Same body as a Gaussian's positive half: the zero spike must not pull amax into it.
    assert np.percentile(relu[relu > 0], 99.5) < obs.amax() <= relu.max()


@pytest.mark.parametrize("factory", OBSERVER_FACTORIES, ids=OBSERVER_IDS)
def test_all_zero_activations_give_zero_amax(factory):
    obs = factory()
    obs.update(np.zeros((2, 3, 4), np.float32))
    assert obs.amax() == 0.0


@pytest.mark.parametrize("factory", OBSERVER_FACTORIES, ids=OBSERVER_IDS)
def test_zeros_then_data_keeps_zeros_in_first_bin(factory):
    obs = factory()
    obs.update(np.zeros(1000, np.float32))
    obs.update(np.linspace(-2, 2, 1001, dtype=np.float32))
    assert 0.0 < obs.amax() <= 2.0


@pytest.mark.parametrize("factory", OBSERVER_FACTORIES, ids=OBSERVER_IDS)
@pytest.mark.parametrize("bad", NON_FINITE, ids=NON_FINITE_IDS)
def test_non_finite_input_raises(factory, bad):
    x = np.ones((2, 3), np.float32)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="non-finite"):
        factory().update(x)


@pytest.mark.parametrize("factory", OBSERVER_FACTORIES, ids=OBSERVER_IDS)
def test_amax_before_update_raises(factory):
    with pytest.raises(RuntimeError, match="no data"):
        factory().amax()


@pytest.mark.parametrize("method,cls", METHODS, ids=[m for m, _ in METHODS])
def test_make_observer(method, cls):
    assert type(make_observer(method)) is cls


def test_make_observer_passes_percentile():
    assert make_observer("percentile", percentile=99.5).percentile == 99.5


def test_make_observer_unknown_names_choices():
    with pytest.raises(ValueError, match="'max', 'percentile', 'entropy', 'mse'"):
        make_observer("kl")


@pytest.mark.parametrize("shape", WEIGHT_SHAPES, ids=WEIGHT_SHAPE_IDS)
def test_per_channel_weight_quantization(shape):
    w = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    w[0] *= 100.0  # one large channel must not coarsen the others
    q, s = quantize_weight_per_channel(w)
    assert s.shape == (shape[0],) and s.dtype == np.float32
    assert q.dtype == np.int8 and q.shape == w.shape
    assert q.min() >= -127 and q.max() <= 127
    np.testing.assert_array_equal(s, weight_scales_per_channel(w))
    # Each channel uses the full range: its max |w| maps to +-127.
    assert (np.abs(q.reshape(shape[0], -1)).max(axis=1) == 127).all()
    s_b = s.reshape((-1,) + (1,) * (len(shape) - 1))
    err = np.abs(q * s_b - w)
    # Round-to-nearest: error <= s/2, plus 1e-6 relative slack for float32 division.
    assert (err <= s_b / 2 * (1 + 1e-6)).all()


def test_weight_rounds_to_nearest_not_truncates():
    w = np.array([[1.0, 0.6 / 127, -0.6 / 127]], np.float32)  # scale = 1/127
    q, _ = quantize_weight_per_channel(w)
    assert q.tolist() == [[127, 1, -1]]  # truncation would give 0 for +-0.6 steps


def test_all_zero_weight_channel_is_safe():
    w = np.ones((3, 2, 3, 3), np.float32)
    w[1] = 0.0
    with np.errstate(all="raise"):  # any division by zero would raise here
        q, s = quantize_weight_per_channel(w)
    assert s[1] > 0 and np.isfinite(s).all()
    assert (q[1] == 0).all()
    assert (q[0] == 127).all()


def test_non_finite_weights_raise():
    w = np.ones((2, 3), np.float32)
    w[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        weight_scales_per_channel(w)


def test_entropy_keeps_the_whole_range_of_discrete_data():
    # digits' pixels take 17 grey levels; a KL search that breaks ties toward small thresholds
    # clipped them at 1/8 of their range (a 12-point accuracy drop before the fix)
    from tvm_qconv.ranges.observers import EntropyObserver
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 17, 100_000) / 16.0 - 0.5) / 0.5
    obs = EntropyObserver()
    obs.update(x.astype(np.float32))
    assert obs.amax() == pytest.approx(1.0, abs=1e-6)


def _int8_mse(x: np.ndarray, amax: float) -> float:
    s = amax / 127
    return float(((np.clip(np.rint(x / s), -127, 127) * s - x) ** 2).mean())


def test_mse_threshold_beats_max_and_nearby_thresholds_on_a_heavy_tailed_tensor():
    x = np.random.default_rng(7).standard_t(3, 400_000).astype(np.float32)  # outliers far out
    obs = MSEObserver()
    obs.update(x)
    t = obs.amax()
    assert t < 0.75 * np.abs(x).max()  # clips the outliers (max calibration would not): 49 of 84 here
    best = _int8_mse(x, t)
    # measured on the data itself (not the histogram): no better threshold nearby or at the max
    assert best <= _int8_mse(x, np.abs(x).max())
    assert best <= 1.01 * min(_int8_mse(x, t * f) for f in (0.8, 0.9, 1.1, 1.25))


def test_mse_keeps_the_whole_range_of_a_uniform_tensor():
    x = np.random.default_rng(8).uniform(-3, 3, 200_000).astype(np.float32)
    obs = MSEObserver()
    obs.update(x)
    assert obs.amax() == pytest.approx(3.0, rel=0.02)  # nothing to clip: the full range is best


@pytest.mark.parametrize("method", ["mse", "entropy"])
def test_on_the_unsigned_grid_the_least_error_threshold_clips_less(method):
    # a never-negative tensor stored 0..255 (zero_points.py): rounding at amax / 255 costs 4x less
    # than at amax / 127, so against the same clipping error the best threshold moves out
    x = np.abs(np.random.default_rng(9).standard_t(3, 400_000)).astype(np.float32)
    amax = {}
    for levels in (127, 255):
        obs = make_observer(method, levels=levels)
        obs.update(x)
        amax[levels] = obs.amax()
    assert amax[255] > 1.05 * amax[127]   # measured: mse 55.7 -> 94.6, entropy 23.6 -> 25.6
    if method == "mse":   # and it is the least-error threshold of that grid, on the data itself
        def err(t):
            s = t / 255
            return float(((np.minimum(np.rint(x / s), 255) * s - x) ** 2).mean())
        assert err(amax[255]) <= 1.01 * min(err(amax[255] * f) for f in (0.8, 0.9, 1.1, 1.25))
