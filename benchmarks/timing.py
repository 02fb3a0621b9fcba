"""Timing shared by the benchmarks: CUDA-event medians after warm-up (``tvm_qconv.compare.measure``,
where ``deploy.py compare`` takes its timer from too)."""
from tvm_qconv.compare.measure import cuda_median_ms

__all__ = ["cuda_median_ms"]
