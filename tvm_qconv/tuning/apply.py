"""Building with a tuning database: each kernel the database covers gets its best record's
schedule; the others keep their implementation's default (``ScheduleInt8Kernels``)."""
from __future__ import annotations

import collections
import dataclasses
import sys

import tvm

from .. import registry
from ..errors import InputError
from ..target import TargetInfo
from ..schedules.kernel import IMPL_ATTR
from ..schedules.requantize import UNSIGNED_ZERO
from ..schedules.workload import ConvWorkload
from .database import corrupt, load_database, mean_secs, tune_command
from .tasks import is_tunable, task_func


# A relayout kernel under CUDA graphs: its launch and the tensor read and written once at the
# bandwidth such gathers reach (an estimate, not measured per layer).
RELAYOUT_LAUNCH_S = 2e-6
RELAYOUT_BYTES_PER_S = 1e12


# What the tuner's runner can resolve: it times a kernel alone, without CUDA graphs, and every
# wgmma tile of every layer measured 9.4-11 us at batch 1 and 16 on an H200 whatever its work
# (the host encodes the TMA descriptors before each launch; a CUDA graph does that once).  A
# layer whose default kernel measured under this keeps it: the times cannot tell (ResNet-50 at
# batch 1: one layer moved to wgmma on 10.3 against 11.7 us, and the model ran 3 % slower).
RUNNER_FLOOR_S = 12e-6


def symmetric_twin(wl):
    """The conv workload a symmetric build has where ``wl`` reads or writes an unsigned tensor
    (``QuantConfig.unsigned_activations``), else None.  Its kernel differs only in constants (the
    padding's value, the clamp's bounds), so a schedule tuned for the twin applies as it is: the
    tuner's tasks are the symmetric build's, and one tuning log serves both schemes."""
    if not isinstance(wl, ConvWorkload) or (wl.in_zero == 0 and wl.act_min != UNSIGNED_ZERO):
        return None
    if wl.act_min == UNSIGNED_ZERO:   # an unsigned output: ReLU at zero point -128 -> ReLU
        return dataclasses.replace(wl, in_zero=0, activation="relu", act_min=0, act_max=127)
    return dataclasses.replace(wl, in_zero=0)


def tuning_twin(wl):
    """The workload whose records serve ``wl`` where it has none of its own, else None: its
    :func:`symmetric_twin`, and without its table or residual epilogue (``ConvWorkload.table``,
    ``.residual``: the same blocks, the table or the other addend read in the epilogue's
    expression, so the conv's trace applies as it is; a database tuned before epilogues were
    fused keeps serving)."""
    if not isinstance(wl, ConvWorkload):
        return None
    plain = dataclasses.replace(wl, table=False, residual=())
    twin = symmetric_twin(plain)
    return twin if twin is not None else (plain if wl.table or wl.residual else None)


def lookup(db, impl, func) -> list:
    """The database's best record (a list of at most one) for ``func`` (a kernel of ``impl``), or
    for its :func:`tuning_twin` (made only where ``func`` has none); ``[]`` where it has neither."""
    mod = tvm.IRModule({"main": task_func(func)})
    if not db.has_workload(mod):  # has_workload first: a query would add it
        mod = _twin_module(impl, func)
        if mod is None or not db.has_workload(mod):
            return []
    return db.get_top_k(db.commit_workload(mod), 1)


def _twin_module(impl, func):
    twin = tuning_twin(ConvWorkload.of(func)) if "tvm_qconv.workload" in func.attrs else None
    return None if twin is None else tvm.IRModule({"main": task_func(impl.compute(twin))})


def switch_seconds(wl) -> float:
    """Estimated time of the two relayouts a layer pays to run in a layout other than its
    neighbours': its int8 input into that layout and its output back."""
    if not isinstance(wl, ConvWorkload):
        return 0.0
    moved = wl.batch * (wl.in_channels * wl.height * wl.width + wl.out_channels * wl.out_height * wl.out_width)
    return 2 * RELAYOUT_LAUNCH_S + 2 * moved / RELAYOUT_BYTES_PER_S


def charged_seconds(wl, impl, default, secs: float) -> float:
    """``impl``'s measured ``secs`` for ``wl`` plus the two relayouts it costs where its layout is
    not the ``default``'s (:func:`switch_seconds`)."""
    return secs + (switch_seconds(wl) if impl.layout != default.layout else 0.0)


def pick(wl, default, measured: dict):
    """The implementation a build runs for ``wl`` (:func:`measured_chooser`'s rule), given
    ``measured`` = {implementation: best seconds} and the registry's untuned ``default``: the
    fastest, a layout change charged :func:`switch_seconds`, where the default and another were
    measured and the default is not under ``RUNNER_FLOOR_S``; otherwise None (the default)."""
    charged = {impl: charged_seconds(wl, impl, default, secs) for impl, secs in measured.items()}
    if default not in charged or len(charged) < 2 or charged[default] < RUNNER_FLOOR_S:
        return None
    return min(charged, key=charged.get)


def measured_chooser(db, target: tvm.target.Target):
    """A chooser for the quantize pass: of a layer's candidate implementations, the one whose
    kernel for that workload the database measured fastest, where it measured the candidate
    the registry would pick untuned and at least one other (a database tuned with ``--family``
    compares the families it holds; a layer is never moved off its default unmeasured);
    otherwise None (the registry's order decides).

    A candidate whose activations are in another layout than the default's (dp4a's NCHW4c
    against the tensor cores' NHWC32) is charged two conversions, the layer's input into its
    layout and its output back (:func:`switch_seconds`): a family change that saves less than
    that costs time (ResNet-50 at batch 1, H200: dp4a measured 0.6-0.7 us faster on 14 of its
    1x1 convs, and the build that took them ran 0.347 ms against 0.304 ms).  A layer whose
    default measured under ``RUNNER_FLOOR_S`` keeps it.
    """
    def best_seconds(impl, wl) -> float | None:
        top = lookup(db, impl, impl.compute(wl))
        return mean_secs(top[0].run_secs) if top else None

    def choose(op, wl, candidates) -> str | None:
        # the registry's untuned pick (registry.select), which tasks.extract_tasks marks default
        default = next((impl for impl in candidates if impl.preferred(wl, target_info)), candidates[0] if candidates else None)
        if default is None or not default.spaces:
            return None
        measured = {impl: best_seconds(impl, wl) for impl in candidates if impl.spaces}
        chosen = pick(wl, default, {impl: secs for impl, secs in measured.items() if secs is not None})
        return None if chosen is None else chosen.name

    target_info = TargetInfo.from_target(target)
    return choose


def apply_tuning_database(mod: tvm.IRModule, work_dir: str, target: tvm.target.Target,
                          db=None, ignore_stale: bool = False) -> tuple[tvm.IRModule, dict]:
    """Schedule every tunable kernel the database covers with its best record.

    Args:
        mod: the int8 Relax module (after ``LiftConstantsToParams``, before
            ``ScheduleInt8Kernels``).
        work_dir: the database folder written by :func:`tvm_qconv.tuning.tune_model`.
        target: the CUDA target being built for.
        db: the database already loaded from ``work_dir`` (default: load it).
        ignore_stale: a record whose schedule no longer applies to its kernel (made by an older
            version of the kernel's search space) leaves that kernel on its default schedule,
            with a warning, instead of refusing the build.
    Returns:
        (mod, tuned): a copy of ``mod`` whose covered PrimFuncs are scheduled and marked
        ``tir.is_scheduled`` (ScheduleInt8Kernels then reports them "tuned" and gives the rest
        their default schedule), and {function name: layer shape} of those.
    Raises:
        InputError: ``work_dir`` is missing, empty or corrupt, or (without ``ignore_stale``)
            holds a schedule of an older template.
    """
    db = db if db is not None else load_database(work_dir, ignore_stale)
    mod = mod.clone()
    tuned, convs, other_archs, stale = {}, 0, set(), []
    uncovered = collections.Counter()  # implementation -> kernels the database has no record of
    for gv, func in list(mod.functions.items()):
        if not is_tunable(func):
            continue
        convs += 1
        impl = registry.of_func(func)
        try:
            top = lookup(db, impl, func)
        except Exception as err:  # the record itself cannot be read back
            raise corrupt(work_dir, err) from err
        if not top:  # no workload, or its only records were left out (--ignore-stale)
            uncovered[str(func.attrs[IMPL_ATTR])] += 1
            continue
        record = top[0]
        try:
            # replays the trace on this kernel (its twin's trace, for an unsigned one or one with a table)
            # on a deep copy: a schedule may rewrite in place the statements it shares with ``func``
            sch = tvm.s_tir.Schedule(tvm.ir.load_json(tvm.ir.save_json(tvm.IRModule({"main": task_func(func)}))))
            record.trace.apply_to_schedule(sch, remove_postproc=False)
        except Exception as err:  # the file is fine; the template changed since it was tuned
            if not ignore_stale:
                raise InputError(
                    f"tuning log {work_dir} holds a schedule of an older {func.attrs[IMPL_ATTR]} template: it no "
                    f"longer applies to {ConvWorkload.of(func).describe()} ({type(err).__name__}: "
                    f"{(str(err).strip().splitlines() or [''])[-1][:160]}): re-tune with `{tune_command(work_dir)}`, "
                    f"or build with --ignore-stale to give such kernels their default schedule") from None
            stale.append(ConvWorkload.of(func).describe())
            continue
        arch = record.target.attrs.get("arch") if record.target is not None else None
        # sm_90 and sm_90a are one GPU (sm_90a only adds instructions): no warning between them
        if arch is not None and str(arch).rstrip("a") != str(target.attrs.get("arch")).rstrip("a"):
            other_archs.add(str(arch))
        mod[gv] = impl.tuned(sch.mod["main"], func, target)
        decision = impl.decision(sch.mod["main"])
        tuned[gv.name_hint] = ConvWorkload.of(func).describe() + (f" ({decision})" if decision else "")
    if stale:
        print(f"warning: tuning log {work_dir} holds schedules of an older template for {', '.join(stale)}: those "
              f"kernels get their default schedule (re-tune with `{tune_command(work_dir)}`)", file=sys.stderr)
    if convs and not tuned and not stale:
        print(f"warning: tuning log {work_dir} covers none of this model's {convs} tunable kernels (tuned for "
              f"another model, batch or image size?); they get the default schedule", file=sys.stderr)
    elif uncovered:  # e.g. a database tuned with --family dp4a, the build choosing mma for most layers
        print(f"warning: tuning log {work_dir} covers {len(tuned)} of this model's {convs} tunable kernels; "
              f"{', '.join(f'{n} {name}' for name, n in sorted(uncovered.items()))} get the default schedule "
              f"(tune them: tune.py with the same model, batch, image size and arch, or build with "
              f"--family to keep to the tuned family)", file=sys.stderr)
    if other_archs:
        print(f"warning: tuning log {work_dir} was tuned for {', '.join(sorted(other_archs))}, building for "
              f"{target.attrs.get('arch')}: the schedules run, but were not measured on this GPU", file=sys.stderr)
    return mod, tuned
