"""Load and run a built library with the TVM runtime only (no torch, no compiler passes)."""
from __future__ import annotations

import sys

import numpy as np
import tvm
from tvm import relax

from .artifact import artifact_paths, check_tvm_version, open_library
from ..errors import InputError
from ..progress import bar
from ..target import ARCH_SPECIFIC, arch_runs_on
from ..schedules import runtime_functions

# The functions kernels call at run time (the TMA encoder of Hopper's kernels): every library
# this process loads may call them.
runtime_functions.register()


def flatten(out) -> list[np.ndarray]:
    """A VM result (a tensor, or nested tuples of them) as a flat list of NumPy arrays."""
    flat = []

    def walk(o):
        if hasattr(o, "numpy"):
            flat.append(o.numpy())
        else:
            for item in o:
                walk(item)
    walk(out)
    return flat


def class_scores(shape, batch: int) -> bool:
    """Whether an output of ``shape`` holds class scores, ``[batch, classes]``: what a top-5 and
    an accuracy need (a feature map or a segmentation map does not)."""
    return shape is not None and len(shape) == 2 and int(shape[0]) == batch


def summarize(out: np.ndarray) -> list[str]:
    """A few lines that say what an output that is not class scores holds: its shape and value
    range, and, for a map with channels first (``[C, H, W]``, a segmentation map's class scores
    per pixel), which channel wins how many positions."""
    out = np.asarray(out)
    lines = [f"shape {tuple(out.shape)} {out.dtype}: min {out.min():.4g}, max {out.max():.4g}, mean {out.mean():.4g}, "
             f"std {out.std():.4g}"]
    if out.ndim >= 2 and out.shape[0] > 1:
        wins = np.bincount(out.argmax(0).ravel(), minlength=out.shape[0]) / out[0].size
        top = np.argsort(-wins)[:5]
        lines.append(f"argmax over its {out.shape[0]} channels, per position: " +
                     ", ".join(f"channel {c} {100 * wins[c]:.1f} %" for c in top if wins[c] > 0))
    return lines


def check_arch(lib_path: str, built: str | None, gpu: str) -> None:
    """Refuse a CUDA library this GPU cannot run (``target.arch_runs_on``: a cubin runs on its own
    major architecture at its minor version or later, ``sm_90a`` code on sm_90 GPUs only).

    Raises:
        InputError: naming both archs and the rebuild that fixes it.
    """
    if built and not arch_runs_on(built, gpu):
        raise InputError(f"{lib_path} was built for {built}, this GPU is {gpu}: rebuild with --arch {gpu}"
                         + (f" (or {gpu}a)" if gpu in ARCH_SPECIFIC else ""))


class CompiledModel:
    """A built int8 model: ``CompiledModel("vgg16.so", "cuda")(x) -> logits``."""

    def __init__(self, lib_path: str, device: str | None = None):
        self.meta = open_library(lib_path)
        check_tvm_version(lib_path, self.meta)
        params_path, _ = artifact_paths(lib_path)
        kind = device or self.meta["target"]
        if kind != self.meta["target"]:
            built = "CUDA" if self.meta["target"] == "cuda" else "the CPU (llvm)"
            raise InputError(f"{lib_path} was built for {built}, it cannot run on --device {kind}: run it with "
                             f"--device {self.meta['target']}, or rebuild with --target {kind}")
        self.dev = tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)
        if kind == "cuda" and not self.dev.exist:
            raise InputError(f"{lib_path} was built for CUDA but this machine has no CUDA GPU")
        if kind == "cuda":
            check_arch(lib_path, self.meta.get("arch"), f"sm_{self.dev.compute_version.replace('.', '')}")
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), self.dev)
        with np.load(params_path) as npz:
            self.params = [tvm.runtime.tensor(npz[n], self.dev) for n in self.meta["param_names"]]
        self.input_shape = tuple(self.meta["input_shape"])
        # what main returns ([N, classes] for a classifier); libraries from before it was recorded: None
        shape = self.meta.get("output_shape")
        self.output_shape = tuple(shape) if shape is not None else None

    def check_input(self, x: np.ndarray) -> np.ndarray:
        if x.ndim != 4 or tuple(x.shape) != self.input_shape:
            raise InputError(f"input has shape {tuple(x.shape)}, this library was built for {self.input_shape}: "
                             f"resize to {self.input_shape[2]}x{self.input_shape[3]} with {self.input_shape[1]} "
                             f"channels, or rebuild with --batch/--image-size")
        return np.ascontiguousarray(x, dtype=np.float32)

    def outputs(self, x: np.ndarray) -> list:
        """Every output of main as NumPy arrays (the logits first; then, for a library built with
        ``expose_activations``, the int8 activations of ``meta["report"]["exposed"]``)."""
        return flatten(self.vm["main"](tvm.runtime.tensor(self.check_input(x), self.dev), *self.params))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.outputs(x)[0]

    def benchmark(self, x: np.ndarray, number: int = 10, repeat: int = 5, progress: bool = False) -> dict:
        """Latency in ms (median and min over ``repeat`` runs of ``number`` calls), device-synchronized;
        ``progress``: a bar over the repeats (on a terminal)."""
        xt = tvm.runtime.tensor(self.check_input(x), self.dev)
        self.vm["main"](xt, *self.params)  # warm-up: module load, first-call allocations
        if progress and sys.stdout.isatty():  # a bar: one timer call per repeat (each adds an untimed call)
            timer = self.vm.time_evaluator("main", self.dev, number=number, repeat=1)
            results = [timer(xt, *self.params).results[0]
                       for _ in bar(range(repeat), desc=f"timing ({number} calls a repeat)", unit="repeat")]
        else:
            results = self.vm.time_evaluator("main", self.dev, number=number, repeat=repeat)(xt, *self.params).results
        ms = np.array(results) * 1e3
        return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()), "number": number, "repeat": repeat}
