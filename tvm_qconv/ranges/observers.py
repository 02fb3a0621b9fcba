"""Activation range observers for post-training calibration, and per-channel weight scales.

An observer sees every calibration batch of one activation tensor (``update``) and then
picks a clipping threshold ``amax`` for |x|; the symmetric int8 scale is ``amax / 127``.

* ``MaxObserver``: the largest |x| seen (no clipping; one outlier widens the scale).
* ``PercentileObserver``: a high percentile of |x| (clips the rarest outliers).
* ``MSEObserver``: the threshold that minimizes the int8 version's mean squared error.
* ``EntropyObserver``: TensorRT's KL-divergence calibration (Migacz, "8-bit Inference
  with TensorRT", GTC 2017): the threshold whose int8 version of the histogram loses the
  least information.

The percentile and entropy observers keep a fixed-size histogram of |x| over
``[0, range)``, so memory stays bounded however many (and however large) batches they see.
"""
from __future__ import annotations

import math

import numpy as np

NON_FINITE_MESSAGE = "non-finite values (NaN/Inf) in calibration activations"
QMAX = 127  # symmetric int8: [-127, 127]; -128 is unused so that the range is symmetric
# The scale of an all-zero weight channel: any positive value is exact.  A floor, not a range limit:
# 1e-8 made channels with max|w| < 1.27e-6 lose their levels; 1e-30 is still a normal float32.
MIN_WEIGHT_SCALE = 1e-30
_CHUNK = 1 << 22  # elements per histogram pass: bounds temporaries to ~50 MB per update


def _validated(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Check a calibration batch and return it as a float array with its max |x|.

    Args:
        x: activations of any shape.

    Returns:
        ``(x, amax)``: ``x`` as a floating array (not copied if it already is one), and
        the exact max of |x| (0.0 for an empty array).

    Raises:
        ValueError: ``x`` contains NaN or Inf.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    if x.size == 0:
        return x, 0.0
    # min/max instead of np.abs(x).max() / np.isfinite(x).all(): no full-size temporary
    # for 800 MB batches, and NaN propagates through both while Inf is an extreme.
    lo, hi = float(x.min()), float(x.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(NON_FINITE_MESSAGE)
    return x, max(-lo, hi)


class Observer:
    """Base class: accumulate calibration batches, then choose a clipping threshold."""

    def update(self, x: np.ndarray) -> None:
        """Observe one calibration batch.

        Args:
            x: float activations of any shape; may be called any number of times.

        Raises:
            ValueError: ``x`` contains NaN or Inf (the caller adds the layer name).
        """
        x, batch_max = _validated(x)
        self._update(x, batch_max)

    def amax(self) -> float:
        """Return the clipping threshold for |x| (>= 0; 0.0 only if every value was 0).

        Raises:
            RuntimeError: ``update`` was never called.
        """
        raise NotImplementedError

    def _update(self, x: np.ndarray, batch_max: float) -> None:
        raise NotImplementedError


class MaxObserver(Observer):
    """Running max of |x|: the threshold that clips nothing."""

    def __init__(self) -> None:
        self._max: float | None = None

    def _update(self, x: np.ndarray, batch_max: float) -> None:
        self._max = batch_max if self._max is None else max(self._max, batch_max)

    def amax(self) -> float:
        if self._max is None:
            raise RuntimeError("MaxObserver has seen no data; call update() first")
        return self._max


class _HistogramObserver(Observer):
    """Histogram of |x| with ``num_bins`` equal bins over ``[0, range)``.

    When a batch's max exceeds the range, the range grows by the smallest integer factor
    ``f`` that covers it and every ``f`` consecutive old bins are summed into one new bin.
    Because the new bin edges are a subset of the old ones this merge is exact (unlike
    spreading counts proportionally across misaligned bins, errors do not compound over
    batches). The approximation is resolution only: after a growth the data may occupy
    as little as (f-1)/f >= 1/2 of the bins, so the bin width is at most
    ``2 * max|x| / num_bins``.
    """

    def __init__(self, num_bins: int = 2048) -> None:
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self.num_bins = int(num_bins)
        self._hist = np.zeros(self.num_bins, dtype=np.int64)
        self._range = 0.0  # 0 until a non-zero value is seen
        self._max: float | None = None  # exact running max of |x|
        self._zeros = 0  # exact zeros (also counted in bin 0)

    @property
    def bin_width(self) -> float:
        """Width of one histogram bin (0.0 while every value seen was 0)."""
        return self._range / self.num_bins

    def _grow(self, new_max: float) -> None:
        if self._range == 0.0:
            # Only zeros so far: they all sit in bin 0, which stays bin 0 at any range.
            self._range = new_max
            return
        f = math.ceil(new_max / self._range)
        padded = np.zeros(math.ceil(self.num_bins / f) * f, dtype=np.int64)
        padded[: self.num_bins] = self._hist
        merged = padded.reshape(-1, f).sum(axis=1)
        self._hist = np.zeros(self.num_bins, dtype=np.int64)
        self._hist[: merged.size] = merged
        self._range *= f

    def _update(self, x: np.ndarray, batch_max: float) -> None:
        self._max = batch_max if self._max is None else max(self._max, batch_max)
        if batch_max > self._range:
            self._grow(batch_max)
        flat = x.reshape(-1)
        per_unit = self.num_bins / self._range if self._range > 0 else 0.0
        for start in range(0, flat.size, _CHUNK):
            a = np.abs(flat[start : start + _CHUNK])
            self._zeros += a.size - int(np.count_nonzero(a))
            # Floor of |x| / bin_width; |x| == range lands in the last bin, as np.histogram.
            idx = np.minimum((a * per_unit).astype(np.intp), self.num_bins - 1)
            self._hist += np.bincount(idx, minlength=self.num_bins)

    def _check_seen(self) -> None:
        if self._max is None:
            raise RuntimeError(f"{type(self).__name__} has seen no data; call update() first")


class PercentileObserver(_HistogramObserver):
    """The ``percentile``-th percentile of |x| over all data seen.

    Read from the histogram's CDF with linear interpolation inside the bin, so it is
    within one bin width of ``np.percentile(np.abs(all_x), percentile)``.
    """

    def __init__(self, percentile: float = 99.99, num_bins: int = 2048) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        super().__init__(num_bins)
        self.percentile = float(percentile)

    def amax(self) -> float:
        self._check_seen()
        if self._range == 0.0:
            return 0.0
        cdf = np.cumsum(self._hist)
        target = self.percentile / 100.0 * cdf[-1]
        i = int(np.searchsorted(cdf, target, side="left"))
        below = cdf[i - 1] if i > 0 else 0
        frac = (target - below) / self._hist[i] if self._hist[i] > 0 else 0.0
        # The upper part of the top bin may lie above every value actually seen.
        return min((i + frac) * self.bin_width, self._max)


def _kl_divergences(hist: np.ndarray, num_quant_bins: int, stop: int) -> np.ndarray:
    """KL(P || Q) for every candidate threshold bin ``i`` in ``[num_quant_bins, stop]``.

    Args:
        hist: float64 histogram of |x| (exact zeros already removed from bin 0).
        num_quant_bins: int8 levels on one side (128).
        stop: the last candidate (number of bins kept).

    Returns:
        ``divergences[k]`` for ``i = num_quant_bins + k``.
    """
    eps = 1e-10  # stands in for Q == 0 where P > 0, so that clipping is costly, not inf
    tail = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # tail[i] = sum(hist[i:])
    bins = np.arange(stop)
    out = np.empty(stop - num_quant_bins + 1)
    for k, i in enumerate(range(num_quant_bins, stop + 1)):
        # Reference P: the first i bins, with everything clipped folded into the last.
        p = hist[:i].copy()
        p[-1] += tail[i]
        nonzero = p > 0
        # Candidate Q (Migacz): the clipped histogram hist[:i] (outliers excluded, as in
        # TensorRT/MXNet, so that clipping mass costs KL) merged into num_quant_bins
        # near-equal groups, each group's mass spread evenly over P's non-zero bins.
        group = bins[:i] * num_quant_bins // i
        mass = np.bincount(group, weights=hist[:i], minlength=num_quant_bins)
        count = np.bincount(group, weights=nonzero, minlength=num_quant_bins)
        q = np.where(nonzero, mass[group] / np.maximum(count[group], 1.0), 0.0)
        p_sum, q_sum = p.sum(), q.sum()
        if p_sum == 0.0 or q_sum == 0.0:
            out[k] = np.inf
            continue
        pn = p[nonzero] / p_sum
        qn = np.maximum(q[nonzero] / q_sum, eps)
        out[k] = float(np.sum(pn * np.log(pn / qn)))
    return out


class EntropyObserver(_HistogramObserver):
    """TensorRT KL-divergence calibration (Migacz, GTC 2017).

    For each candidate threshold bin ``i`` in ``[num_quant_bins, num_bins]``, compare the
    histogram clipped at bin ``i`` (P) with its ``num_quant_bins``-level quantization (Q)
    and keep the ``i`` with the smallest KL(P || Q). ``amax`` is the upper edge of the
    last kept bin, ``i * bin_width`` (pytorch-quantization's convention; Migacz's slides
    use ``(i + 0.5) * bin_width``), capped at the largest |x| seen.

    Exact zeros are left out of the divergence: they are exact in int8 at any scale, and
    the ReLU zero spike (often half the values) would otherwise dominate group 0 and pull
    the threshold down (pytorch-quantization works around the same spike with
    ``hist[0] = hist[1]``).
    """

    def __init__(self, num_bins: int = 2048, num_quant_bins: int = 128) -> None:
        if not 1 <= num_quant_bins <= num_bins:
            raise ValueError(
                f"need 1 <= num_quant_bins <= num_bins, got {num_quant_bins} and {num_bins}"
            )
        super().__init__(num_bins)
        self.num_quant_bins = int(num_quant_bins)

    def amax(self) -> float:
        self._check_seen()
        hist = self._hist.astype(np.float64)
        hist[0] -= self._zeros
        nonzero_bins = np.flatnonzero(hist)
        if nonzero_bins.size == 0:
            return self._max  # 0.0: nothing but zeros
        # Thresholds past the last non-empty bin clip nothing more: no need to try them.
        stop = int(nonzero_bins[-1]) + 1
        if stop <= self.num_quant_bins:
            return self._max  # fits in num_quant_bins bins: int8 loses nothing to clip for
        kl = _kl_divergences(hist, self.num_quant_bins, stop)
        # Ties go to the largest threshold (least clipping).  On discrete data (image pixels with
        # few levels, digits' 17 grey levels) every threshold whose groups hold at most one
        # non-empty bin has KL ~ 0, and argmin's first (smallest) pick would clip the tail away.
        ties = np.flatnonzero(kl <= kl.min() * (1 + 1e-6) + 1e-12)
        best = self.num_quant_bins + int(ties[-1])
        return min(best * self.bin_width, self._max)


class MSEObserver(_HistogramObserver):
    """The threshold whose int8 quantization of the data has the least mean squared error.

    For each candidate threshold ``t`` (the upper edge of histogram bin ``i``, for every ``i``
    from ``min_bin`` up) every bin's values, taken at the bin centre, are quantized at scale
    ``t / levels`` (rounded to nearest, clipped at ``levels``: 127, or 255 for an unsigned tensor)
    and the squared errors summed, weighted by the bin counts: rounding error inside the range
    against clipping error beyond it.  Exact zeros cost nothing at any scale and are left out.
    Ties go to the largest threshold.
    """

    def __init__(self, num_bins: int = 2048, min_bin: int = 32, levels: int = QMAX) -> None:
        super().__init__(num_bins)
        self.min_bin = int(min_bin)
        self.levels = int(levels)

    def amax(self) -> float:
        self._check_seen()
        hist = self._hist.astype(np.float64)
        hist[0] -= self._zeros
        nonzero = np.flatnonzero(hist)
        if nonzero.size == 0:
            return self._max  # nothing but zeros
        stop = int(nonzero[-1]) + 1
        centres = (np.arange(stop) + 0.5) * self.bin_width
        candidates = np.arange(min(self.min_bin, stop), stop + 1)
        errors = np.empty(len(candidates))
        for k in range(0, len(candidates), 256):  # bounded temporaries: 256 x stop floats at a time
            t = candidates[k:k + 256, None] * self.bin_width
            s = t / self.levels
            q = np.minimum(np.rint(centres[None, :] / s), self.levels) * s
            errors[k:k + 256] = ((q - centres[None, :]) ** 2 * hist[None, :stop]).sum(axis=1)
        best = candidates[np.flatnonzero(errors <= errors.min() * (1 + 1e-9))[-1]]
        return min(best * self.bin_width, self._max)


def make_observer(method: str, percentile: float = 99.99, levels: int = QMAX) -> Observer:
    """Create the observer for a calibration method.

    Args:
        method: ``"max"``, ``"percentile"``, ``"entropy"`` or ``"mse"``.
        percentile: used by ``"percentile"`` only.
        levels: the grid's steps above zero: 127 (symmetric int8), 255 for a tensor stored
            unsigned (``zero_points.py``); ``entropy`` and ``mse`` weigh rounding against
            clipping on it.

    Returns:
        A fresh observer.

    Raises:
        ValueError: unknown method.
    """
    if method == "max":
        return MaxObserver()
    if method == "percentile":
        return PercentileObserver(percentile)
    if method == "entropy":
        return EntropyObserver(num_quant_bins=levels + 1)
    if method == "mse":
        return MSEObserver(levels=levels)
    raise ValueError(
        f"unknown calibration method {method!r}; choose one of 'max', 'percentile', 'entropy', 'mse'"
    )


def weight_scales_per_channel(w: np.ndarray) -> np.ndarray:
    """Symmetric per-output-channel int8 scales ``max(|w_c|) / 127``.

    Args:
        w: weights with output channels on axis 0 (OIHW, or OI for dense).

    Returns:
        float32 scales of shape ``(O,)``, each >= ``MIN_WEIGHT_SCALE`` so that division is
        safe; an all-zero channel still quantizes exactly (to 0).

    Raises:
        ValueError: ``w`` is 0-d or contains NaN/Inf.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim == 0:
        raise ValueError("weights need an output-channel axis (axis 0); got a scalar")
    if not np.isfinite(w).all():
        raise ValueError("non-finite values (NaN/Inf) in weights")
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1, initial=0.0)
    return np.maximum(amax / np.float32(QMAX), np.float32(MIN_WEIGHT_SCALE)).astype(np.float32)


def quantize_weight_per_channel(w: np.ndarray, scales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize weights to int8, symmetric per output channel.

    Args:
        w: weights with output channels on axis 0.
        scales: the per-channel scales to quantize at (``(O,)``, positive); default
            :func:`weight_scales_per_channel`'s ``max(|w_c|) / 127``.  A larger one clamps nothing
            and rounds more coarsely (``quantization/scales.py``: ``bias_weight_scales``).

    Returns:
        ``(q, scales)``: int8 ``q`` with the shape of ``w`` and values in [-127, 127], and
        float32 ``scales`` of shape ``(O,)``; ``w ~= q * scales[:, None, ...]``.
    """
    w = np.asarray(w, dtype=np.float32)
    scales = weight_scales_per_channel(w) if scales is None else np.asarray(scales, np.float32)
    s = scales.reshape((-1,) + (1,) * (w.ndim - 1))
    # Round to nearest. The seed formulas truncate (astype(int8) of w/s), which biases
    # every weight toward zero and doubles the worst-case error from s/2 to s.
    q = np.clip(np.rint(w / s), -QMAX, QMAX).astype(np.int8)
    return q, scales
