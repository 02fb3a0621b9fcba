"""The int8 libraries a comparison times: one per batch size (and, on CUDA, with and without
CUDA graphs), all from the same calibrated ranges, built before anything is timed.

Builds are CPU work (quantize, schedule, nvcc), so ``jobs > 1`` runs them in parallel worker
processes; every timing runs afterwards, alone on the device.  A worker rebuilds the float model
from its name (or ``path.py:factory``) and the comparison's saved state dict, so the libraries
hold exactly the weights of the model the baselines run.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch

from ..build import BuildOptions, compile_model
from ..config import QuantConfig
from ..frontend import load_model
from ..ranges.sources import GivenRanges


@dataclass(frozen=True)
class Built:
    """A library ready to time: its path, the seconds its build took (None: the user's
    ``--lib``), a note for the table, and whether it holds the comparison's float weights."""

    path: str
    build_s: float | None
    note: str = ""
    same_weights: bool = True


@dataclass(frozen=True)
class BuildJob:
    """One library: the slot it fills (batch, CUDA graphs) and how to build it."""

    batch: int
    graph: bool
    path: str
    options: BuildOptions


def _build(job: BuildJob, model, name: str, ranges: GivenRanges, config: QuantConfig) -> Built:
    t = time.perf_counter()
    compile_model(model, job.path, options=job.options, config=config, name=name, ranges=ranges,
                  progress=False)
    note = "tuned" if job.options.tuning_log else ""
    return Built(job.path, round(time.perf_counter() - t, 1), note)


def _build_in_worker(job: BuildJob, spec: dict, ranges: GivenRanges, config: QuantConfig) -> Built:
    """A worker process's build: the model from ``spec`` (``name``, ``num_classes``, the saved
    ``state`` file, None for an ONNX file), then :func:`_build`."""
    model = load_model(spec["name"], num_classes=spec["num_classes"])
    if spec["state"] is not None:     # (an ONNX file holds its weights: no state)
        model.load_state_dict(torch.load(spec["state"], map_location="cpu", weights_only=True))
    return _build(job, model.eval(), spec["name"], ranges, config)


def build_libraries(jobs: list[BuildJob], model, spec: dict | None, ranges: GivenRanges, config: QuantConfig,
                    workers: int = 1, progress=print) -> dict:
    """Build every job; ``{(batch, graph): Built or the exception that stopped its build}``.

    Args:
        jobs: the libraries to build.
        model: the float ``nn.Module`` (used in this process when ``workers == 1`` or no ``spec``).
        spec: how a worker process rebuilds ``model`` (``name``, ``num_classes``, ``state``:
            a ``torch.save``-d state dict); None: build here, one after another.
        ranges: the calibrated ranges (and channel means) every library uses.
        config: the scheme, its defaults decided (``QuantConfig.resolved``).
        workers: parallel builds.
        progress: called with one line per finished build.
    """
    results: dict = {}
    name = spec["name"] if spec else type(model).__name__.lower()
    if workers <= 1 or spec is None or len(jobs) <= 1:
        for job in jobs:
            try:
                results[job.batch, job.graph] = _build(job, model, name, ranges, config)
            except Exception as err:  # noqa: BLE001 - one failed build is one failed row
                results[job.batch, job.graph] = err
            _report(job, results[job.batch, job.graph], progress)
        return results
    pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)),
                                                  mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(_build_in_worker, job, spec, ranges, config): job for job in jobs}
        for fut in concurrent.futures.as_completed(futures):
            job = futures[fut]
            try:
                results[job.batch, job.graph] = fut.result()
            except Exception as err:  # noqa: BLE001 - one failed build is one failed row
                results[job.batch, job.graph] = err
            _report(job, results[job.batch, job.graph], progress)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _report(job: BuildJob, result, progress) -> None:
    what = f"int8 library b{job.batch}{' + CUDA graph' if job.graph else ''} -> {os.path.basename(job.path)}"
    if isinstance(result, Exception):
        progress(f"[compare] build {what}: FAILED {type(result).__name__}: {str(result).strip()[:200]}")
    else:
        progress(f"[compare] built {what} in {result.build_s} s")
