"""The work of `tune.py` once its arguments are parsed: MetaSchedule tuning of a model's int8 kernels
(:mod:`tvm_qconv.tuning`), and the training convs' tiles (:mod:`tvm_qconv.nn.conv_tiles`).  TVM, torch
and the tuning package are imported at the top (~5 s here); :mod:`tvm_qconv.cli.tune` loads this
module only after parsing (``tune._work``), so that --help and a bad flag answer at once."""
from __future__ import annotations

import os
from typing import Callable

from tvm_qconv.errors import InputError
from tvm_qconv.nn.conv_tiles import tune_model
from tvm_qconv.runtime.remote import Remote, local_cluster
from tvm_qconv.tuning import TuneJob, default_work_dir, prune_database, read_peaks, tune



def run_job(job):
    """:func:`tvm_qconv.tuning.tune` of ``job``: one row per task."""
    return tune(job)


def work_dir_of(args, arch: str | None) -> str:
    """Where the database goes: --work-dir, else ``tuning_logs/<model>-b<batch>-<arch>`` (``-llvm``
    for the CPU)."""
    return args.work_dir or default_work_dir(args.model, args.batch, arch or args.target)


def tune_tasks(args, arch: str | None, work_dir: str, tune_job: Callable) -> int:
    """Tune every task of ``args.model`` into ``work_dir``, each job run by ``tune_job``
    (``tune.run_job``, a name tests can replace)."""
    peaks = read_peaks(args.peaks) if args.peaks else None
    if args.local_gpus and (args.rpc_tracker or args.rpc_key):
        raise InputError("--local-gpus starts its own tracker: drop --rpc-tracker/--rpc-key, or --local-gpus")
    if args.local_gpus and args.target != "cuda":
        raise InputError("--local-gpus measures on GPUs: it needs --target cuda")
    if args.rpc_key and not args.rpc_tracker:
        raise InputError("--rpc-key needs --rpc-tracker HOST:PORT")

    def run(remote) -> None:
        tune_job(TuneJob(args.model, args.batch, target=args.target, arch=arch, families=args.family,
                         only=args.only, space=args.space, image_size=args.image_size,
                         trials_per_task=args.trials, num_trials_per_iter=args.trials_per_iter, seed=args.seed,
                         seed_default=not args.no_seed_default, remote=remote, max_workers=args.workers,
                         work_dir=work_dir, peaks=peaks))

    if args.local_gpus:
        logs = os.path.join(work_dir, "logs")  # the tracker's and servers' logs go beside the tuning logs
        os.makedirs(logs, exist_ok=True)
        with local_cluster(args.local_gpus, log_dir=logs) as remote:
            run(remote)
    else:
        run(Remote.parse(tracker=args.rpc_tracker, key=args.rpc_key) if args.rpc_tracker else None)
    if args.prune:
        before, after = prune_database(work_dir)
        print(f"[tune] pruned {work_dir}: {before} -> {after} records")
    return 0


def tune_training_convs(args) -> int:
    """``--training``: :func:`tvm_qconv.nn.conv_tiles.tune_model`."""
    tune_model(args.model, args.batch, image_size=args.image_size, workers=args.workers, seconds=args.seconds,
               redo=args.redo)
    return 0
