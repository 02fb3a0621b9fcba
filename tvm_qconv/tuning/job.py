"""TuneJob: one tuning run described in one object -- what to tune, how long, where the candidates
are measured, where the results go -- validated when it is made.

    job = TuneJob("vgg16", batch=64, arch="sm_90a", trials_per_task=1)
    rows = tune(job)            # tvm_qconv.tuning.driver: resumes from job.folder's database
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import tvm

from .. import registry
from ..errors import InputError


def model_stem(model_name: str) -> str:
    """A model's name as one path component: a torchvision name as it is; a file's stem for an
    ONNX file (``path/to/resnet18.onnx`` -> ``resnet18``) and ``<file stem>_<factory>`` for a user
    model (``models/efficientnet_lite.py:lite0`` -> ``efficientnet_lite_lite0``, compare's file names)."""
    path, _, factory = model_name.rpartition(":") if ".py:" in model_name else (model_name, "", "")
    stem = os.path.splitext(os.path.basename(path))[0] if (os.sep in path or path.lower().endswith((".onnx", ".py"))) \
        else path
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem + (f"_{factory}" if factory else ""))


def default_work_dir(model_name: str, batch: int, arch: str) -> str:
    """``tuning_logs/<model>-b<batch>-<arch or llvm>``: where a tuning run's database goes
    (``<model>``: :func:`model_stem`)."""
    return os.path.join("tuning_logs", f"{model_stem(model_name)}-b{batch}-{arch}")


@dataclass(frozen=True)
class TuneJob:
    """One tuning run.

    What to tune:
        model_name: torchvision name (``vgg16``); ``model``: a torch module to tune instead (its
            name in the database's config is still ``model_name``).
        batch, image_size: the input shape (batch, 3, image_size, image_size); build with the same.
        target, arch: ``cuda`` with its arch (``sm_90``...), or ``llvm`` (the CPU's conv; arch is
            ignored).
        families: tune only these kernel families (``wgmma``, ``mma``, ``dp4a``); default every
            family that can run a layer, so the build can pick the fastest one per layer.
        only: task names (as printed) to tune; default all.
        space: the search space by name (the dp4a family's ``template`` or ``mlt``); default each
            implementation's first.

    How long:
        trials_per_task: valid measurements per task, those in the database included; a task
            measured point by point (the wgmma family's tiles) measures its whole space.
        num_trials_per_iter: candidates built and measured per batch.
        seed: seeds the search (mixed with the database size: a resumed run does not replay the
            first run's samples).
        seed_default: measure the default schedule of each new task first.

    Where the candidates are measured:
        remote: a :class:`tvm_qconv.remote.Remote` tracker (built here, measured on its servers);
            None: on this machine.
        max_workers: parallel builds (default: all CPU cores).
        runner, builder: MetaSchedule Runner / Builder replacing the local ones (tests).

    Where the results go:
        work_dir: the database folder (default :func:`default_work_dir`).
        peaks: the GPU's int8 peaks in TOPS by instruction (``read_peaks``), to print each task's
            % of the peak of its kernel's instruction.

    Raises:
        InputError: a value out of range, an unknown target or family, a remote that is not a
            tracker.
    """

    model_name: str
    batch: int = 1
    image_size: int = 224
    target: str = "cuda"
    arch: str | None = "sm_90"
    families: tuple[str, ...] | None = None
    only: tuple[str, ...] | None = None
    space: str | None = None
    model: object = field(default=None, compare=False, repr=False)
    trials_per_task: int = 64
    num_trials_per_iter: int = 32
    seed: int = 0
    seed_default: bool = True
    remote: object = field(default=None, compare=False)
    max_workers: int | None = None
    runner: object = field(default=None, compare=False, repr=False)
    builder: object = field(default=None, compare=False, repr=False)
    work_dir: str | None = None
    peaks: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.target not in ("cuda", "llvm"):
            raise InputError(f"unknown target {self.target!r}: tune for cuda (a GPU) or llvm (a CPU)")
        if self.remote is not None and not self.remote.via_tracker:
            raise InputError("tuning through RPC goes through a tracker (--rpc-tracker H:P --rpc-key K), so that "
                             "every server of the key measures candidates")
        for label, value in (("trials per task", self.trials_per_task),
                             ("trials per iteration", self.num_trials_per_iter), ("batch", self.batch),
                             ("workers", self.max_workers), ("image size", self.image_size)):
            if value is not None and value < 1:
                raise InputError(f"{label} must be >= 1, got {value}")
        known = sorted({impl.family for impl in registry.tunable()})
        unknown = [f for f in self.families or () if f not in known]
        if unknown:
            raise InputError(f"unknown kernel family {', '.join(map(repr, unknown))}: the tunable families are "
                             f"{', '.join(known)}")
        # lists from a CLI or a caller, held as tuples; no arch for the CPU
        object.__setattr__(self, "families", tuple(self.families) if self.families else None)
        object.__setattr__(self, "only", tuple(self.only) if self.only else None)
        if self.target != "cuda":
            object.__setattr__(self, "arch", None)

    @property
    def folder(self) -> str:
        """The database folder: ``work_dir``, or :func:`default_work_dir`."""
        return self.work_dir or default_work_dir(self.model_name, self.batch, self.arch or self.target)

    def settings(self) -> dict:
        """What the database's ``config.json`` records of this run (``check_config`` refuses a
        folder of another model, batch, arch or image size)."""
        return dict(model=self.model_name, batch=self.batch, target=self.target, arch=self.arch,
                    image_size=self.image_size, trials_per_task=self.trials_per_task,
                    only=list(self.only) if self.only else None, space=self.space,
                    families=list(self.families) if self.families else None, tvm_version=tvm.__version__,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"))
