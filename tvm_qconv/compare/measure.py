"""How a row of the comparison is measured: latency over rotating input sets, device memory, and
agreement with fp32 PyTorch.

Latency (METHOD: device work is asynchronous, so events around the region, many repeats, the
median): on CUDA each call is bracketed by CUDA events on the current stream and synchronized,
so one figure is one forward's latency, launch overhead included; on the CPU, wall time of a call
that returns its result.  Calls cycle over several input sets (``CompareOptions.input_sets``), so
the second call does not find its input in the L2 cache the first one left behind.  A row stops
after ``max_runs`` calls or ``budget_s`` seconds, whichever comes first, but never before
``min_runs``: a slow baseline (ONNX Runtime on the CPU at batch 64) gets few runs, and the JSON
says how many.
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..evaluate import sqnr_db


def cuda_median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (one kernel or a few: the
    benchmarks' per-layer timer)."""
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


def cuda_graph_ms(fn, reps: int = 20, iters: int = 5, warmup: int = 3) -> float:
    """Median milliseconds of one ``fn()`` with ``reps`` calls captured in a CUDA graph, the
    graph replayed ``iters`` times between events: the GPU's time without the host's launch gaps
    (a few-microsecond kernel timed alone is mostly the host's call; in a training step captured
    in a graph, none of it is).  ``fn`` must be capturable: CUDA work on the current stream only,
    no host syncs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # warm-up (builds, allocator pools) off the capture
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return float(np.median(times))


@dataclass(frozen=True)
class Timing:
    """Latency of one row: median and 99th percentile in ms over ``runs`` calls."""

    median_ms: float
    p99_ms: float
    mean_ms: float
    runs: int


def time_calls(fn, inputs: list, cuda: bool, *, warmup: int = 5, min_runs: int = 3, max_runs: int = 200,
               budget_s: float = 3.0) -> Timing:
    """Time ``fn(x)`` for ``x`` cycling over ``inputs``.

    Args:
        fn: one forward; on CUDA it may return before the device is done (it is synchronized here).
        inputs: prepared inputs (on the device the row runs on), used in turn.
        cuda: bracket each call with CUDA events (else wall time).
        warmup: calls before timing (cuDNN's algorithm search, allocations, lazy loading).
        min_runs, max_runs, budget_s: stop after ``max_runs`` calls or ``budget_s`` seconds of
            timed calls, but not before ``min_runs``.
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() < deadline):
        x = inputs[len(times) % len(inputs)]
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t) * 1e3)
    ms = np.asarray(times)
    return Timing(float(np.median(ms)), float(np.percentile(ms, 99)), float(ms.mean()), len(ms))


def device_memory_used_mib() -> float | None:
    """Memory in use on the current CUDA device (all allocators: PyTorch's, TVM's, cuDNN's,
    ONNX Runtime's), in MiB; None without CUDA."""
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001 - a driver without the query: memory is not reported
        return None
    return (total - free) / 2**20


def release_device_memory() -> None:
    """Give cached device memory back (Python garbage and torch.compile's compiled graphs of an
    earlier row first), so a row's memory is its own: freeing the last batch's compiled graphs
    inside the next torch.compile row made its memory read 0 MiB (H100, 2026-11-25)."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - nothing to release without CUDA
        pass


def agreement(reference: np.ndarray, logits: np.ndarray) -> dict:
    """Top-1 agreement (fraction of images whose arg-max class is the reference's) and logits
    SQNR of ``logits`` against ``reference`` (both [images, classes])."""
    if reference.shape != logits.shape:
        raise ValueError(f"logits of shape {logits.shape}, the reference has {reference.shape}")
    if not np.all(np.isfinite(logits)):
        return dict(top1_agree=0.0, sqnr_db=float("-inf"))
    return dict(top1_agree=float((reference.argmax(1) == logits.argmax(1)).mean()),
                sqnr_db=sqnr_db(reference, logits))


def mark_wrong(row: dict, floor_db: float, reference: str = "fp32 PyTorch") -> None:
    """Mark a measured row whose logits disagree with the reference (fp32 PyTorch; SQNR under
    ``floor_db``) as ``wrong``: a latency of something that does not compute the model is no baseline."""
    sqnr = row.get("sqnr_db")
    if row["status"] == "ok" and sqnr is not None and float(sqnr) < floor_db:
        row.update(status="wrong", reason=f"its logits are not the model's: SQNR {float(sqnr):.1f} dB against "
                                          f"{reference} (floor {floor_db:g}), top-1 {row['top1_agree']:.0%}")
