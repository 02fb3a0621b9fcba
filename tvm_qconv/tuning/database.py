"""The tuning database on disk: MetaSchedule's JSON files, read, repaired, packed and pruned here.

The database is MetaSchedule's: ``database_workload.json`` (one line per workload) and
``database_tuning_record.json`` (one line per measured candidate: workload index, trace, run
times, target).  Both are appended to a line at a time; a run killed mid-write can leave a
truncated last line, which MetaSchedule cannot load: tuning and pruning repair the files first
(:func:`repair_database`, keeping a backup), building skips such a line in memory.  An
interrupted run loses at most its in-flight trials.  ``prune_database`` keeps the best record
per workload and packs both files to ``.xz`` for committing (TIR functions in JSON: 5.8 MB of
ResNet-50 workloads pack to 63 KB, against 431 KB as ``.gz``); every reader takes the plain, ``.xz``
and ``.gz`` (packed before 2026-11-28) forms.

Workloads are matched by the canonical function (``tasks.task_func``); a database written
before the project's own attributes were left out of it is canonicalized on load, and
rewritten so before tuning resumes (:func:`canonicalize_database`).
"""
from __future__ import annotations

import gzip
import json
import lzma
import os
import shutil
import sys
import time
import zlib

import tvm
import tvm_ffi.structural
from tvm.s_tir import meta_schedule as ms

from .. import registry
from ..errors import InputError
from ..fileio import atomic_path, write_json
from .tasks import task_func

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
CONFIG_FILE = "config.json"
PACKED = (".xz", ".gz")   # the packed forms, the one prune_database writes first
# what a truncated or mislabelled packed file raises on reading, besides OSError / EOFError
UNREADABLE = (OSError, EOFError, zlib.error, lzma.LZMAError)
# MetaSchedule records a failed build or run with this run time (s): not a valid measurement.
FAILED_RUN_SECS = 1e10


def prepare_implementations() -> None:
    """Register what the traces of every tunable implementation name (tensor intrinsics)."""
    for impl in registry.tunable():
        impl.prepare()


def canonical_workload(line) -> tvm.IRModule:
    """The module of a workload line (parsed JSON), its function in canonical form."""
    mod = ms.database.Workload.from_json(line).mod
    return tvm.IRModule({"main": task_func(mod["main"])})


def _atomic_write_lines(path: str, lines: list[bytes]) -> None:
    """Replace ``path`` by ``lines`` (newline-terminated), atomically; compressed when ``path``
    ends in ``.xz`` or ``.gz``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        if path.endswith(".xz"):
            f = lzma.LZMAFile(raw, "wb", preset=9 | lzma.PRESET_EXTREME)
        else:   # mtime=0: the same records give the same bytes (no diff in git from a re-prune)
            f = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if path.endswith(".gz") else raw
        f.writelines(line + b"\n" for line in lines)
        f.close()


def _open(path: str):
    """``path`` opened for reading bytes, decompressed by its suffix."""
    return lzma.open(path, "rb") if path.endswith(".xz") else gzip.open(path, "rb") if path.endswith(".gz") \
        else open(path, "rb")


def parse_lines(path: str) -> tuple[list[bytes], list, bool]:
    """(raw lines, parsed JSON or None per line, whether the file ends in a newline)."""
    with _open(path) as f:
        raw = f.read()
    lines = [line for line in raw.split(b"\n") if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            parsed.append(None)
    return lines, parsed, raw.endswith(b"\n") or not raw


def db_files(work_dir: str) -> list[str] | None:
    """The database's (workload, record) files: the plain ones MetaSchedule writes while tuning
    or, where those are absent, the packed ones :func:`prune_database` leaves (``.xz``; ``.gz``
    before 2026-11-28); None if the folder has neither."""
    for suffix in ("", *PACKED):
        paths = [os.path.join(work_dir, n + suffix) for n in (WORKLOAD_FILE, RECORD_FILE)]
        if all(os.path.exists(p) for p in paths):
            return paths
    return None


def unpack_database(work_dir: str) -> None:
    """Turn a packed database (``.xz`` or ``.gz``, as committed) back into the plain files
    MetaSchedule appends to; the plain files, once written, are the database (the packed go)."""
    files = db_files(work_dir)
    if files is None or not files[0].endswith(PACKED):
        return
    try:
        unpacked = [(os.path.splitext(path)[0], parse_lines(path)[0]) for path in files]
    except UNREADABLE as err:  # a truncated / mislabelled packed file: leave the folder as it is
        raise corrupt(work_dir, err) from err
    for path, lines in unpacked:
        _atomic_write_lines(path, lines)
    for path in files:
        os.remove(path)


def is_record(obj, num_workloads: int) -> bool:
    """A record line: [workload index, [trace, run_secs, target, args_info]]."""
    return (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int)
            and 0 <= obj[0] < num_workloads and isinstance(obj[1], list) and len(obj[1]) >= 2)


def mean_secs(run_secs) -> float:
    """The mean of a measurement's run times (MetaSchedule's ``run_secs``: FloatImms or floats)."""
    return sum(float(s) for s in run_secs) / len(run_secs)


def record_secs(obj) -> float | None:
    """Mean run time of a record line, None if the candidate failed to build or run."""
    secs = obj[1][1]
    if not secs or max(secs) >= FAILED_RUN_SECS:
        return None
    return mean_secs(secs)


def repair_database(work_dir: str) -> int:
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
        lines, parsed, ends_in_newline = parse_lines(path)
        if name == WORKLOAD_FILE:
            bad = [i for i, p in enumerate(parsed) if not (isinstance(p, list) and len(p) == 2)]
            if bad and bad != [len(lines) - 1]:
                raise InputError(f"{path}: workload line {bad[0] + 1} of {len(lines)} is corrupt, so the records "
                                 f"after it cannot be matched; restore the folder or delete it and tune again")
            keep = [i for i in range(len(lines)) if i not in bad]
            num_workloads = len(keep)
        else:
            keep = [i for i, p in enumerate(parsed) if is_record(p, num_workloads)]
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


def tune_command(work_dir: str) -> str:
    """The tune.py command that (re)creates ``work_dir``, from its config.json where it has one."""
    cfg = {}
    try:
        with open(os.path.join(work_dir, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        pass
    extra = ""
    if cfg.get("image_size", 224) != 224:
        extra += f" --image-size {cfg['image_size']}"
    for family in cfg.get("families") or []:
        extra += f" --family {family}"
    if cfg.get("space"):
        extra += f" --space {cfg['space']}"
    where = "--target llvm" if cfg.get("target") == "llvm" else f"--arch {cfg.get('arch', 'sm_90')}"
    return (f"python tune.py --model {cfg.get('model', 'MODEL')} --batch {cfg.get('batch', 'N')} "
            f"{where}{extra} --work-dir {work_dir}")


def database_target(work_dir: str) -> str:
    """The target kind (``cuda`` or ``llvm``) a database folder was tuned for, refusing a path
    that is not a database this project wrote.

    The kind comes from its config.json (``target``; a config from before CPU tuning names only
    an ``arch``: ``cuda``), else from its first tuning record (MetaSchedule writes each record's
    target).  The records themselves are read when the build applies them (:func:`load_database`).

    Args:
        work_dir: the ``--tuning-log`` folder.

    Returns:
        ``cuda`` or ``llvm``.

    Raises:
        InputError: the path does not exist, is a file, has no database files (plain or packed),
            or names no target in its config.json or records.
    """
    def refuse(what: str) -> InputError:
        return InputError(f"--tuning-log {work_dir} is not a tuning database ({what}): give a folder written by "
                          f"tune.py (tuning_logs/<model>-b<batch>-<arch>)")

    if not os.path.exists(work_dir):
        raise refuse("no such folder")
    if not os.path.isdir(work_dir):
        raise refuse("a file, not a folder")
    paths = db_files(work_dir)
    if paths is None:
        have = sorted(os.listdir(work_dir))
        listed = ", ".join(have[:4]) + (f", ... {len(have) - 4} more" if len(have) > 4 else "")
        raise refuse(f"no {WORKLOAD_FILE} and {RECORD_FILE}, plain, .xz or .gz; it holds {listed or 'nothing'}")
    try:
        with open(os.path.join(work_dir, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = None
    if isinstance(cfg, dict):
        if cfg.get("target") in ("cuda", "llvm"):
            return cfg["target"]
        if "target" not in cfg and str(cfg.get("arch") or "").startswith("sm_"):
            return "cuda"  # written before CPU tuning: only CUDA was tuned
    try:
        kind = _first_record_target(paths[1])
    except UNREADABLE as err:  # unreadable, or a truncated / mislabelled packed file
        raise corrupt(work_dir, err) from err
    if kind in ("cuda", "llvm"):
        return kind
    raise refuse(f"no cuda or llvm target in its {CONFIG_FILE} or in its first tuning record")


def _first_record_target(path: str) -> str | None:
    """The target kind of a record file's first readable record (None: none in its first 100
    lines).  Raises OSError / EOFError where the file cannot be read."""
    with _open(path) as f:
        for _, line in zip(range(100), f):  # past a few unreadable lines, not the whole file
            try:
                target = json.loads(line)[1][2]
            except (ValueError, TypeError, IndexError, KeyError):
                continue
            if isinstance(target, dict) and isinstance(target.get("kind"), str):
                return target["kind"]
            if isinstance(target, str) and target.split():  # "cuda -arch=sm_90"
                return target.split()[0]
    return None


def load_database(work_dir: str, ignore_stale: bool = False) -> ms.database.MemoryDatabase:
    """The valid records of a database folder, in memory (nothing is written to the folder).

    Args:
        work_dir: the database folder.
        ignore_stale: leave out, with a warning, records whose schedule no longer applies to
            their kernel (tuned with an older version of its template), instead of refusing.
    Returns:
        A MemoryDatabase of the workloads that have a valid record, and those records.
    Raises:
        InputError: the folder is missing, holds no valid record, cannot be read, or (without
            ``ignore_stale``) holds a schedule of an older template.
    """
    if not os.path.isdir(work_dir):
        raise InputError(f"tuning log folder {work_dir} does not exist: create it with "
                         f"`{tune_command(work_dir)}`, or build without --tuning-log")
    paths = db_files(work_dir)
    if paths is None:
        raise InputError(f"tuning log folder {work_dir} has no MetaSchedule database ({WORKLOAD_FILE}, "
                         f"{RECORD_FILE}, or their .xz / .gz): tune into it with `{tune_command(work_dir)}`")
    try:
        _, workloads, _ = parse_lines(paths[0])
        _, records, _ = parse_lines(paths[1])
    except UNREADABLE as err:  # unreadable, or a truncated / mislabelled packed file
        raise corrupt(work_dir, err) from err
    # A truncated last line (interrupted run) is skipped, as repair_database would drop it.
    workloads = workloads[:-1] if workloads and workloads[-1] is None else workloads
    records = [r for r in records if is_record(r, len(workloads)) and record_secs(r) is not None]
    if not records:
        raise InputError(f"tuning log folder {work_dir} has no successfully measured schedule: "
                         f"tune (again) with `{tune_command(work_dir)}` on a machine with the GPU")
    prepare_implementations()  # parsing a trace resolves the tensor intrinsics it names
    db = ms.database.MemoryDatabase()
    committed = {}  # workload index -> Workload, committed once (hashing a module is not free)
    stale = 0
    for i, r in records:
        try:
            if i not in committed:
                committed[i] = db.commit_workload(canonical_workload(workloads[i]))
        except Exception as err:  # TVM raises several types for a bad serialized module
            raise corrupt(work_dir, err) from err
        try:
            record = ms.database.TuningRecord.from_json(r, committed[i])  # replays the trace on the workload
        except tvm.s_tir.schedule.ScheduleError as err:  # readable, but made by an older template
            if not ignore_stale:
                raise InputError(
                    f"tuning log {work_dir} holds schedules of an older kernel template: they no longer apply to "
                    f"their kernels ({(str(err).strip().splitlines() or [''])[-1][:120]}): re-tune with "
                    f"`{tune_command(work_dir)}`, or build with --ignore-stale to give those kernels their default "
                    f"schedule") from None
            stale += 1
            continue
        except Exception as err:  # a trace that cannot be parsed at all
            raise corrupt(work_dir, err) from err
        db.commit_tuning_record(record)
    if stale:
        print(f"warning: tuning log {work_dir}: {stale} record(s) of an older kernel template left out (--ignore-stale); "
              f"their kernels get the default schedule (re-tune with `{tune_command(work_dir)}`)", file=sys.stderr)
    return db


def corrupt(work_dir: str, err: Exception) -> InputError:
    return InputError(f"tuning log folder {work_dir} is corrupt ({type(err).__name__}: "
                      f"{(str(err).strip().splitlines() or [''])[0][:200]}): restore it (e.g. `git checkout -- "
                      f"{work_dir}`), or delete it and tune again with `{tune_command(work_dir)}`")


def prune_database(work_dir: str) -> tuple[int, int]:
    """Keep only the best valid record per workload and pack the database to commit it.

    Workloads are whole TIR functions in JSON (ResNet-50's 66: 5.8 MB) and compress ~90x with xz
    at its highest preset (13x with gzip, the packed form before 2026-11-28), so the packed form
    is ``database_workload.json.xz`` and ``database_tuning_record.json.xz``, written atomically
    (temp file + rename) before the plain files are removed.  Building
    (``apply.apply_tuning_database``) reads every form; tuning unpacks before tuning on.
    Workloads are kept, records point into them by position.
    Args:
        work_dir: the database folder.
    Returns:
        (records before, records after).
    Raises:
        InputError: the folder has no database.
    """
    if db_files(work_dir) is None:
        raise InputError(f"no tuning records to prune in {work_dir}: tune into it with `{tune_command(work_dir)}`")
    unpack_database(work_dir)
    repair_database(work_dir)
    lines, parsed, _ = parse_lines(os.path.join(work_dir, RECORD_FILE))
    best: dict[int, tuple[float, int]] = {}  # workload index -> (mean secs, line)
    for i, obj in enumerate(parsed):
        secs = record_secs(obj)
        if secs is not None and (obj[0] not in best or secs < best[obj[0]][0]):
            best[obj[0]] = (secs, i)
    keep = sorted(i for _, i in best.values())
    workloads, workload_objs, _ = parse_lines(os.path.join(work_dir, WORKLOAD_FILE))
    _count_pruned_trials(work_dir, parsed, workload_objs)
    _atomic_write_lines(os.path.join(work_dir, WORKLOAD_FILE + PACKED[0]), workloads)
    _atomic_write_lines(os.path.join(work_dir, RECORD_FILE + PACKED[0]), [lines[i] for i in keep])
    for name in (WORKLOAD_FILE, RECORD_FILE):
        os.remove(os.path.join(work_dir, name))
    return len(lines), len(keep)


def workload_key(mod: tvm.IRModule) -> str:
    """A workload's key in ``config.json``'s ``pruned_trials``: its structural hash (the one
    MetaSchedule's database matches on; the hashes written in older workload files differ)."""
    return str(tvm_ffi.structural.structural_hash(mod))


def _count_pruned_trials(work_dir: str, records: list, workloads: list) -> None:
    """Add the valid records a prune drops, per workload, to ``config.json``'s ``pruned_trials``
    (and the failed ones to ``pruned_failed``):
    a resumed run counts them as trials done (``driver._measured``), so re-running a pruned
    tuning command does not start over.  A folder without config.json (copied in) keeps none."""
    path = os.path.join(work_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        cfg = json.load(f)
    valid: dict[int, int] = {}
    failed: dict[int, int] = {}
    for obj in records:
        if obj is None:
            continue
        counts = valid if record_secs(obj) is not None else failed
        counts[obj[0]] = counts.get(obj[0], 0) + 1
    pruned = cfg.get("pruned_trials", {})
    for index, n in valid.items():
        key = workload_key(ms.database.Workload.from_json(workloads[index]).mod)
        pruned[key] = pruned.get(key, 0) + n - 1  # all but the one kept
    cfg["pruned_trials"] = pruned
    # failed records, all dropped: a task measured point by point counts them as points tried
    pruned_failed = cfg.get("pruned_failed", {})
    for index, n in failed.items():
        key = workload_key(ms.database.Workload.from_json(workloads[index]).mod)
        pruned_failed[key] = pruned_failed.get(key, 0) + n
    cfg["pruned_failed"] = pruned_failed
    write_json(path, cfg, indent=1)


def canonicalize_database(work_dir: str) -> None:
    """Rewrite the (plain) workload file with every function in canonical form, so that a
    database from before the canonical form matches the tasks of this version.  Records point
    at workloads by position, so they are kept as they are."""
    path = os.path.join(work_dir, WORKLOAD_FILE)
    if not os.path.exists(path):
        return
    lines, parsed, _ = parse_lines(path)
    new = []
    for line, obj in zip(lines, parsed):
        if obj is None:  # repair_database has dropped it already, or it is the last line
            new.append(line)
            continue
        try:
            new.append(json.dumps(ms.database.Workload(canonical_workload(obj)).as_json()).encode())
        except Exception as err:  # TVM raises several types for a bad serialized module
            raise corrupt(work_dir, err) from err
    if new != lines:
        _atomic_write_lines(path, new)
