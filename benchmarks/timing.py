"""Timing shared by the benchmarks: CUDA-event medians after warm-up (METHOD: device work is
asynchronous, so events around the region, many repeats, the median)."""
from __future__ import annotations

import numpy as np


def cuda_median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))
