"""tune_model: MetaSchedule tuning of a model's int8 kernels, resumable.

    tune_model("vgg16", 1)    every distinct tunable kernel of VGG16 at batch 1, each on its
                              implementation's search space, into tuning_logs/vgg16-b1-sm_90/:
                              MetaSchedule's JSON database, config.json and logs/; run it again
                              to continue where it stopped
    compile_model(..., options=BuildOptions(target="cuda", arch="sm_90",
                                            tuning_log="tuning_logs/vgg16-b1-sm_90"))
                              -> apply.apply_tuning_database: each kernel the database covers
                              gets its best schedule, the others their default
    prune_database(work_dir)  keeps the best record per workload (small enough to commit)

Schedules depend on shapes only, so the module tuned is built with random weights and 2
calibration photos.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

import tvm
from tvm.s_tir import meta_schedule as ms

from .. import interrupts, registry
from ..config import QuantConfig
from ..data import skimage_photos
from ..errors import InputError
from ..fileio import check_output_folder, write_json
from ..frontend import load_model
from ..quantize import quantize_module
from ..ranges import Calibrate
from ..target import TargetInfo, arch_runs_on, device_arch, make_target
from ..transform import LiftConstantsToParams
from .builder import PersistentLocalBuilder
from .database import (CONFIG_FILE, FAILED_RUN_SECS, canonicalize_database, db_files, mean_secs, prepare_implementations, repair_database,
                       unpack_database, workload_key)
from .progress import Progress, format_table, model_conv_us, valid_secs
from .tasks import KernelTask, extract_tasks

CALIB_IMAGES = 2  # tuning depends on shapes only; calibration just has to run
# Evolutionary-search population (MetaSchedule default 512): the template space is small and
# mostly valid; on the 2-core CPU box 128 cut one search round from 60-90 s to ~20 s.
POPULATION = 128
# One RPC measurement (session, upload, link of the candidate on the server, 3 runs): seconds
# normally; a server that stops answering fails the candidate after this, not the run.
RPC_SESSION_TIMEOUT_S = 60


def default_work_dir(model_name: str, batch: int, arch: str) -> str:
    return os.path.join("tuning_logs", f"{model_name}-b{batch}-{arch}")


def int8_module(model, batch: int, image_size: int, target: tvm.target.Target) -> tvm.IRModule:
    """The int8 Relax module compile_model would build for ``target``, calibrated on 2 photos."""
    photos = skimage_photos(image_size)[:CALIB_IMAGES]
    q = quantize_module(model, (batch, 3, image_size, image_size), TargetInfo.from_target(target),
                        config=QuantConfig(num_calib_images=CALIB_IMAGES), ranges=Calibrate(photos), progress=False)
    return LiftConstantsToParams()(q.mod)


def check_config(work_dir: str, settings: dict) -> dict:
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


def _trial_limit(task: KernelTask, trials_per_task: int) -> int:
    """Valid trials that finish ``task``: ``trials_per_task``, or every point of a space the
    tuner measures point by point (``search = "exhaustive"``: a handful, so ``--trials 1``
    measures each sampled family's default and every wgmma tile)."""
    if task.impl.search == "exhaustive":
        return task.impl.space_size(task.workload)
    return trials_per_task


def _runner_worker_init() -> None:
    """The local runner's worker process: register the host functions kernels call at launch
    (the wgmma family's TMA im2col descriptor); the RPC server does the same."""
    from ..schedules.wgmma import tensormap  # noqa: F401


def _alloc_layer_args(device, args_info, alloc_repeat):
    """The local runner's arguments: MetaSchedule's random fill, except the requantize constants
    of a fused layer (``(data, weight, bias, mult, shift, out)``: three int32 vectors of one
    shape), which get values a calibrated model has (biases of a few thousand, multipliers of
    1e-4 to 1e-2 as mult / shift).  Random int32 shifts would run kernels down paths a model
    never takes: the wgmma and stem kernels check the constants and fall back to their 64-bit
    requantize, which is measured slower."""
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument
    return _fill_requantize(default_alloc_argument(device, args_info, alloc_repeat), args_info)


def _alloc_layer_args_rpc(session, device, args_info, alloc_repeat):
    """:func:`_alloc_layer_args` for MetaSchedule's RPCRunner (the tensors live on the server)."""
    from tvm.s_tir.meta_schedule.runner.rpc_runner import default_alloc_argument
    return _fill_requantize(default_alloc_argument(session, device, args_info, alloc_repeat), args_info)


def _fill_requantize(repeated, args_info):
    import numpy as np

    from ..schedules.requantize import quantize_multiplier
    specs = [tuple(info[1:]) if isinstance(info, (list, tuple)) else None for info in args_info]
    if len(specs) != 6 or not all(spec and spec[0] == "int32" for spec in specs[2:5]) \
            or len({tuple(spec[1]) for spec in specs[2:5]}) != 1:
        return repeated
    rng = np.random.default_rng(0)
    shape = tuple(specs[2][1])
    mult, shift = quantize_multiplier(rng.uniform(1e-4, 1e-2, shape))
    for args in repeated:
        args[2].copyfrom(rng.integers(-4096, 4096, shape).astype(np.int32))
        args[3].copyfrom(mult.astype(np.int32))
        args[4].copyfrom(shift.astype(np.int32))
    return repeated


def save_config(work_dir: str, settings: dict, previous: dict) -> None:
    """Write config.json: the latest settings, the first run's date and one entry per run."""
    run = {k: settings[k] for k in ("date", "trials_per_task", "only", "space", "families", "tvm_version")}
    cfg = dict(settings, created=previous.get("created", settings["date"]), runs=previous.get("runs", []) + [run],
               pruned_trials=previous.get("pruned_trials", {}), pruned_failed=previous.get("pruned_failed", {}))
    write_json(os.path.join(work_dir, CONFIG_FILE), cfg, indent=1)


def _measured(db: ms.database.Database, task: KernelTask, limit: int, pruned: dict,
              pruned_failed: dict | None = None) -> tuple[int, float | None]:
    """(trials of the task, up to ``limit``; best mean run time in s or None).  Trials are its
    valid records and those a prune dropped (``pruned``: config.json's ``pruned_trials``); for a
    task measured point by point (``search = "exhaustive"``) every point tried counts, failed
    ones included (``pruned_failed``: the failed records a prune dropped), so a point that does
    not build or run is not retried forever."""
    mod = tvm.IRModule({"main": task.func})
    if not db.has_workload(mod):
        return 0, None
    workload = db.commit_workload(mod)
    top = db.get_top_k(workload, limit)  # valid records only, best first
    key = workload_key(mod)
    if task.impl.search == "exhaustive":
        tried = sum(1 for r in db.get_all_tuning_records() if r.workload.same_as(workload))
        done = min(limit, tried + pruned.get(key, 0) + (pruned_failed or {}).get(key, 0))
        return done, mean_secs(top[0].run_secs) if top else None
    if not top:
        return 0, None
    return min(limit, len(top) + pruned.get(key, 0)), mean_secs(top[0].run_secs)


def tune_model(model_name: str, batch: int, *, target: str = "cuda", arch: str = "sm_90",
               trials_per_task: int = 64, work_dir: str | None = None, image_size: int = 224,
               num_trials_per_iter: int = 32, max_workers: int | None = None, seed: int = 0,
               only: list[str] | None = None, runner=None, builder=None, peaks: dict[str, float] | None = None,
               model=None, space: str | None = None, seed_default: bool = True,
               families: list[str] | None = None, remote=None) -> list[dict]:
    """Tune every distinct tunable int8 kernel of a model with MetaSchedule, or continue a previous run.

    A task is finished when ``work_dir`` holds ``trials_per_task`` valid measurements of it.
    A run gives each unfinished task the trials it lacks, so running again with the same
    arguments tunes only what an interrupted run left (finished tasks are skipped), and a
    larger ``trials_per_task`` goes on from the best schedules found so far.  MetaSchedule
    counts candidates that failed to build or run as trials, so a rerun also tops up a task
    by its failures.  Tasks share one XGBoost cost model and are tuned one at a time, largest
    (occurrences x ops) first (``_tune`` says why).  A task with no record yet first measures
    its implementation's default schedule (``seed_default``): it is a point of the
    implementation's first space, so the search starts from it, and the database's best is never
    slower than the default.

    Args:
        model_name: torchvision name (``vgg16``); ``model`` overrides the torch module itself.
        batch, image_size: the input shape (batch, 3, image_size, image_size) to tune for;
            build with the same ones.
        target, arch: ``cuda`` with its arch (``sm_90``...), or ``llvm`` (the CPU's conv, tuned
            on this CPU, or on the remote one of ``remote``; arch is ignored).
        trials_per_task: valid measurements per task, those in the database included; a task
            measured point by point (the wgmma family's tiles) measures its whole space.
        work_dir: the database folder (default ``tuning_logs/<model>-b<batch>-<arch>``).
        num_trials_per_iter: candidates built and measured per batch.
        max_workers: parallel builds (default: all CPU cores).
        seed: seeds the search (mixed with the database size, so a resumed run does not
            replay the first run's samples).
        only: task names (as printed) to tune; default all.
        runner, builder: MetaSchedule Runner / Builder replacing the local ones (tests).
        remote: a :class:`tvm_qconv.remote.Remote` tracker: candidates are built here and
            measured on its servers (MetaSchedule's RPCRunner), as many at once as it has
            servers under the key; None: on this machine.
        peaks: the GPU's int8 peaks in TOPS by instruction (:func:`read_peaks`), to print each
            task's % of the peak of its kernel's instruction (``KernelImpl.instruction``).
        space: the search space by name (e.g. the dp4a family's ``template`` or ``mlt``);
            default: each implementation's first.
        seed_default: measure the default schedule of each new task first.
        families: tune only these kernel families (``wgmma``, ``mma``, ``dp4a``); default every
            family that can run a layer, so the build can pick the fastest one per layer.
    Returns:
        One row per task (see :func:`format_table`), also printed: task, shape, occurrences,
        trials, best_us, tops, and pct_peak when ``peaks`` has the task's instruction.
    Raises:
        InputError: bad arguments, an unknown task name, a work_dir holding other logs, no GPU
            (or no RPC server) to measure on.
    """
    if target not in ("cuda", "llvm"):
        raise InputError(f"unknown target {target!r}: tune for cuda (a GPU) or llvm (a CPU)")
    if remote is not None and not remote.via_tracker:
        raise InputError("tuning through RPC goes through a tracker (--rpc-tracker H:P --rpc-key K), so that "
                         "every server of the key measures candidates")
    arch = arch if target == "cuda" else None
    for label, value in (("trials per task", trials_per_task), ("trials per iteration", num_trials_per_iter),
                         ("batch", batch), ("workers", max_workers), ("image size", image_size)):
        if value is not None and value < 1:
            raise InputError(f"{label} must be >= 1, got {value}")
    known = sorted({impl.family for impl in registry.tunable()})
    unknown = [f for f in families or [] if f not in known]
    if unknown:
        raise InputError(f"unknown kernel family {', '.join(map(repr, unknown))}: the tunable families are "
                         f"{', '.join(known)}")
    tgt = make_target(target, arch)
    model = model if model is not None else load_model(model_name)
    work_dir = work_dir or default_work_dir(model_name, batch, arch or target)
    settings = dict(model=model_name, batch=batch, target=target, arch=arch, image_size=image_size,
                    trials_per_task=trials_per_task, only=only, space=space, families=families,
                    tvm_version=tvm.__version__,
                    date=time.strftime("%Y-%m-%d %H:%M:%S"))
    # Before quantizing (up to a minute): a folder of another model's logs, or a path that cannot
    # be a folder, is refused at once.
    check_output_folder(work_dir, "the tuning folder (--work-dir)")
    previous = check_config(work_dir, settings)
    measured_on = None  # servers measuring, once checked
    if runner is None and (not os.path.isdir(work_dir) or db_files(work_dir) is None):
        # a new database: every task needs measuring, so refuse now, not after a minute of quantizing
        measured_on = check_remote(remote, arch) if remote is not None else check_local_gpu(arch) if arch else 1
    t0 = time.time()
    tasks = extract_tasks(int8_module(model, batch, image_size, tgt), TargetInfo.from_target(tgt), families)
    if not tasks:
        if families:  # e.g. --family wgmma on a plain sm_90 target
            needs = sorted({f"{impl.family} runs on {impl.runs_on}" for impl in registry.tunable()
                            if impl.family in families and impl.runs_on})
            raise InputError(f"no layer of {model_name} runs on kernel family {', '.join(families)} for "
                             f"{arch or target}" + (f" ({'; '.join(needs)}, where a layer's shape allows it)"
                                                    if needs else ""))
        raise InputError(f"{model_name} has no tunable int8 kernel")
    if only:
        names = [t.name for t in tasks]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise InputError(f"unknown task(s) {', '.join(unknown)}: {model_name} at batch {batch}, "
                             f"{image_size}x{image_size} has {', '.join(names)}")
        tasks = [t for t in tasks if t.name in only]
    for t in tasks:  # after --only: a space one family lacks may still name the other's tasks
        if space is not None and space not in t.impl.spaces:
            raise InputError(f"search space {space!r} is not one of {t.name}'s ({t.impl.name}: "
                             f"{', '.join(t.impl.spaces)}); --family or --only can leave that task out")
    print(f"[tune] {len(tasks)} task(s) of {model_name} (batch {batch}, {image_size}x{image_size}) "
          f"in {time.time() - t0:.0f} s; database {work_dir}", flush=True)
    os.makedirs(work_dir, exist_ok=True)  # JSONDatabase does not create it
    unpack_database(work_dir)
    repair_database(work_dir)
    canonicalize_database(work_dir)
    prepare_implementations()  # loading the records parses traces that name tensor intrinsics
    db = ms.database.JSONDatabase(work_dir=work_dir)
    limit = {t.name: _trial_limit(t, trials_per_task) for t in tasks}
    pruned = previous.get("pruned_trials", {}), previous.get("pruned_failed", {})
    measured = {t.name: _measured(db, t, limit[t.name], *pruned) for t in tasks}
    todo = [(t, limit[t.name] - measured[t.name][0]) for t in tasks if measured[t.name][0] < limit[t.name]]
    servers = measured_on or 1
    if todo and runner is None and measured_on is None:
        servers = check_remote(remote, arch) if remote is not None else check_local_gpu(arch) if arch else 1
    # after the database is readable and a GPU is at hand: a refused run is not recorded
    save_config(work_dir, settings, previous)
    for t in tasks:
        print(f"[tune]   {t.name:<28} {t.workload.describe():<30} x{t.weight}  "
              f"{measured[t.name][0]}/{limit[t.name]} valid trials in the database")
    if todo:
        print(f"[tune] {len(todo)} task(s) to tune, {sum(n for _, n in todo)} trials "
              f"({len(tasks) - len(todo)} finished already)", flush=True)
        own_builder = builder is None
        builder = builder or PersistentLocalBuilder(max_workers=max_workers or os.cpu_count())
        evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)
        if runner is None and remote is not None:
            runner = ms.runner.RPCRunner(
                rpc_config=ms.runner.RPCConfig(tracker_host=remote.tracker_host, tracker_port=remote.tracker_port,
                                               tracker_key=remote.key, session_timeout_sec=RPC_SESSION_TIMEOUT_S),
                evaluator_config=evaluator, max_workers=servers, f_alloc_argument=_alloc_layer_args_rpc)
            print(f"[tune] measuring on {servers} RPC server(s) of {remote.describe()}", flush=True)
        runner = runner or ms.runner.LocalRunner(evaluator_config=evaluator, initializer=_runner_worker_init,
                                                 f_alloc_argument=_alloc_layer_args)
        try:
            _tune(tasks, todo, db, tgt, work_dir, num_trials_per_iter, seed, measured, builder, runner, space,
                  seed_default)
        finally:
            if own_builder:
                builder.shutdown()
    else:
        print(f"[tune] every task has its trials already ({trials_per_task} valid, or every point of a wgmma "
              f"tile space): nothing to tune", flush=True)
    rows, best = [], {}
    for t in tasks:
        trials, secs = _measured(db, t, 1 << 30, *pruned)
        best[t.name] = secs or None
        row = dict(task=t.name, shape=t.workload.describe(), layer=str(t.workload), occurrences=t.weight, trials=trials,
                   best_us=secs * 1e6 if secs else None, tops=t.workload.ops / secs / 1e12 if secs else None)
        peak = (peaks or {}).get(t.impl.instruction)
        if peak:
            row["pct_peak"] = 100.0 * row["tops"] / peak if secs else None
        rows.append(row)
    print(format_table(rows, model_conv_us(tasks, best)))
    return rows


def check_local_gpu(arch: str) -> int:
    """Refuse to tune on this machine when it has no GPU that runs ``arch`` code: every
    candidate is measured on the local GPU (the tests pass their own runner instead).

    Returns:
        1 (one GPU measures).
    Raises:
        InputError: naming what is missing and what to do.
    """
    have = device_arch()
    if have is None:
        raise InputError(f"no CUDA GPU on this machine: tuning measures every candidate on the {arch} GPU it "
                         f"tunes for; tune through a GPU machine's RPC servers (--rpc-tracker H:P --rpc-key K, "
                         f"README: Remote GPUs), or run tune.py there and copy the --work-dir folder back")
    if not arch_runs_on(arch, have):
        raise InputError(f"--arch {arch} kernels cannot run on this machine's GPU ({have}): tune with --arch {have}, "
                         f"or on a {arch} machine")
    return 1


def check_remote(remote, arch: str | None) -> int:
    """Before any work: the tracker answers, has servers under the key, and (CUDA) their GPU
    runs ``arch`` code.

    Returns:
        The number of servers registered under the key (candidates measured at once).
    Raises:
        InputError: naming what is missing and what to do.
    """
    from ..remote import remote_gpu
    registered, _ = remote.servers()
    if registered == 0:
        remote.connect()  # raises the one-line "no server with key ... (keys there: ...)"
    if arch:
        session = remote.connect()
        _, have, name = remote_gpu(session)
        if not arch_runs_on(arch, have):
            raise InputError(f"--arch {arch} kernels cannot run on the remote GPU ({name}, {have}) of "
                             f"{remote.describe()}: tune with --arch {have}")
        print(f"[tune] remote GPU: {name} ({have}), {registered} server(s) under key {remote.key!r}", flush=True)
    return max(registered, 1)


def read_peaks(path: str) -> dict[str, float]:
    """{instruction: TOPS} from the JSON ``benchmarks/int8_peaks.py`` writes (paths it skipped
    are left out).

    Raises:
        InputError: the file is missing or is not such a JSON.
    """
    how = "write it with python benchmarks/int8_peaks.py --out DIR"
    try:
        with open(path) as f:
            peaks = {p["path"]: float(p["tops"]) for p in json.load(f)["peaks"] if "tops" in p}
    except OSError as err:
        raise InputError(f"cannot read the peaks file {path!r}: {err.strerror}") from err
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path!r} is not the JSON of benchmarks/int8_peaks.py ({err!r}): {how}") from err
    bad = {k: v for k, v in peaks.items() if not v > 0}
    if not peaks or bad:
        raise InputError(f"{path!r} holds no usable peak ({bad or 'none measured'}): {how}")
    return peaks


def _seed_with_default(todo: list, db, tgt, builder, runner, progress: Progress) -> None:
    """Measure the default schedule of each task without a record, and commit it.

    The default is the implementation's first space with the heuristic decisions
    (``impl.seed``), so its trace is a valid start for the search's mutations.  All builds go
    in one batch (:func:`_build_and_measure`).
    """
    new = [t for t, _ in todo if progress.done[t.name] == 0 and t.impl.search != "exhaustive"]
    if not new:
        return
    schs = []
    for task in new:
        target = task.impl.tuning_target(tgt)
        ctx = ms.TuneContext(mod=task.func, target=target, task_name="seed",
                             space_generator=task.impl.space_generator(task.impl.spaces[0], task.func, target))
        sch = tvm.s_tir.Schedule(ctx.mod)
        task.impl.seed(sch, tgt, task.workload)  # task.func has no workload attribute (task_func)
        if not all(p.apply(sch) for p in ctx.space_generator.postprocs):
            print(f"[tune] {task.name}: the default schedule fails the GPU checks; not seeded", file=sys.stderr)
            sch = None
        schs.append(sch)
    jobs = [(t, sch, "the default schedule") for t, sch in zip(new, schs) if sch is not None]
    for task, outcomes in _build_and_measure(jobs, db, tgt, builder, runner, progress, commit_failed=False).values():
        progress.record(task, outcomes[0], 1)


def _measure_points(todo: list, db, tgt, builder, runner, progress: Progress) -> None:
    """The tasks measured point by point (``search = "exhaustive"``: the wgmma family's tiles):
    build every point of each space the database has no record of, up to the task's trial limit
    (the first points first: point 0 is the default), all in one batch, measure each, and
    commit every result (a failed point as a failed record, so a rerun does not retry it:
    :func:`_build_and_measure`)."""
    jobs = []  # (task, schedule, label)
    for task, _ in todo:
        workload = db.commit_workload(tvm.IRModule({"main": task.func}))
        seen = {_point(r.trace) for r in db.get_all_tuning_records() if r.workload.same_as(workload)}
        for index in range(progress.total[task.name]):
            if index in seen:
                continue
            sch = tvm.s_tir.Schedule(task.func)
            task.impl.trace_point(sch, task.workload, index)
            jobs.append((task, sch, f"point {index}"))
    if not jobs:
        return
    print(f"[tune] measuring {len(jobs)} point(s) of {len({t.name for t, _, _ in jobs})} exhaustive task(s)",
          flush=True)
    for task, outcomes in _build_and_measure(jobs, db, tgt, builder, runner, progress, commit_failed=True).values():
        progress.record(task, [s for secs in outcomes for s in secs], len(outcomes))


def _build_and_measure(jobs: list, db, tgt, builder, runner, progress: Progress, commit_failed: bool) -> dict:
    """Build the ``(task, schedule, label)`` jobs in one batch, then measure them one at a time,
    committing each record as it comes (an interrupt keeps every finished one; after Ctrl-C the
    rest wait for a rerun).  ``commit_failed``: a job that does not build or run is committed as
    a failed record too.  Returns {task name: (task, [valid run times of each measured job])}."""
    built = builder.build([ms.builder.BuilderInput(sch.mod, task.impl.tuning_target(tgt)) for task, sch, _ in jobs])
    device = "cpu" if tgt.kind.name == "llvm" else tgt.kind.name  # the runner's device type
    results: dict = {}
    for (task, sch, label), b in zip(jobs, built):
        if progress.stop.is_set():
            break
        args = ms.arg_info.ArgInfo.from_prim_func(task.func)
        res = runner.run([ms.runner.RunnerInput(b.artifact_path, device, args)])[0].result() \
            if b.error_msg is None else None
        secs = valid_secs([b], [res]) if res is not None else []
        if not secs:
            err = b.error_msg or (res.error_msg if res is not None else "")
            print(f"[tune] {task.name}: {label} did not run: {_last_line(err)}", file=sys.stderr)
        if secs or commit_failed:
            workload = db.commit_workload(tvm.IRModule({"main": task.func}))
            db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, res.run_secs if secs
                                                             else [FAILED_RUN_SECS], tgt, args))
        results.setdefault(task.name, (task, []))[1].append(secs)
    return results


def _point(trace) -> int | None:
    """The point of an exhaustive space a trace is: its one categorical decision."""
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            return int(trace.decisions[inst])
    return None


def _last_line(err) -> str:
    """The error itself, from a (remote) traceback's text."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"


def _search_strategy(impl):
    """The search strategy ``impl.search`` names (``KernelImpl.search``)."""
    if impl.search == "replay_func":
        return ms.search_strategy.ReplayFunc()
    return ms.search_strategy.EvolutionarySearch(population_size=POPULATION)


def _tune(tasks: list, todo: list, db, tgt, work_dir: str, num_trials_per_iter: int, seed: int, measured: dict,
          builder, runner, space: str | None, seed_default: bool) -> None:
    """Run ms.tune_tasks over the unfinished tasks, one call per task, largest (occurrences x ops)
    first, so an interrupted run has tuned the layers that matter most; the calls share the
    database, builder, runner and cost model.
    """
    # MetaSchedule gives its console handler this logger's level (DEBUG once configured): keep
    # the console to warnings and Progress's lines; logs/ gets everything regardless.
    ms_logger = ms.logging.get_logger("tvm.s_tir.meta_schedule")
    ms_logger.setLevel(logging.WARNING)
    # MetaSchedule re-lists that logger's handlers by name in each run's logging config and
    # crashes on an unnamed one (pytest's log capture attaches two, a user may attach more):
    # set them aside while it configures, then put them back.
    unnamed = [h for h in ms_logger.handlers if h.get_name() is None]
    for h in unnamed:
        ms_logger.removeHandler(h)
    try:
        loggers = dict(zip([t.name for t, _ in todo],
                           ms.logging.get_loggers_from_work_dir(work_dir, [t.name for t, _ in todo])))
    finally:
        for h in unnamed:
            ms_logger.addHandler(h)
    seeds = ms.utils.fork_seed(seed + len(db), len(todo))
    sampled = [(t, n) for t, n in todo if t.impl.search != "exhaustive"]
    contexts = {t.name: ms.TuneContext(mod=t.func, target=t.impl.tuning_target(tgt),
                                       space_generator=t.impl.space_generator(space or t.impl.spaces[0], t.func,
                                                                              t.impl.tuning_target(tgt)),
                                       search_strategy=_search_strategy(t.impl),
                                       task_name=t.name, rand_state=s, logger=loggers[t.name])
                for (t, _), s in zip(todo, seeds) if t.impl.search != "exhaustive"}
    cost_model = ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True)
    done = {t.name: measured[t.name][0] for t in tasks}
    best = {t.name: measured[t.name][1] for t in tasks if measured[t.name][1]}
    total = {t.name: done[t.name] + n for t, n in todo}
    total.update({t.name: done[t.name] for t in tasks if t.name not in total})
    progress = Progress(tasks, done, best, total, time.time(), os.path.join(work_dir, "logs", "progress.jsonl"))
    os.makedirs(os.path.dirname(progress.path), exist_ok=True)
    if seed_default:
        _seed_with_default(todo, db, tgt, builder, runner, progress)
    exhaustive = [(t, n) for t, n in todo if t.impl.search == "exhaustive"]
    # Ctrl-C: MetaSchedule's C++ loop does not let a KeyboardInterrupt through cleanly (it was
    # swallowed, or became an empty RuntimeError, 2026-11-24), so the first Ctrl-C only sets a
    # flag: the round in flight finishes and is committed, Progress's callback then ends the
    # task, and the run stops with KeyboardInterrupt (cli.py: one line, exit 130).  A second
    # Ctrl-C interrupts at once.
    with _first_ctrl_c_sets(progress.stop):
        if exhaustive:
            _measure_points(exhaustive, db, tgt, builder, runner, progress)
        _tune_each(sampled, total, done, progress, contexts, work_dir, num_trials_per_iter, builder, runner, db,
                   cost_model, seed)
    if progress.stop.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def _first_ctrl_c_sets(event: threading.Event):
    def on_first(signum):
        event.set()
        interrupts.say(f"\n[tune] {interrupts.NAMES.get(signum, signum)}: stopping after the candidates in flight "
                       "(again to stop at once)")
    if interrupts.active():  # a CLI: its handler defers the first SIGINT or SIGTERM here
        with interrupts.deferred(on_first):
            yield
        return
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return

    def handler(signum, frame):
        event.set()
        signal.signal(signal.SIGINT, previous)
        print("\n[tune] Ctrl-C: stopping after the candidates in flight (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _tune_each(todo, total, done, progress, contexts, work_dir, num_trials_per_iter, builder, runner, db,
               cost_model, seed) -> None:
    # One tune_tasks call per task (sharing the database and the cost model).  On the H200, a
    # single call over VGG16's 9 tasks measured for 9 minutes and committed no record, while the
    # same tasks tuned one per call gave 8/8 and 16/16 valid runs (2026-11-22); the cause is not
    # found yet, so the gradient scheduler's cross-task budget split is given up for now.
    for task, _ in sorted(todo, key=lambda tn: -tn[0].weight * tn[0].workload.ops):
        remaining = total[task.name] - done[task.name]  # the seed counts as a trial
        if remaining <= 0:
            continue
        if progress.stop.is_set():
            return
        progress.current[0] = task
        try:
            _tune_one(task, contexts, remaining, work_dir, num_trials_per_iter, builder, runner, db, cost_model,
                      progress, seed)
        except Exception:  # Progress raises Interrupted from inside MetaSchedule, which wraps it
            if progress.stop.is_set():
                return
            raise


def _tune_one(task, contexts, remaining, work_dir, num_trials_per_iter, builder, runner, db, cost_model, progress,
              seed) -> None:
    ms.tune_tasks(tasks=[contexts[task.name]], task_weights=[float(task.weight)],
                  work_dir=work_dir, max_trials_global=remaining, max_trials_per_task=remaining,
                  num_trials_per_iter=min(num_trials_per_iter, remaining), builder=builder, runner=runner,
                  database=db, cost_model=cost_model,
                  measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [progress],
                  task_scheduler=ms.task_scheduler.GradientBased(seed=seed))
