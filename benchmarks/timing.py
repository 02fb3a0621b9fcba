"""Timing shared by the benchmarks: CUDA-event medians after warm-up (``tvm_qconv.compare.measure``,
where ``deploy.py compare`` takes its timer from too), and the per-layer benchmarks' parallel
kernel builds."""
import time
from concurrent.futures import ProcessPoolExecutor

from tvm_qconv.compare.measure import cuda_median_ms

__all__ = ["build_all", "cuda_median_ms"]


def build_all(build, jobs: list, workers: int) -> list[float]:
    """``build(job)`` for every job in ``workers`` processes (CPU work: schedule, nvcc), before
    anything is timed; returns each build's seconds and prints the total."""
    t0 = time.time()
    with ProcessPoolExecutor(workers) as pool:
        seconds = list(pool.map(build, jobs))
    print(f"built {len(jobs)} kernels in {time.time() - t0:.0f} s", flush=True)
    return seconds
