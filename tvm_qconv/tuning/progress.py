"""Tuning progress: one console line and one JSON line per measured round, and the final table."""
from __future__ import annotations

import json
import math
import threading
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .apply import charged_seconds, pick
from .database import FAILED_RUN_SECS, mean_secs
from .tasks import KernelTask


class Interrupted(Exception):
    """Raised by :class:`Progress` to end a tuning run the user interrupted."""


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """After each measured batch: one console line (task, trials, best, TOPS, and the model's
    conv time so far) and one JSON line in ``logs/progress.jsonl`` (the convergence curve)."""

    def __init__(self, tasks: list[KernelTask], done: dict, best: dict, total: dict, t0: float, path: str):
        self.tasks, self.done, self.best, self.total, self.t0, self.path = tasks, done, best, total, t0, path
        self.current = None  # the task being tuned (tune_tasks gets one task at a time): tuning()
        self.stop = threading.Event()  # set by Ctrl-C (driver._tune): the next round's callback ends the run

    def tuning(self, task: KernelTask) -> None:
        """The task the next rounds measure (a method: the driver holds this object through
        TVM's derived-object wrapper, which does not pass attribute assignments on)."""
        self.current = task

    def model_us(self) -> float | None:
        """The model's conv time so far (us), as a build from the database would run it
        (:func:`model_conv_us`); None while a layer's default has no time."""
        return model_conv_us(self.tasks, self.best)

    def record(self, task: KernelTask, ok: list[float], tried: int) -> None:
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
        if self.stop.is_set():  # after MetaSchedule's own callbacks have committed this round's records
            raise Interrupted("Ctrl-C")
        task = self.current
        self.record(task, valid_secs(builder_results, runner_results), len(runner_results))


def model_conv_us(tasks: list[KernelTask], best: dict) -> float | None:
    """The model's conv time (us) as a build from these measurements would run it: per distinct
    layer, occurrences x the time of the family the build picks (``apply.pick``: the fastest, a
    layout change charged its two relayouts; the default where the rule keeps it), from
    ``best[task name]`` (s).  None while a layer's default has no time: the build would run
    that layer's default untuned (or, tuned with ``--family`` leaving the default out, it does).
    """
    layers: dict = {}  # workload -> its tasks
    for t in tasks:
        layers.setdefault(t.workload, []).append(t)
    total = 0.0
    for wl, group in layers.items():
        measured = {t.impl: best[t.name] for t in group if best.get(t.name) is not None}
        default = next((t.impl for t in group if t.default), None)
        if default not in measured:
            return None
        chosen = pick(wl, default, measured) or default
        total += group[0].weight * charged_seconds(wl, chosen, default, measured[chosen])
    return total * 1e6


def valid_secs(builder_results, runner_results) -> list[float]:
    """Mean run time (s) of each candidate that built and ran."""
    ok = [mean_secs(r.run_secs) for b, r in zip(builder_results, runner_results)
          if b.error_msg is None and r.error_msg is None and r.run_secs]
    return [s for s in ok if s < FAILED_RUN_SECS]


def format_table(rows: list[dict], total_us: float | None = None) -> str:
    """The per-task table: task, layer shape, occurrences (x), trials, best us, TOPS, % of peak;
    the last line is ``total_us`` (the model's conv time as built: :func:`model_conv_us`), or
    without it the sum over the distinct layers of occurrences x the best us of any family's
    task, where every layer has one."""
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
    fastest: dict = {}  # layer -> (occurrences, best us of any family)
    layer = lambda r: r.get("layer", r["shape"])  # noqa: E731  (the workload; the shape omits padding)
    for r in rows:
        if r["best_us"] is not None:
            occ, prev = fastest.get(layer(r), (r["occurrences"], r["best_us"]))
            fastest[layer(r)] = (occ, min(prev, r["best_us"]))
    if rows and len(fastest) == len({layer(r) for r in rows}):
        total = total_us if total_us is not None else sum(occ * us for occ, us in fastest.values())
        label = "all convs, as built" if total_us is not None else "all convs (x * best)"
        out.append(f"{label:<{wt}} {'':<{ws}} {sum(occ for occ, _ in fastest.values()):>2} "
                   f"{'':>6} {total:>9.1f}")
    return "\n".join(out)
