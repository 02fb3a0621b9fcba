"""MetaSchedule tuning of the int8 conv kernels on CUDA: extract, tune, apply, prune.

    tune_model("vgg16", 1)    every distinct conv of VGG16 at batch 1, tuned on the dp4a space
                              (schedules/conv2d_nchw4c_dp4a_space.py) into
                              tuning_logs/vgg16-b1-sm_90/: MetaSchedule's JSON database,
                              config.json and logs/; run it again to continue where it stopped
    compile_model(..., tuning_log="tuning_logs/vgg16-b1-sm_90")
                              -> apply_tuning_database: each conv the database covers gets its
                              best schedule, the others the default dp4a schedule
    prune_database(work_dir)  keeps the best record per workload (small enough to commit)

A task is one distinct conv PrimFunc, a *workload* in MetaSchedule's terms: the database finds a
schedule by structural equality of the function, so tuning and building must present the same
function (``_task_func``).  Schedules depend on shapes only, so the module tuned is built with
random weights and 2 calibration photos.

The database is MetaSchedule's: ``database_workload.json`` (one line per workload) and
``database_tuning_record.json`` (one line per measured candidate: workload index, trace, run
times, target).  Both are appended to a line at a time; a run killed mid-write can leave a
truncated last line, which MetaSchedule cannot load: tune_model and prune_database repair the
files first (``_repair_database``, keeping a backup), apply_tuning_database skips such a line
in memory.  An interrupted run loses at most its in-flight trials.
"""
from __future__ import annotations

import ast
import gzip
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from schedules.conv2d_nchw4c_dp4a import _ensure_dp4a_registered, apply_dp4a_schedule, default_tiles
from schedules.conv2d_nchw4c_dp4a_space import SPACES, space_generator
from schedules.conv2d_nchw4c_int8 import KERNEL_NAME, Conv2dWorkload

from .errors import InputError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
CONFIG_FILE = "config.json"
# MetaSchedule records a failed build or run with this run time (s): not a valid measurement.
FAILED_RUN_SECS = 1e10
# Per candidate, worker start included.  Workers here do not import tvm.s_tir.tensor_intrin
# (_build_function), so start-up is a plain `import tvm` (~5 s); NVRTC/nvcc of one kernel takes
# seconds.  A candidate still compiling after this is pathological (huge explicit unroll).
BUILD_TIMEOUT_S = 120.0
CALIB_IMAGES = 2  # tuning depends on shapes only; calibration just has to run
# Evolutionary-search population (MetaSchedule default 512): the template space is small and
# mostly valid; on the 2-core CPU box 128 cut one search round from 60-90 s to ~20 s.
POPULATION = 128
# Attributes the Relax module adds to a kernel that say nothing about its computation.
_RELAX_ONLY_ATTRS = ("global_symbol", "op_pattern")


@dataclass
class ConvTask:
    """One distinct conv kernel of a model.

    Attributes:
        name: readable and unique within the model, e.g. ``64to64_3x3s1_56x56_b1``.
        workload: the layer shape, from the PrimFunc's ``tvm_qconv.workload`` attribute.
        func: the PrimFunc as MetaSchedule sees it (``_task_func``).
        weight: how many times the model calls it.
    """

    name: str
    workload: Conv2dWorkload
    func: tirx.PrimFunc
    weight: int


def default_work_dir(model_name: str, batch: int, arch: str) -> str:
    return os.path.join("tuning_logs", f"{model_name}-b{batch}-{arch}")


def _task_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The conv PrimFunc in the one form that tuning commits and building looks up.

    Drops what the Relax module added (its name, the FuseOps pattern) and adds what
    TuneContext's normalization would (``global_symbol`` "main", ``tirx.noalias``), so the
    structural match depends only on the computation, not on where the function sat.
    """
    for key in _RELAX_ONLY_ATTRS:
        if key in func.attrs:
            func = func.without_attr(key)
    return func.with_attr({"global_symbol": "main", "tirx.noalias": True})


def _is_conv(func) -> bool:
    return (isinstance(func, tirx.PrimFunc) and func.attrs is not None
            and str(func.attrs.get("tvm_qconv.kernel", "")) == KERNEL_NAME
            and not func.attrs.get("tir.is_scheduled", False))


def _parse_workload(func: tirx.PrimFunc) -> Conv2dWorkload:
    """The Conv2dWorkload from the ``tvm_qconv.workload`` attribute (a Python dict literal)."""
    return Conv2dWorkload(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


def _task_name(wl: Conv2dWorkload) -> str:
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    name = f"{wl.in_channels}to{wl.out_channels}_{kh}x{kw}s{sh}" + (f"x{sw}" if sw != sh else "")
    name += f"_{wl.height}x{wl.width}_b{wl.batch}"
    if (dh, dw) != (1, 1):
        name += f"_d{dh}x{dw}"
    return name if wl.relu else name + "_norelu"


def extract_conv_tasks(mod: tvm.IRModule) -> list[ConvTask]:
    """The distinct int8 conv kernels an int8 Relax module calls, in graph order.

    Args:
        mod: the output of ``quantize_module`` (before or after ``LiftConstantsToParams``).
    Returns:
        One ConvTask per structurally distinct unscheduled ``conv2d_nchw4c_int8`` PrimFunc
        called from a Relax function, with ``weight`` = its number of call sites (VGG16 at
        224: 13 convs, 9 tasks).
    """
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls: Counter = Counter()  # GlobalVar name -> call sites, in first-call order

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            calls[expr.args[0].name_hint] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    tasks: list[ConvTask] = []
    by_hash: dict[int, list[ConvTask]] = {}
    for gv_name, count in calls.items():
        func = mod[gv_name]
        if not _is_conv(func):
            continue
        canon = _task_func(func)
        bucket = by_hash.setdefault(tvm_ffi.structural_hash(canon), [])
        same = next((t for t in bucket if tvm_ffi.structural_equal(t.func, canon)), None)
        if same is not None:
            same.weight += count
            continue
        wl = _parse_workload(func)
        name, taken = _task_name(wl), {t.name for t in tasks}
        suffix = 2
        while name in taken:  # same shape, other padding: keep names unique
            name, suffix = f"{_task_name(wl)}_{suffix}", suffix + 1
        task = ConvTask(name, wl, canon, count)
        bucket.append(task)
        tasks.append(task)
    return tasks


# ---------------------------------------------------------------- the database files


def _atomic_write_lines(path: str, lines: list[bytes]) -> None:
    """Replace ``path`` by ``lines`` (newline-terminated) through a temp file + rename;
    gzip-compressed when ``path`` ends in ``.gz``."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tvm_qconv-")
    try:
        with os.fdopen(fd, "wb") as raw:
            # mtime=0: the same records give the same bytes (no diff in git from a re-prune).
            f = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if path.endswith(".gz") else raw
            f.writelines(line + b"\n" for line in lines)
            f.close()
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def _parse_lines(path: str) -> tuple[list[bytes], list, bool]:
    """(raw lines, parsed JSON or None per line, whether the file ends in a newline)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        raw = f.read()
    lines = [line for line in raw.split(b"\n") if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            parsed.append(None)
    return lines, parsed, raw.endswith(b"\n") or not raw


def _db_files(work_dir: str) -> list[str] | None:
    """The database's (workload, record) files: the plain ones MetaSchedule writes while tuning
    or, where those are absent, the packed ``.gz`` ones :func:`prune_database` leaves; None if
    the folder has neither."""
    for suffix in ("", ".gz"):
        paths = [os.path.join(work_dir, n + suffix) for n in (WORKLOAD_FILE, RECORD_FILE)]
        if all(os.path.exists(p) for p in paths):
            return paths
    return None


def _unpack_database(work_dir: str) -> None:
    """Turn a packed database (``.gz``, as committed) back into the plain files MetaSchedule
    appends to; the plain files, once written, are the database (the ``.gz`` go)."""
    files = _db_files(work_dir)
    if files is None or not files[0].endswith(".gz"):
        return
    try:
        unpacked = [(path[:-3], _parse_lines(path)[0]) for path in files]
    except (OSError, EOFError) as err:  # a truncated / not-gzip .gz: leave the folder as it is
        raise _corrupt(work_dir, err) from err
    for path, lines in unpacked:
        _atomic_write_lines(path, lines)
    for path in files:
        os.remove(path)


def _is_record(obj, num_workloads: int) -> bool:
    """A record line: [workload index, [trace, run_secs, target, args_info]]."""
    return (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int)
            and 0 <= obj[0] < num_workloads and isinstance(obj[1], list) and len(obj[1]) >= 2)


def _record_secs(obj) -> float | None:
    """Mean run time of a record line, None if the candidate failed to build or run."""
    secs = obj[1][1]
    if not secs or max(secs) >= FAILED_RUN_SECS:
        return None
    return sum(secs) / len(secs)


def _repair_database(work_dir: str) -> int:
    """Drop the lines an interrupted write left unreadable, keeping a backup.

    MetaSchedule appends one JSON line per workload and per record; a run killed mid-write
    leaves a partial last line, and MetaSchedule then refuses to load the whole database.
    Records are independent, so any unreadable record line is dropped; workload lines are
    referenced by position, so only the last one may go.
    Args:
        work_dir: the database folder.
    Returns:
        The number of workloads left.
    Raises:
        InputError: a workload line other than the last is unreadable.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    num_workloads = 0
    for name in (WORKLOAD_FILE, RECORD_FILE):
        path = os.path.join(work_dir, name)
        if not os.path.exists(path):
            continue
        lines, parsed, ends_in_newline = _parse_lines(path)
        if name == WORKLOAD_FILE:
            bad = [i for i, p in enumerate(parsed) if not (isinstance(p, list) and len(p) == 2)]
            if bad and bad != [len(lines) - 1]:
                raise InputError(f"{path}: workload line {bad[0] + 1} of {len(lines)} is corrupt, so the records "
                                 f"after it cannot be matched; restore the folder or delete it and tune again")
            keep = [i for i in range(len(lines)) if i not in bad]
            num_workloads = len(keep)
        else:
            keep = [i for i, p in enumerate(parsed) if _is_record(p, num_workloads)]
        if len(keep) == len(lines) and ends_in_newline:
            continue
        backup = f"{path}.bak-{stamp}"
        shutil.copy2(path, backup)
        # Also when only the final newline is missing: the next append would join two lines.
        _atomic_write_lines(path, [lines[i] for i in keep])
        if len(keep) < len(lines):
            print(f"warning: {path}: dropped {len(lines) - len(keep)} unreadable line(s) (an interrupted "
                  f"run) or record(s) of no workload; the original is kept as {backup}", file=sys.stderr)
    return num_workloads


def _tune_command(work_dir: str) -> str:
    """The tune.py command that (re)creates ``work_dir``, from its config.json where it has one."""
    cfg = {}
    try:
        with open(os.path.join(work_dir, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        pass
    return (f"python tune.py --model {cfg.get('model', 'MODEL')} --batch {cfg.get('batch', 'N')} "
            f"--arch {cfg.get('arch', 'sm_90')} --work-dir {work_dir}")


def _load_database(work_dir: str) -> ms.database.MemoryDatabase:
    """The valid records of a database folder, in memory (nothing is written to the folder).

    Args:
        work_dir: the database folder.
    Returns:
        A MemoryDatabase of the workloads that have a valid record, and those records.
    Raises:
        InputError: the folder is missing, holds no valid record, or cannot be read.
    """
    if not os.path.isdir(work_dir):
        raise InputError(f"tuning log folder {work_dir} does not exist: create it with "
                         f"`{_tune_command(work_dir)}`, or build without --tuning-log")
    paths = _db_files(work_dir)
    if paths is None:
        raise InputError(f"tuning log folder {work_dir} has no MetaSchedule database ({WORKLOAD_FILE}, "
                         f"{RECORD_FILE}, or their .gz): tune into it with `{_tune_command(work_dir)}`")
    try:
        _, workloads, _ = _parse_lines(paths[0])
        _, records, _ = _parse_lines(paths[1])
    except (OSError, EOFError) as err:  # unreadable, or a truncated / not-gzip .gz
        raise _corrupt(work_dir, err) from err
    # A truncated last line (interrupted run) is skipped, as _repair_database would drop it.
    workloads = workloads[:-1] if workloads and workloads[-1] is None else workloads
    records = [r for r in records if _is_record(r, len(workloads)) and _record_secs(r) is not None]
    if not records:
        raise InputError(f"tuning log folder {work_dir} has no successfully measured schedule: "
                         f"tune (again) with `{_tune_command(work_dir)}` on a machine with the GPU")
    _ensure_dp4a_registered()  # parsing a trace resolves its tensorize(..., "dp4a_s8s8s32")
    db = ms.database.MemoryDatabase()
    committed = {}  # workload index -> Workload, committed once (hashing a module is not free)
    try:
        for i, r in records:
            if i not in committed:
                committed[i] = db.commit_workload(ms.database.Workload.from_json(workloads[i]).mod)
            db.commit_tuning_record(ms.database.TuningRecord.from_json(r, committed[i]))
    except Exception as err:  # TVM raises several types for a bad serialized module or trace
        raise _corrupt(work_dir, err) from err
    return db


def _corrupt(work_dir: str, err: Exception) -> InputError:
    return InputError(f"tuning log folder {work_dir} is corrupt ({type(err).__name__}: "
                      f"{(str(err).strip().splitlines() or [''])[0][:200]}): restore it (e.g. `git checkout -- "
                      f"{work_dir}`), or delete it and tune again with `{_tune_command(work_dir)}`")


# ---------------------------------------------------------------- apply / prune


def apply_tuning_database(mod: tvm.IRModule, work_dir: str,
                          target: tvm.target.Target) -> tuple[tvm.IRModule, dict]:
    """Schedule every conv kernel the database covers with its best record.

    Args:
        mod: the int8 Relax module (after ``LiftConstantsToParams``, before
            ``ScheduleInt8Kernels``).
        work_dir: the database folder written by :func:`tune_model`.
        target: the CUDA target being built for.
    Returns:
        (mod, tuned): a copy of ``mod`` whose covered conv PrimFuncs are scheduled and marked
        ``tir.is_scheduled`` (ScheduleInt8Kernels then reports them "tuned" and gives the rest
        their default schedule), and {function name: layer shape} of those.
    Raises:
        InputError: ``work_dir`` is missing, empty or corrupt.
    """
    db = _load_database(work_dir)
    mod = mod.clone()
    tuned, convs, other_archs = {}, 0, set()
    for gv, func in list(mod.functions.items()):
        if not _is_conv(func):
            continue
        convs += 1
        workload = tvm.IRModule({"main": _task_func(func)})
        # has_workload first: a query of an unknown workload would add it to the database.
        if not db.has_workload(workload):
            continue
        try:
            record = db.query_tuning_record(workload, target, "main")
            sch = db.query_schedule(workload, target, "main")  # replays the trace
        except Exception as err:  # a trace that no longer applies to this workload
            raise _corrupt(work_dir, err) from err
        arch = record.target.attrs.get("arch") if record.target is not None else None
        if arch is not None and str(arch) != str(target.attrs.get("arch")):
            other_archs.add(str(arch))
        # Keep the Relax module's attributes (no global_symbol "main": that name is taken).
        scheduled = sch.mod["main"].without_attr("global_symbol")
        mod[gv] = scheduled.with_attr(dict(func.attrs, **{"tir.is_scheduled": True}))
        tuned[gv.name_hint] = _parse_workload(func).describe()
    if convs and not tuned:
        print(f"warning: tuning log {work_dir} covers none of this model's {convs} conv kernels (tuned for "
              f"another model, batch or image size?); they get the default schedule", file=sys.stderr)
    if other_archs:
        print(f"warning: tuning log {work_dir} was tuned for {', '.join(sorted(other_archs))}, building for "
              f"{target.attrs.get('arch')}: the schedules run, but were not measured on this GPU", file=sys.stderr)
    return mod, tuned


def prune_database(work_dir: str) -> tuple[int, int]:
    """Keep only the best valid record per workload and pack the database to commit it.

    VGG16's 9 workloads take 0.8 MB of JSON (each is a whole TIR function) and compress ~13x,
    so the packed form is ``database_workload.json.gz`` and ``database_tuning_record.json.gz``,
    written atomically (temp file + rename) before the plain files are removed.  Building
    (``apply_tuning_database``) reads either form; ``tune_model`` unpacks before tuning on.
    Workloads are kept, records point into them by position.
    Args:
        work_dir: the database folder.
    Returns:
        (records before, records after).
    Raises:
        InputError: the folder has no database.
    """
    if _db_files(work_dir) is None:
        raise InputError(f"no tuning records to prune in {work_dir}: tune into it with `{_tune_command(work_dir)}`")
    _unpack_database(work_dir)
    _repair_database(work_dir)
    lines, parsed, _ = _parse_lines(os.path.join(work_dir, RECORD_FILE))
    best: dict[int, tuple[float, int]] = {}  # workload index -> (mean secs, line)
    for i, obj in enumerate(parsed):
        secs = _record_secs(obj)
        if secs is not None and (obj[0] not in best or secs < best[obj[0]][0]):
            best[obj[0]] = (secs, i)
    keep = sorted(i for _, i in best.values())
    workloads = _parse_lines(os.path.join(work_dir, WORKLOAD_FILE))[0]
    _atomic_write_lines(os.path.join(work_dir, WORKLOAD_FILE + ".gz"), workloads)
    _atomic_write_lines(os.path.join(work_dir, RECORD_FILE + ".gz"), [lines[i] for i in keep])
    for name in (WORKLOAD_FILE, RECORD_FILE):
        os.remove(os.path.join(work_dir, name))
    return len(lines), len(keep)


# ---------------------------------------------------------------- tuning


def _build_function():
    """MetaSchedule's LocalBuilder build function, without its ``import tvm.s_tir.tensor_intrin``.

    The stock ``default_build`` imports every tensor intrinsic in each popen worker (~20 s on a
    16-core GPU host, over a minute on a small box), once per worker.  A candidate reaches the builder already tensorized (the dp4a body
    is inlined as ``__dp4a`` calls), so the worker needs no intrinsic registry.  Defined in a
    closure so cloudpickle ships it by value: the worker needs no tvm_qconv on its path.
    ``with target`` gives nvcc/NVRTC the arch where no GPU can be queried.
    """
    def build(mod, target, _params):
        import tvm

        with target:
            return tvm.tirx.build(mod, target=target)  # a runtime.Module, as the exporter expects
    return build


@derived_object
class PersistentLocalBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder, with one pool of build workers kept for the whole run.

    The stock LocalBuilder starts a fresh PopenPoolExecutor for every batch (against a memory
    leak of long-lived workers), so each round pays the workers' ``import tvm`` again: ~25 s
    per round on the H200 host with 16 workers, as much as the builds themselves.  Here workers
    live across rounds and are recycled after ``max_uses`` builds each, which bounds the leak.
    Builds run ``_build_function`` and export exactly as LocalBuilder's workers do.
    """

    def __init__(self, max_workers: int, timeout_sec: float = BUILD_TIMEOUT_S, max_uses: int = 64):
        from tvm.support.popen_pool import PopenPoolExecutor

        self.timeout_sec = timeout_sec
        self.f_build = _build_function()
        self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec, maximum_process_uses=max_uses)

    def build(self, build_inputs: list) -> list:
        from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func
        from tvm.support.popen_pool import StatusKind

        results = []
        for res in self.pool.map_with_error_catching(
                lambda x: _worker_func(*x), [(self.f_build, None, b.mod, b.target, None) for b in build_inputs]):
            if res.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"build timed out after {self.timeout_sec} s"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed:\n{res.value}"))
        return results

    def shutdown(self) -> None:
        self.pool.shutdown()


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """After each measured batch: one console line (task, trials, best, TOPS, and the model's
    conv time so far) and one JSON line in ``logs/progress.jsonl`` (the convergence curve)."""

    def __init__(self, tasks: list[ConvTask], done: dict, best: dict, total: dict, t0: float, path: str):
        self.tasks, self.done, self.best, self.total, self.t0, self.path = tasks, done, best, total, t0, path
        self.current = [None]  # the task being tuned (tune_tasks gets one task at a time)

    def model_us(self) -> float | None:
        """Sum over tasks of occurrences x best time (us); None while a task has no time."""
        if any(t.name not in self.best for t in self.tasks):
            return None
        return sum(t.weight * self.best[t.name] for t in self.tasks) * 1e6

    def record(self, task: ConvTask, ok: list[float], tried: int) -> None:
        self.done[task.name] += len(ok)
        if ok:
            self.best[task.name] = min(ok + [self.best.get(task.name, math.inf)])
        best, model_us, elapsed = self.best.get(task.name), self.model_us(), time.time() - self.t0
        perf = (f"best {best * 1e6:.1f} us = {task.workload.ops / best / 1e12:.2f} TOPS"
                if best else "no valid run yet")
        model = f", model convs {model_us:.1f} us" if model_us else ""
        print(f"[tune] {task.name} (x{task.weight}): {len(ok)}/{tried} ran, "
              f"{self.done[task.name]}/{self.total[task.name]} valid, {perf}{model}, {elapsed:.0f} s", flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(dict(elapsed_s=round(elapsed, 1), task=task.name, valid=self.done[task.name],
                                    best_us=best and best * 1e6, model_conv_us=model_us)) + "\n")

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        task = self.current[0]
        self.record(task, _valid_secs(builder_results, runner_results), len(runner_results))


def _valid_secs(builder_results, runner_results) -> list[float]:
    """Mean run time (s) of each candidate that built and ran."""
    ok = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for b, r in zip(builder_results, runner_results)
          if b.error_msg is None and r.error_msg is None and r.run_secs]
    return [s for s in ok if s < FAILED_RUN_SECS]


def _int8_module(model, batch: int, image_size: int) -> tvm.IRModule:
    """The int8 Relax module compile_model would build, with 2 photos for calibration."""
    from .build import quantize_module
    from .config import QuantConfig
    from .data import skimage_photos
    from .transform import LiftConstantsToParams

    photos = skimage_photos(image_size)[:CALIB_IMAGES]
    qmod, _, _, _ = quantize_module(model, (batch, 3, image_size, image_size),
                                    QuantConfig(num_calib_images=CALIB_IMAGES), photos, progress=False)
    return LiftConstantsToParams()(qmod)


def _check_config(work_dir: str, settings: dict) -> dict:
    """The folder's config.json (empty if none); refuses a folder of another model's or shape's logs.

    Raises:
        InputError: config.json names another model, batch, arch or image size.
    """
    path = os.path.join(work_dir, CONFIG_FILE)
    cfg = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cfg = json.load(f)
        except ValueError:
            print(f"warning: {path} is unreadable; it will be rewritten", file=sys.stderr)
    for key in ("model", "batch", "arch", "image_size"):
        if key in cfg and cfg[key] != settings[key]:
            raise InputError(f"{work_dir} holds tuning logs for {key}={cfg[key]}, not {settings[key]}: "
                             f"pick another --work-dir")
    return cfg


def _save_config(work_dir: str, settings: dict, previous: dict) -> None:
    """Write config.json: the latest settings, the first run's date and one entry per run."""
    run = {k: settings[k] for k in ("date", "trials_per_task", "only", "space", "tvm_version")}
    cfg = dict(settings, created=previous.get("created", settings["date"]), runs=previous.get("runs", []) + [run])
    fd, tmp = tempfile.mkstemp(dir=work_dir, prefix=".tvm_qconv-")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, os.path.join(work_dir, CONFIG_FILE))


def _measured(db: ms.database.Database, task: ConvTask, limit: int) -> tuple[int, float | None]:
    """(valid records of the task, up to ``limit``; best mean run time in s or None)."""
    mod = tvm.IRModule({"main": task.func})
    if not db.has_workload(mod):
        return 0, None
    top = db.get_top_k(db.commit_workload(mod), limit)  # valid records only, best first
    if not top:
        return 0, None
    return len(top), sum(float(s) for s in top[0].run_secs) / len(top[0].run_secs)


def tune_model(model_name: str, batch: int, *, target: str = "cuda", arch: str = "sm_90",
               trials_per_task: int = 64, work_dir: str | None = None, image_size: int = 224,
               num_trials_per_iter: int = 32, max_workers: int | None = None, seed: int = 0,
               only: list[str] | None = None, runner=None, builder=None, peak_tops: float | None = None,
               model=None, space: str = "template", seed_default: bool = True) -> list[dict]:
    """Tune every distinct int8 conv of a model with MetaSchedule, or continue a previous run.

    A task is finished when ``work_dir`` holds ``trials_per_task`` valid measurements of it.
    A run gives each unfinished task the trials it lacks, so running again with the same
    arguments tunes only what an interrupted run left (finished tasks are skipped), and a
    larger ``trials_per_task`` goes on from the best schedules found so far.  MetaSchedule
    counts candidates that failed to build or run as trials, so a rerun also tops up a task
    by its failures.  Tasks share one XGBoost cost model and are tuned one at a time, largest
    (occurrences x ops) first (``_tune`` says why).  A task with no record yet first measures
    the default schedule (``seed_default``): it is a point of the ``template`` space, so the
    search starts from it, and the database's best is never slower than the default.

    Args:
        model_name: torchvision name (``vgg16``); ``model`` overrides the torch module itself.
        batch, image_size: the input shape (batch, 3, image_size, image_size) to tune for;
            build with the same ones.
        target, arch: only ``cuda`` (the llvm build uses its default schedule); ``sm_90``...
        trials_per_task: valid measurements per task, those in the database included.
        work_dir: the database folder (default ``tuning_logs/<model>-b<batch>-<arch>``).
        num_trials_per_iter: candidates built and measured per batch.
        max_workers: parallel builds (default: all CPU cores).
        seed: seeds the search (mixed with the database size, so a resumed run does not
            replay the first run's samples).
        only: task names (as printed) to tune; default all.
        runner, builder: MetaSchedule Runner / Builder replacing the local ones (tests, RPC).
        peak_tops: the GPU's dp4a peak, to print each task's % of it.
        space: the search space, ``template`` or ``mlt``
            (``schedules/conv2d_nchw4c_dp4a_space.py``).
        seed_default: measure the default schedule of each new task first.
    Returns:
        One row per task (see :func:`format_table`), also printed: task, shape, occurrences,
        trials, best_us, tops, and pct_peak when ``peak_tops`` is given.
    Raises:
        InputError: bad arguments, an unknown task name, or a work_dir holding other logs.
    """
    if space not in SPACES:
        raise InputError(f"unknown search space {space!r}; choose one of {', '.join(SPACES)}")
    if target != "cuda":
        raise InputError(f"tuning supports --target cuda only, got {target!r} (llvm builds use the default "
                         "CPU schedule)")
    for label, value in (("trials per task", trials_per_task), ("trials per iteration", num_trials_per_iter),
                         ("batch", batch), ("workers", max_workers), ("image size", image_size)):
        if value is not None and value < 1:
            raise InputError(f"{label} must be >= 1, got {value}")
    from .build import make_target
    from .frontend import load_model

    tgt = make_target("cuda", arch)
    model = model if model is not None else load_model(model_name)
    work_dir = work_dir or default_work_dir(model_name, batch, arch)
    settings = dict(model=model_name, batch=batch, target=target, arch=arch, image_size=image_size,
                    trials_per_task=trials_per_task, only=only, space=space, tvm_version=tvm.__version__,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"))
    # Before quantizing (up to a minute): a folder of another model's logs is refused at once.
    previous = _check_config(work_dir, settings)
    t0 = time.time()
    tasks = extract_conv_tasks(_int8_module(model, batch, image_size))
    if not tasks:
        raise InputError(f"{model_name} has no int8 conv to tune")
    if only:
        names = [t.name for t in tasks]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise InputError(f"unknown task(s) {', '.join(unknown)}: {model_name} at batch {batch}, "
                             f"{image_size}x{image_size} has {', '.join(names)}")
        tasks = [t for t in tasks if t.name in only]
    print(f"[tune] {len(tasks)} conv task(s) of {model_name} (batch {batch}, {image_size}x{image_size}) "
          f"in {time.time() - t0:.0f} s; database {work_dir}", flush=True)
    os.makedirs(work_dir, exist_ok=True)  # JSONDatabase does not create it
    _save_config(work_dir, settings, previous)
    _unpack_database(work_dir)
    _repair_database(work_dir)
    _ensure_dp4a_registered()  # loading the records parses traces that name the intrinsic
    db = ms.database.JSONDatabase(work_dir=work_dir)
    measured = {t.name: _measured(db, t, trials_per_task) for t in tasks}
    todo = [(t, trials_per_task - measured[t.name][0]) for t in tasks if measured[t.name][0] < trials_per_task]
    for t in tasks:
        print(f"[tune]   {t.name:<28} {t.workload.describe():<30} x{t.weight}  "
              f"{measured[t.name][0]}/{trials_per_task} valid trials in the database")
    if todo:
        print(f"[tune] {len(todo)} task(s) to tune, {sum(n for _, n in todo)} trials "
              f"({len(tasks) - len(todo)} finished already)", flush=True)
        own_builder = builder is None
        builder = builder or PersistentLocalBuilder(max_workers=max_workers or os.cpu_count())
        runner = runner or ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False))
        try:
            _tune(tasks, todo, db, tgt, work_dir, num_trials_per_iter, seed, measured, builder, runner, space,
                  seed_default)
        finally:
            if own_builder:
                builder.shutdown()
    else:
        print(f"[tune] every task has {trials_per_task} valid trials already: nothing to tune", flush=True)
    rows = []
    for t in tasks:
        trials, secs = _measured(db, t, 1 << 30)
        row = dict(task=t.name, shape=t.workload.describe(), occurrences=t.weight, trials=trials,
                   best_us=secs * 1e6 if secs else None, tops=t.workload.ops / secs / 1e12 if secs else None)
        if peak_tops:
            row["pct_peak"] = 100.0 * row["tops"] / peak_tops if secs else None
        rows.append(row)
    print(format_table(rows))
    return rows


def _seed_with_default(todo: list, db, tgt, builder, runner, progress: _Progress) -> None:
    """Measure the default dp4a schedule of each task without a record, and commit it.

    The default is the ``template`` space with the heuristic decisions (``default_tiles``), so
    its trace is a valid start for the search's mutations.  All builds go in one batch.
    """
    new = [t for t, _ in todo if progress.done[t.name] == 0]
    if not new:
        return
    schs = []
    for task in new:
        ctx = ms.TuneContext(mod=task.func, target=tgt, space_generator=space_generator("template"), task_name="seed")
        sch = tvm.s_tir.Schedule(ctx.mod)
        apply_dp4a_schedule(sch, default_tiles(task.func, tgt))
        if not all(p.apply(sch) for p in ctx.space_generator.postprocs):
            print(f"[tune] {task.name}: the default schedule fails the GPU checks; not seeded", file=sys.stderr)
            sch = None
        schs.append(sch)
    pairs = [(t, sch) for t, sch in zip(new, schs) if sch is not None]
    built = builder.build([ms.builder.BuilderInput(sch.mod, tgt) for _, sch in pairs])
    args = {t.name: ms.arg_info.ArgInfo.from_prim_func(t.func) for t, _ in pairs}
    futures = [runner.run([ms.runner.RunnerInput(b.artifact_path, "cuda", args[t.name])])[0]
               if b.error_msg is None else None for (t, _), b in zip(pairs, built)]
    for (task, sch), b, fut in zip(pairs, built, futures):
        res = fut.result() if fut is not None else None
        secs = _valid_secs([b], [res]) if res is not None else []
        if not secs:
            err = b.error_msg or (res.error_msg if res is not None else "")
            print(f"[tune] {task.name}: the default schedule did not run: {str(err)[:300]}", file=sys.stderr)
            continue
        workload = db.commit_workload(tvm.IRModule({"main": task.func}))
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, res.run_secs, tgt, args[task.name]))
        progress.record(task, secs, 1)


def _tune(tasks: list, todo: list, db, tgt, work_dir: str, num_trials_per_iter: int, seed: int, measured: dict,
          builder, runner, space: str, seed_default: bool) -> None:
    """Run ms.tune_tasks over the unfinished tasks, one call per task, largest (occurrences x ops)
    first, so an interrupted run has tuned the layers that matter most; the calls share the
    database, builder, runner and cost model.
    """
    # MetaSchedule gives its console handler this logger's level (DEBUG once configured): keep
    # the console to warnings and _Progress's lines; logs/ gets everything regardless.
    ms.logging.get_logger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    loggers = dict(zip([t.name for t, _ in todo],
                       ms.logging.get_loggers_from_work_dir(work_dir, [t.name for t, _ in todo])))
    seeds = ms.utils.fork_seed(seed + len(db), len(todo))
    contexts = {t.name: ms.TuneContext(mod=t.func, target=tgt, space_generator=space_generator(space),
                                       search_strategy=ms.search_strategy.EvolutionarySearch(population_size=POPULATION),
                                       task_name=t.name, rand_state=s, logger=loggers[t.name])
                for (t, _), s in zip(todo, seeds)}
    cost_model = ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True)
    done = {t.name: measured[t.name][0] for t in tasks}
    best = {t.name: measured[t.name][1] for t in tasks if measured[t.name][1]}
    total = {t.name: done[t.name] + n for t, n in todo}
    total.update({t.name: done[t.name] for t in tasks if t.name not in total})
    progress = _Progress(tasks, done, best, total, time.time(), os.path.join(work_dir, "logs", "progress.jsonl"))
    os.makedirs(os.path.dirname(progress.path), exist_ok=True)
    if seed_default:
        _seed_with_default(todo, db, tgt, builder, runner, progress)
    # One tune_tasks call per task (sharing the database and the cost model).  On the H200, a
    # single call over VGG16's 9 tasks measured for 9 minutes and committed no record, while the
    # same tasks tuned one per call gave 8/8 and 16/16 valid runs (2026-11-22); the cause is not
    # found yet, so the gradient scheduler's cross-task budget split is given up for now.
    for task, _ in sorted(todo, key=lambda tn: -tn[0].weight * tn[0].workload.ops):
        remaining = total[task.name] - done[task.name]  # the seed counts as a trial
        if remaining <= 0:
            continue
        progress.current[0] = task
        ms.tune_tasks(tasks=[contexts[task.name]], task_weights=[float(task.weight)],
                      work_dir=work_dir, max_trials_global=remaining, max_trials_per_task=remaining,
                      num_trials_per_iter=min(num_trials_per_iter, remaining), builder=builder, runner=runner,
                      database=db, cost_model=cost_model,
                      measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [progress],
                      task_scheduler=ms.task_scheduler.GradientBased(seed=seed))


def format_table(rows: list[dict]) -> str:
    """The per-task table: task, layer shape, occurrences (x), trials, best us, TOPS, % of peak;
    the last line sums occurrences x best us (the model's conv time) where every task has one."""
    has_peak = any("pct_peak" in r for r in rows)
    wt = max([len("all convs (x * best)")] + [len(r["task"]) for r in rows])
    ws = max([len("shape")] + [len(r["shape"]) for r in rows])
    head = f"{'task':<{wt}} {'shape':<{ws}} {'x':>2} {'trials':>6} {'best us':>9} {'TOPS':>7}" + \
        (f" {'% peak':>6}" if has_peak else "")
    out = [head, "-" * len(head)]
    for r in rows:
        def num(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        line = (f"{r['task']:<{wt}} {r['shape']:<{ws}} {r['occurrences']:>2} {r['trials']:>6} "
                f"{num('best_us', '9.1f'):>9} {num('tops', '7.2f'):>7}")
        out.append(line + (f" {num('pct_peak', '6.1f'):>6}" if has_peak else ""))
    if rows and all(r["best_us"] is not None for r in rows):
        total = sum(r["occurrences"] * r["best_us"] for r in rows)
        out.append(f"{'all convs (x * best)':<{wt}} {'':<{ws}} {sum(r['occurrences'] for r in rows):>2} "
                   f"{'':>6} {total:>9.1f}")
    return "\n".join(out)
