"""tune: MetaSchedule tuning of a model's int8 kernels (a :class:`TuneJob`), resumable.

    tune(TuneJob("vgg16", 1)) every distinct tunable kernel of VGG16 at batch 1, each on its
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
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument as local_alloc_argument
from tvm.s_tir.meta_schedule.runner.rpc_runner import default_alloc_argument as rpc_alloc_argument

from .. import interrupts, pipeline, registry
from ..config import QuantConfig
from ..data import skimage_photos
from ..errors import InputError
from ..fileio import check_output_folder, write_json
from ..frontend import as_frontend, load_model
from ..pipeline import BuildState
from ..ranges.sources import Calibrate
from ..runtime.remote import remote_gpu
from ..schedules.requantize import quantize_multiplier
from ..target import TargetInfo, arch_runs_on, device_arch, make_target
from .builder import PersistentLocalBuilder
from .database import (CONFIG_FILE, FAILED_RUN_SECS, canonicalize_database, db_files, mean_secs, prepare_implementations, repair_database,
                       unpack_database, workload_key)
from .job import TuneJob, default_work_dir  # noqa: F401  (default_work_dir: re-exported)
from .progress import Progress, format_table, model_conv_us, valid_secs
from .tasks import KernelTask, extract_tasks

CALIB_IMAGES = 2  # tuning depends on shapes only; calibration just has to run
# Evolutionary-search population (MetaSchedule default 512): the template space is small and
# mostly valid; on the 2-core CPU box 128 cut one search round from 60-90 s to ~20 s.
POPULATION = 128
# One RPC measurement (session, upload, link of the candidate on the server, 3 runs): seconds
# normally; a server that stops answering fails the candidate after this, not the run.
RPC_SESSION_TIMEOUT_S = 60


def int8_module(model, batch: int, image_size: int, target: tvm.target.Target) -> tvm.IRModule:
    """The int8 Relax module compile_model would build for ``target`` under the symmetric scheme,
    calibrated on 2 photos: the tasks are the symmetric build's, and a build of unsigned activations
    (the default where it calibrates) takes their schedules through ``apply.symmetric_twin``, so
    one tuning log serves both schemes."""
    photos = skimage_photos(image_size)[:CALIB_IMAGES]
    # a Q/DQ file's own scales (None), as its build takes them: the same layers int8, the same kernels
    ranges = None if as_frontend(model).has_own_ranges else Calibrate(photos, count_check=False)
    info = TargetInfo.from_target(target)
    config = QuantConfig(num_calib_images=CALIB_IMAGES, unsigned_activations=False, bias_correction=False)
    state = BuildState(model, (batch, 3, image_size, image_size), info, config=config, ranges=ranges, target=target)
    return pipeline.run(state, until="lift").mod     # the build's steps up to the weights lifted


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
    """The local runner's worker process: register the functions kernels call at run time
    (``schedules/runtime_functions.py``: the TMA encoder of Hopper's kernels); the RPC server does
    the same."""
    from ..schedules import runtime_functions  # in the body: it runs in the worker's process, as its initializer
    runtime_functions.register()


def _alloc_layer_args(device, args_info, alloc_repeat):
    """The local runner's arguments: MetaSchedule's random fill, except the requantize constants
    of a fused layer (``(data, weight, bias, mult, shift, out)``: three int32 vectors of one
    shape), which get values a calibrated model has (biases of a few thousand, multipliers of
    1e-4 to 1e-2 as mult / shift).  Random int32 shifts would run kernels down paths a model
    never takes: the wgmma and stem kernels check the constants and fall back to their 64-bit
    requantize, which is measured slower."""
    return _fill_requantize(local_alloc_argument(device, args_info, alloc_repeat), args_info)


def _alloc_layer_args_rpc(session, device, args_info, alloc_repeat):
    """:func:`_alloc_layer_args` for MetaSchedule's RPCRunner (the tensors live on the server)."""
    return _fill_requantize(rpc_alloc_argument(session, device, args_info, alloc_repeat), args_info)


def _fill_requantize(repeated, args_info):
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


def tune_model(model_name: str, batch: int, **kwargs) -> list[dict]:
    """:func:`tune` of ``TuneJob(model_name, batch, **kwargs)`` (the keywords are
    :class:`~tvm_qconv.tuning.job.TuneJob`'s fields)."""
    return tune(TuneJob(model_name, batch, **kwargs))


def tune(job: TuneJob) -> list[dict]:
    """Tune every distinct tunable int8 kernel of ``job``'s model with MetaSchedule, or continue a
    previous run.

    A task is finished when the database holds ``job.trials_per_task`` valid measurements of it.
    A run gives each unfinished task the trials it lacks, so running again with the same job
    tunes only what an interrupted run left (finished tasks are skipped), and a larger
    ``trials_per_task`` goes on from the best schedules found so far.  MetaSchedule counts
    candidates that failed to build or run as trials, so a rerun also tops up a task by its
    failures.  Tasks share one XGBoost cost model and are tuned one at a time, largest
    (occurrences x ops) first (:func:`_tune` says why).  A task with no record yet first
    measures its implementation's default schedule (``seed_default``): it is a point of the
    implementation's first space, so the search starts from it, and the database's best is never
    slower than the default.

    Returns:
        One row per task (see :func:`format_table`), also printed: task, shape, occurrences,
        trials, best_us, tops, and pct_peak when ``job.peaks`` has the task's instruction.
    Raises:
        InputError: an unknown task name, a work_dir holding other logs, no GPU (or no RPC
            server) to measure on.
    """
    tgt = make_target(job.target, job.arch)
    model = job.model if job.model is not None else load_model(job.model_name)  # an unknown name: at once
    previous, servers = _check_before_work(job)
    tasks = _find_tasks(job, model, tgt)
    db = _open_database(job.folder)
    plan = _Plan.make(job, tasks, db, previous)
    if plan.todo and servers is None:
        servers = _servers(job)
    # after the database is readable and a GPU is at hand: a refused run is not recorded
    save_config(job.folder, job.settings(), previous)
    plan.print(tasks)
    if plan.todo:
        _measure(job, tgt, tasks, plan, db, servers or 1)
    else:
        print(f"[tune] every task has its trials already ({job.trials_per_task} valid, or every point of a "
              f"finite tile space): nothing to tune", flush=True)
    return _results(job, tasks, db, plan)


def _check_before_work(job: TuneJob) -> tuple[dict, int | None]:
    """Before quantizing (up to a minute): a folder of another model's logs, or a path that cannot
    be a folder, is refused at once; so is a new database with nothing to measure on.

    Returns:
        (the folder's config.json, the servers that will measure where already checked, else None).
    """
    check_output_folder(job.folder, "the tuning folder (--work-dir)")
    previous = check_config(job.folder, job.settings())
    new = not os.path.isdir(job.folder) or db_files(job.folder) is None
    return previous, _servers(job) if job.runner is None and new else None


def _servers(job: TuneJob) -> int:
    """How many candidates are measured at once, after checking there is something to measure on."""
    if job.runner is not None:
        return 1
    if job.remote is not None:
        return check_remote(job.remote, job.arch)
    return check_local_gpu(job.arch) if job.arch else 1


def _find_tasks(job: TuneJob, model, tgt) -> list[KernelTask]:
    """The model's int8 kernels to tune: every distinct one of the families asked for, or those
    ``job.only`` names.

    Raises:
        InputError: no layer runs on the families asked for, an unknown task name, a search space
            a task does not have.
    """
    t0 = time.time()
    families = list(job.families) if job.families else None
    tasks = extract_tasks(int8_module(model, job.batch, job.image_size, tgt), TargetInfo.from_target(tgt), families)
    if not tasks:
        if families:  # e.g. --family wgmma on a plain sm_90 target
            needs = sorted({f"{impl.family} runs on {impl.runs_on}" for impl in registry.tunable()
                            if impl.family in families and impl.runs_on})
            raise InputError(f"no layer of {job.model_name} runs on kernel family {', '.join(families)} for "
                             f"{job.arch or job.target}" + (f" ({'; '.join(needs)}, where a layer's shape allows it)"
                                                            if needs else ""))
        raise InputError(f"{job.model_name} has no tunable int8 kernel")
    if job.only:
        names = [t.name for t in tasks]
        unknown = [n for n in job.only if n not in names]
        if unknown:
            raise InputError(f"unknown task(s) {', '.join(unknown)}: {job.model_name} at batch {job.batch}, "
                             f"{job.image_size}x{job.image_size} has {', '.join(names)}")
        tasks = [t for t in tasks if t.name in job.only]
    for t in tasks:  # after --only: a space one family lacks may still name the other's tasks
        if job.space is not None and job.space not in t.impl.spaces:
            raise InputError(f"search space {job.space!r} is not one of {t.name}'s ({t.impl.name}: "
                             f"{', '.join(t.impl.spaces)}); --family or --only can leave that task out")
    print(f"[tune] {len(tasks)} task(s) of {job.model_name} (batch {job.batch}, {job.image_size}x{job.image_size}) "
          f"in {time.time() - t0:.0f} s; database {job.folder}", flush=True)
    return tasks


def _open_database(work_dir: str):
    """The folder's MetaSchedule database, unpacked, repaired and canonical (created if new)."""
    os.makedirs(work_dir, exist_ok=True)  # JSONDatabase does not create it
    unpack_database(work_dir)
    repair_database(work_dir)
    canonicalize_database(work_dir)
    prepare_implementations()  # loading the records parses traces that name tensor intrinsics
    return ms.database.JSONDatabase(work_dir=work_dir)


@dataclass
class _Plan:
    """What the database already has of each task and what is left to measure.

    Attributes:
        limit: {task: valid trials that finish it}.
        measured: {task: (trials so far, best seconds or None)}.
        todo: [(task, trials it lacks)] of the unfinished tasks.
        pruned: config.json's trials and failed records a prune dropped (they still count).
    """

    limit: dict
    measured: dict
    todo: list
    pruned: tuple

    @classmethod
    def make(cls, job: TuneJob, tasks: list, db, previous: dict) -> "_Plan":
        limit = {t.name: _trial_limit(t, job.trials_per_task) for t in tasks}
        pruned = previous.get("pruned_trials", {}), previous.get("pruned_failed", {})
        measured = {t.name: _measured(db, t, limit[t.name], *pruned) for t in tasks}
        todo = [(t, limit[t.name] - measured[t.name][0]) for t in tasks if measured[t.name][0] < limit[t.name]]
        return cls(limit, measured, todo, pruned)

    def print(self, tasks: list) -> None:
        for t in tasks:
            print(f"[tune]   {t.name:<28} {t.workload.describe():<30} x{t.weight}  "
                  f"{self.measured[t.name][0]}/{self.limit[t.name]} valid trials in the database")
        if self.todo:
            print(f"[tune] {len(self.todo)} task(s) to tune, {sum(n for _, n in self.todo)} trials "
                  f"({len(tasks) - len(self.todo)} finished already)", flush=True)


def _measure(job: TuneJob, tgt, tasks: list, plan: _Plan, db, servers: int) -> None:
    """Build the unfinished tasks' candidates here and measure them locally or on the remote
    servers (MetaSchedule's LocalRunner / RPCRunner, or the job's own)."""
    builder = job.builder or PersistentLocalBuilder(max_workers=job.max_workers or os.cpu_count())
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)
    runner = job.runner
    if runner is None and job.remote is not None:
        remote = job.remote
        runner = ms.runner.RPCRunner(
            rpc_config=ms.runner.RPCConfig(tracker_host=remote.tracker_host, tracker_port=remote.tracker_port,
                                           tracker_key=remote.key, session_timeout_sec=RPC_SESSION_TIMEOUT_S),
            evaluator_config=evaluator, max_workers=servers, f_alloc_argument=_alloc_layer_args_rpc)
        print(f"[tune] measuring on {servers} RPC server(s) of {remote.describe()}", flush=True)
    runner = runner or ms.runner.LocalRunner(evaluator_config=evaluator, initializer=_runner_worker_init,
                                             f_alloc_argument=_alloc_layer_args)
    try:
        _tune(_Search(job, tgt, db, builder, runner), tasks, plan)
    finally:
        if job.builder is None:
            builder.shutdown()


def _results(job: TuneJob, tasks: list, db, plan: _Plan) -> list[dict]:
    """One row per task from the database (printed as a table, returned)."""
    rows, best = [], {}
    for t in tasks:
        trials, secs = _measured(db, t, 1 << 30, *plan.pruned)
        best[t.name] = secs or None
        row = dict(task=t.name, shape=t.workload.describe(), layer=str(t.workload), occurrences=t.weight, trials=trials,
                   best_us=secs * 1e6 if secs else None, tops=t.workload.ops / secs / 1e12 if secs else None)
        peak = (job.peaks or {}).get(t.impl.instruction)
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
                         f"docs/usage.md#remote-gpus-tvm-rpc), or run tune.py there and copy the --work-dir folder back")
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


@dataclass
class _Search:
    """What every measurement of one run shares: the job, the target, the database, the builder
    and runner (the cost model and the task contexts are made by :func:`_tune`)."""

    job: TuneJob
    tgt: object
    db: object
    builder: object
    runner: object
    cost_model: object = None
    contexts: dict = field(default_factory=dict)
    progress: Progress | None = None


def _tune(search: _Search, tasks: list, plan: _Plan) -> None:
    """Run ms.tune_tasks over the unfinished tasks, one call per task, largest (occurrences x ops)
    first, so an interrupted run has tuned the layers that matter most; the calls share the
    database, builder, runner and cost model.
    """
    job, tgt, db, builder, runner = search.job, search.tgt, search.db, search.builder, search.runner
    todo, measured, work_dir = plan.todo, plan.measured, job.folder
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
    seeds = ms.utils.fork_seed(job.seed + len(db), len(todo))
    sampled = [(t, n) for t, n in todo if t.impl.search != "exhaustive"]
    search.contexts = {t.name: ms.TuneContext(mod=t.func, target=t.impl.tuning_target(tgt),
                                              space_generator=t.impl.space_generator(job.space or t.impl.spaces[0],
                                                                                     t.func, t.impl.tuning_target(tgt)),
                                              search_strategy=_search_strategy(t.impl),
                                              task_name=t.name, rand_state=s, logger=loggers[t.name])
                       for (t, _), s in zip(todo, seeds) if t.impl.search != "exhaustive"}
    search.cost_model = ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(),
                                               adaptive_training=True)
    done = {t.name: measured[t.name][0] for t in tasks}
    best = {t.name: measured[t.name][1] for t in tasks if measured[t.name][1]}
    total = {t.name: done[t.name] + n for t, n in todo}
    total.update({t.name: done[t.name] for t in tasks if t.name not in total})
    progress = Progress(tasks, done, best, total, time.time(), os.path.join(work_dir, "logs", "progress.jsonl"))
    search.progress = progress
    os.makedirs(os.path.dirname(progress.path), exist_ok=True)
    exhaustive = [(t, n) for t, n in todo if t.impl.search == "exhaustive"]
    # Ctrl-C: MetaSchedule's C++ loop does not let a KeyboardInterrupt through cleanly (it was
    # swallowed, or became an empty RuntimeError, 2026-11-24), so the first Ctrl-C only sets a
    # flag: the round in flight (or the batch of default schedules being measured) finishes and is
    # committed, Progress's callback then ends the task, and the run stops with KeyboardInterrupt
    # (cli/exits.py: one line, exit 130).  A second Ctrl-C interrupts at once.
    with _first_ctrl_c_sets(progress.stop):
        if job.seed_default:
            _seed_with_default(todo, db, tgt, builder, runner, progress)
        if exhaustive and not progress.stop.is_set():
            _measure_points(exhaustive, db, tgt, builder, runner, progress)
        if not progress.stop.is_set():
            _tune_each(search, sampled, total, done)
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


def _tune_each(search: _Search, todo: list, total: dict, done: dict) -> None:
    # One tune_tasks call per task (sharing the database and the cost model).  On the H200, a
    # single call over VGG16's 9 tasks measured for 9 minutes and committed no record, while the
    # same tasks tuned one per call gave 8/8 and 16/16 valid runs (2026-11-22); the cause is not
    # found yet, so the gradient scheduler's cross-task budget split is given up for now.
    progress = search.progress
    for task, _ in sorted(todo, key=lambda tn: -tn[0].weight * tn[0].workload.ops):
        remaining = total[task.name] - done[task.name]  # the seed counts as a trial
        if remaining <= 0:
            continue
        if progress.stop.is_set():
            return
        progress.tuning(task)
        try:
            _tune_one(search, task, remaining)
        except Exception:  # Progress raises Interrupted from inside MetaSchedule, which wraps it
            if progress.stop.is_set():
                return
            raise


def _tune_one(search: _Search, task, remaining: int) -> None:
    job = search.job
    ms.tune_tasks(tasks=[search.contexts[task.name]], task_weights=[float(task.weight)],
                  work_dir=job.folder, max_trials_global=remaining, max_trials_per_task=remaining,
                  num_trials_per_iter=min(job.num_trials_per_iter, remaining), builder=search.builder,
                  runner=search.runner, database=search.db, cost_model=search.cost_model,
                  measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [search.progress],
                  task_scheduler=ms.task_scheduler.GradientBased(seed=job.seed))
