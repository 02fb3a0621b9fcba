"""Issue 34's goal, measured: every zoo classifier's int8 library against PyTorch's best (fp16 and bf16
channels_last with CUDA graphs, ``torch.compile(mode="max-autotune")``), at batch 1 and 64, with
``deploy.py compare`` -- one (model, batch) per GPU at a time, resumable across device calls.

    python benchmarks/goal.py run --out docs/results/goal --deadline 540          # every GPU of the machine
    python benchmarks/goal.py run --models convnext_tiny densenet121 --batches 64 --out docs/results/goal
    python benchmarks/goal.py table docs/results/goal                              # goal.md + goal.json
    python benchmarks/goal.py run --out docs/results/goal --autotune-cache .dev/autotune   # carried across calls
    python benchmarks/goal.py build --models densenet121 --batches 1 64 --lib-dir libs     # on any machine, no GPU
    python benchmarks/goal.py run --models densenet121 --lib-dir libs --out docs/results/goal

Why a driver: ``torch.compile`` with max-autotune takes ~5 minutes per model and batch on an H100, so
the 32 measurements take ~3 hours of one GPU, and a device call lasts at most 10 minutes.  ``run``
starts one ``deploy.py compare --model M --batch B`` per GPU (``CUDA_VISIBLE_DEVICES``, and its share
of the host's cores: ``thread_limits``), as many
(model, batch) units as there are GPUs, the next as one finishes; a unit whose
``<out>/<model>_b<batch>/compare_<model>.json`` exists is done and skipped, so a later call goes on
where an earlier one stopped.  At ``--deadline`` seconds the running units are interrupted (their
rows so far stay in ``compare_<model>.partial.json``; the unit runs again next time) and no new one
starts where fewer than ``--unit-seconds`` remain.  ``table`` reads every finished unit: per model
and batch, the int8 library's median, PyTorch's best row and which it was, the speed-up, and
whether it reaches the goal (1.5x) and the moonshot (2x).

``--autotune-cache DIR``: max-autotune benchmarks every candidate kernel of every GEMM and conv on the GPU
(EfficientNet-B0 at batch 64: 94 ops, 7-17 s each on an H200, more than a 10-minute call holds with the
int8 build before it).  Inductor keeps those timings in ``<TORCHINDUCTOR_CACHE_DIR>/cache/<system hash>``
(JSON, written after each op; the hash names the GPU, CUDA and Triton) and skips the benchmark of an op
whose every candidate it holds.  With this option each unit gets its own inductor cache seeded from
``DIR`` and its timings are merged back into ``DIR`` when it ends, interrupted or not, so a unit cut
short resumes where its autotuning stopped in the next call.  Every row of a unit is still measured in
one ``deploy.py compare`` run; only which kernels torch.compile picks may come from an earlier call's
benchmark on the same kind of GPU.

``--lib-dir DIR``: the int8 build is CPU work (DenseNet-121 at batch 64: ~100 s on a 2-core box, ~400 s
on a 4-GPU host building four units at once), and a unit cut short by the deadline builds again in the
next call.  ``build`` writes each pending unit's library (``deploy.py build --target cuda --cuda-graph``,
the same seed, calibration and options ``compare`` would use, so ``compare`` finds the same float
weights) to ``DIR/<model>_b<batch>.so`` on any machine; ``run --lib-dir DIR`` hands a unit its library
with ``compare --lib`` where one is there, and builds the others as before.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tvm_qconv.zoo import SIZES  # noqa: E402

BASELINES = "int8-graph,torch-fp16-graph,torch-bf16-graph,torch-compile"
GOAL, MOONSHOT = 1.5, 2.0


def unit_dir(out: str, model: str, batch: int) -> str:
    return os.path.join(out, f"{model}_b{batch}")


def pending(out: str, models: list[str], batches: list[int]) -> list[tuple[str, int]]:
    """The (model, batch) units without a finished comparison in ``out``, batch 64 first (the slower)."""
    units = [(m, b) for b in sorted(batches, reverse=True) for m in models]
    return [(m, b) for m, b in units if not os.path.exists(os.path.join(unit_dir(out, m, b), f"compare_{m}.json"))]


def lib_path(lib_dir: str, model: str, batch: int) -> str:
    return os.path.join(lib_dir, f"{model}_b{batch}.so")


def command(out: str, model: str, batch: int, size: int, lib_dir: str | None = None) -> list[str]:
    lib = lib_path(lib_dir, model, batch) if lib_dir else None
    return [sys.executable, os.path.join(ROOT, "deploy.py"), "compare", "--model", model, "--batch", str(batch),
            "--image-size", str(size), "--baselines", BASELINES, "--out", unit_dir(out, model, batch),
            "--work-dir", os.path.join("/tmp", "tvm_qconv_goal", f"{model}_b{batch}"), "--quiet",
            *(["--lib", lib] if lib and os.path.exists(lib) else [])]


def build_command(model: str, batch: int, size: int, lib_dir: str, arch: str) -> list[str]:
    """``deploy.py build`` of the library ``compare`` would build for the unit's int8-graph row."""
    return [sys.executable, os.path.join(ROOT, "deploy.py"), "build", "--model", model, "--batch", str(batch),
            "--image-size", str(size), "--target", "cuda", "--arch", arch, "--cuda-graph", "--no-verify",
            "--quiet", "-o", lib_path(lib_dir, model, batch)]


def build(out: str, models: list[str], batches: list[int], size: int, lib_dir: str, arch: str) -> int:
    """Build the library of every pending unit that has none in ``lib_dir``; returns how many failed."""
    failed = 0
    for m, b in pending(out, models, batches):
        if os.path.exists(lib_path(lib_dir, m, b)):
            print(f"{m} b{b}: {lib_path(lib_dir, m, b)} is there", flush=True)
            continue
        os.makedirs(lib_dir, exist_ok=True)
        t = time.monotonic()
        rc = subprocess.run(build_command(m, b, size, lib_dir, arch)).returncode
        failed += rc != 0
        print(f"{m} b{b}: {'built' if rc == 0 else f'FAILED (exit {rc})'} in {time.monotonic() - t:.0f} s", flush=True)
    return failed


def inductor_dir(model: str, batch: int) -> str:
    """A unit's own inductor cache (``--autotune-cache``): units running at once never write one file."""
    return os.path.join("/tmp", "tvm_qconv_goal", "inductor", f"{model}_b{batch}")


def gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def thread_limits(gpus: int, cpus: int | None = None) -> dict:
    """Each unit's share of the host's cores, for PyTorch, OpenMP, TVM and Inductor's compile workers.

    Why: every library sizes its pool to the whole host, so four units on a 64-core host ran ~1,000
    threads; calibration, ~14 s on a 2-core box, took 113-157 s per unit on a 4 x H200 host
    (2026-11-28), and left max-autotune too little of the 10-minute call."""
    share = str(max(1, (cpus or os.cpu_count() or 1) // max(1, gpus)))
    return {k: share for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS",
                               "TORCHINDUCTOR_COMPILE_THREADS")}


def autotune_files(cache_dir: str) -> list[str]:
    """The autotune timing files (``<system hash>``) of an inductor cache folder's ``cache/``."""
    return sorted(glob.glob(os.path.join(cache_dir, "cache", "*")))


def merge_timings(into: dict, new: dict) -> dict:
    """``into`` with every timing of ``new`` (nested ``op -> inputs -> precision -> choice``) added."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge_timings(into[key], value)
        else:
            into[key] = value
    return into


def save_timings(unit_cache: str, store: str) -> int:
    """Merge the timings a unit's inductor cache holds into ``store`` (its ``cache/`` files by name);
    returns how many ops ``store`` holds timings for.  A file that is not inductor's JSON is skipped."""
    ops = 0
    for path in autotune_files(unit_cache):
        try:
            with open(path) as f:
                new = json.load(f)
            assert isinstance(new.get("cache"), dict)
        except (OSError, ValueError, AssertionError):
            continue
        target = os.path.join(store, "cache", os.path.basename(path))
        old = {"system": new.get("system"), "cache": {}}
        if os.path.exists(target):
            with open(target) as f:
                old = json.load(f)
        merge_timings(old["cache"], new["cache"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            json.dump(old, f)
        os.replace(tmp, target)     # never a half-written store, whatever interrupts this
        # autotuning's files map an op to {choice: time}; pad_mm's map a key to one time or flag
        ops += sum(len(v) if isinstance(v, dict) else 1 for v in old["cache"].values())
    return ops


def seed_timings(store: str | None, unit_cache: str) -> None:
    """A unit's inductor cache folder, holding ``store``'s timings (empty where there is none)."""
    os.makedirs(os.path.join(unit_cache, "cache"), exist_ok=True)
    for path in autotune_files(store) if store else []:
        shutil.copy(path, os.path.join(unit_cache, "cache", os.path.basename(path)))


def run(out: str, models: list[str], batches: list[int], gpus: int | list[int], deadline: float, unit_seconds: float,
        size: int, dry_run: bool = False, autotune_cache: str | None = None, host_gpus: int | None = None,
        lib_dir: str | None = None) -> int:
    """Measure the pending units, one per GPU at a time, until none is left or the deadline; returns
    how many finished.  ``gpus``: how many (GPUs 0, 1, ...) or which; ``host_gpus``: the machine's
    GPU count, whose share of the cores each unit gets (default: the GPUs used), so that two runs on
    different GPUs of one host (``--gpu-ids``) do not both take every core."""
    gpus = list(range(gpus)) if isinstance(gpus, int) else list(gpus)
    host_gpus = host_gpus or len(gpus)
    todo = pending(out, models, batches)
    print(f"{len(todo)} of {len(models) * len(batches)} units to measure on {len(gpus)} GPU(s): "
          + ", ".join(f"{m} b{b}" for m, b in todo), flush=True)
    if dry_run:
        for m, b in todo:
            print(" ".join(command(out, m, b, size, lib_dir)))
        return 0
    if not gpus:
        raise SystemExit("no GPU: the goal is measured on one (nvidia-smi lists none)")
    start, running, finished = time.monotonic(), {}, 0
    while todo or running:
        left = deadline - (time.monotonic() - start)
        free = [g for g in gpus if g not in running]
        while todo and free and left >= unit_seconds:
            (m, b), g = todo.pop(0), free.pop(0)
            os.makedirs(unit_dir(out, m, b), exist_ok=True)
            log = open(os.path.join(unit_dir(out, m, b), "log.txt"), "a")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(g), **thread_limits(host_gpus))
            if autotune_cache:
                env["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir(m, b)
                seed_timings(autotune_cache, inductor_dir(m, b))
            proc = subprocess.Popen(command(out, m, b, size, lib_dir), env=env, stdout=log, stderr=log)
            running[g] = (m, b, proc, log)
            print(f"[{time.monotonic() - start:5.0f} s] GPU {g}: {m} batch {b}", flush=True)
        for g, (m, b, proc, log) in list(running.items()):
            if proc.poll() is None and left > 0:
                continue
            if proc.poll() is None:   # past the deadline: interrupt, its rows so far stay in the partial file
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()
            if autotune_cache:
                try:
                    held = f"timings of {save_timings(inductor_dir(m, b), autotune_cache)} ops"
                except Exception as e:  # the timings only save time later: never lose the run to them
                    held = f"timings not saved ({type(e).__name__}: {e})"
                print(f"[{time.monotonic() - start:5.0f} s] autotune {held} in {autotune_cache}", flush=True)
            done = os.path.exists(os.path.join(unit_dir(out, m, b), f"compare_{m}.json"))
            finished += done
            print(f"[{time.monotonic() - start:5.0f} s] GPU {g}: {m} batch {b} "
                  + ("done" if done else f"not finished (exit {proc.returncode}; log.txt)"), flush=True)
            del running[g]
        if not running and (not todo or left < unit_seconds):
            break
        time.sleep(2)
    return finished


def table(out: str) -> dict:
    """Every finished unit of ``out``: ``{"rows": [...], "models": n, "goal_met": [...], ...}``, and goal.md."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*_b*", "compare_*.json"))):
        if path.endswith(".partial.json"):
            continue
        with open(path) as f:
            result = json.load(f)
        for s in result["summary"]:
            best = s.get("best", {})
            int8, torch_best = best.get("tvm_qconv"), best.get("pytorch")
            speedup = (s.get("speedup") or {}).get("pytorch")
            env = result.get("environment") or {}
            rows.append(dict(model=result["model"], batch=s["batch"], date=env.get("date"),
                             device=(env.get("gpu") or {}).get("name") or result.get("device"),
                             int8_ms=int8 and int8["median_ms"], pytorch_ms=torch_best and torch_best["median_ms"],
                             pytorch_best=torch_best and torch_best["name"], speedup=speedup,
                             goal=speedup is not None and speedup >= GOAL,
                             moonshot=speedup is not None and speedup >= MOONSHOT))
    rows.sort(key=lambda r: (r["model"], r["batch"]))
    summary = dict(rows=rows, goal=GOAL, measured=len(rows), goal_met=sum(r["goal"] for r in rows),
                   missed=[f"{r['model']} b{r['batch']}" for r in rows if not r["goal"]])
    lines = ["| model | batch | int8 (ms) | PyTorch's best (ms) | which | speed-up | goal 1.5x | device | date |",
             "|---|---|---|---|---|---|---|---|---|"]
    def ms(v):
        return "-" if v is None else f"{v:.3f}"

    for r in rows:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        verdict = "**yes** (2x)" if r["moonshot"] else "yes" if r["goal"] else "no"
        lines.append(f"| {r['model']} | {r['batch']} | {ms(r['int8_ms'])} | {ms(r['pytorch_ms'])} | "
                     f"{r['pytorch_best'] or '-'} | {speedup} | {verdict} | {r['device'] or '-'} | {r['date'] or '-'} |")
    lines.append(f"\n{summary['goal_met']} of {len(rows)} measured (model, batch) at the goal; missed: "
                 + (", ".join(summary["missed"]) or "none"))
    with open(os.path.join(out, "goal.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "goal.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n".join(lines))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure the pending (model, batch) units on this machine's GPUs")
    r.add_argument("--models", nargs="+", default=list(SIZES), help="zoo models (default: all 16)")
    r.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    r.add_argument("--size", type=int, default=224)
    r.add_argument("--gpus", type=int, default=None, help="default: every GPU nvidia-smi lists")
    r.add_argument("--gpu-ids", type=int, nargs="+", default=None,
                   help="these GPUs only (another job has the others); each unit still gets one GPU's share of the cores")
    r.add_argument("--deadline", type=float, default=540.0, help="seconds this call may run (default 540)")
    r.add_argument("--unit-seconds", type=float, default=420.0,
                   help="start no unit with fewer seconds left than this (default 420: a build and max-autotune)")
    r.add_argument("--dry-run", action="store_true", help="print the commands of the pending units")
    r.add_argument("--autotune-cache", default=None,
                   help="a folder of max-autotune's timings, seeded into each unit and merged back (module docstring)")
    r.add_argument("--lib-dir", default=None,
                   help="prebuilt libraries (<model>_b<batch>.so, from `goal.py build`) the units time "
                        "instead of building")
    r.add_argument("--out", default="results/goal")
    b = sub.add_parser("build", help="build the pending units' libraries into --lib-dir (CPU work, no GPU needed)")
    b.add_argument("--models", nargs="+", default=list(SIZES))
    b.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    b.add_argument("--size", type=int, default=224)
    b.add_argument("--arch", default="sm_90a", help="the GPU's arch (default sm_90a: H100 / H200)")
    b.add_argument("--lib-dir", required=True)
    b.add_argument("--out", default="results/goal", help="the goal folder: its finished units are skipped")
    t = sub.add_parser("table", help="the goal table of the finished units")
    t.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "table":
        table(args.out)
        return 0
    unknown = sorted(set(args.models) - set(SIZES))
    if unknown:
        raise SystemExit(f"not zoo models: {unknown}; the zoo's are {list(SIZES)}")
    if args.cmd == "build":
        return 1 if build(args.out, args.models, args.batches, args.size, args.lib_dir, args.arch) else 0
    if args.gpu_ids is not None:
        gpus, host = args.gpu_ids, max(gpu_count(), max(args.gpu_ids) + 1)
    else:
        gpus = args.gpus if args.gpus is not None else gpu_count()
        host = None
    run(args.out, args.models, args.batches, gpus, args.deadline, args.unit_seconds, args.size, args.dry_run,
        args.autotune_cache, host, args.lib_dir)
    table(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
