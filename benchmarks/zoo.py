"""Every torchvision classifier of the zoo through the compiler: int8 layers, what stays float,
logits SQNR against float PyTorch per calibration method, build time; on a GPU also the latency
of the int8 library (batch 1 and 64, Relax CUDA graphs) beside PyTorch fp16 with CUDA graphs (bf16 for a
model whose fp16 output overflows; the row's ``torch_dtype_b<N>`` says so).

    python benchmarks/zoo.py --size 64 --calibrations percentile max entropy mse --out results/
    python benchmarks/zoo.py --models mobilenet_v2 --per-layer --out results/          # where it is lost
    python benchmarks/zoo.py --target cuda --size 224 --batches 1 64 --jobs 8 --out results/   # on the GPU
    python benchmarks/zoo.py --target cuda --arch sm_90a --size 224 --batches 1 64 --no-verify-builds \
        --tuning-logs zoo_logs --tune --jobs 8 --out results/       # + tuned: every family's default, wgmma tiles

The models are the zoo's (``tvm_qconv.zoo``: random init, last layer's bias zeroed,
GoogLeNet with PyTorch's default init), calibrated on scikit-image's photos; SQNR is the build's
own verification (logits on the calibration photos).  With ``--tuning-logs DIR`` each timed model
is also built and timed with its database ``DIR/<model>-b<batch>-<arch>`` where there is one;
``--tune`` first tunes each (``tune.py``'s ``--trials 1``: each kernel family's default
schedule and every wgmma tile measured once per layer, one model after another on the GPU; a
database already finished measures nothing, one a cut-short run left is resumed).  Writes
``<out>/zoo_<target>.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_gpu import torch_latency  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.compare.baselines import NonFiniteOutput  # noqa: E402
from tvm_qconv.compare.run import tuning_log_for  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.ranges import Calibrate  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402
from tvm_qconv.tuning import tune_model  # noqa: E402
from tvm_qconv.zoo import SIZES, zoo_model  # noqa: E402


def torch_half_graph_ms(model, x) -> tuple[float, str]:
    """PyTorch fp16 channels_last with CUDA graphs, median ms; a model whose fp16 output overflows
    (random-init Inception-V3: activations reach 1.6e12) is timed in bf16, which runs at the same
    tensor-core rate on Ampere and Hopper.  Returns (ms, the dtype timed)."""
    for dtype in (torch.float16, torch.bfloat16):
        m = model.to("cuda", dtype).to(memory_format=torch.channels_last).eval()
        xt = torch.from_numpy(x).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
        try:
            return torch_latency(m, xt, graphs=True), str(dtype).removeprefix("torch.")
        except NonFiniteOutput:
            if dtype == torch.bfloat16:
                raise


def time_interleaved(libs: dict, x, rounds: int) -> dict:
    """Median ms of each library (Relax CUDA graphs, ``time_evaluator``), timed in turn for
    ``rounds`` rounds and the median of the rounds' medians kept: the default and the tuned
    build of a model see the same machine.  Timed one after the other (H100, 2026-11-26, a host
    whose other GPUs were building), two identical libraries differed by up to 8 %."""
    loaded = {kind: CompiledModel(path) for kind, path in libs.items()}
    number = 10 if x.shape[0] == 1 else 3
    ms = {kind: [] for kind in loaded}
    for _ in range(rounds):
        for kind, lib in loaded.items():
            ms[kind].append(lib.benchmark(x, number=number, repeat=10)["median_ms"])
    return {kind: float(np.median(v)) for kind, v in ms.items()}


def model_size(name: str, size: int) -> int:
    """The image size ``name`` is built at for ``--size``: Inception-V3 needs >= 75 px (96)."""
    return max(size, 96) if name == "inception_v3" else size


def _build(arg) -> dict:
    """One build in a worker process: ("verify", ...) is the calibrated build with its verification,
    ("time", ..., batch) the CUDA-graph library that the parent process times."""
    (kind, name, calibration, bs, floor), target, arch, size, images, unsigned = arg
    size = model_size(name, size)
    photos = skimage_photos(size)[:images]
    if kind == "verify":
        options = BuildOptions(target=target, arch=arch, image_size=size, **floor)
        lib = f"/tmp/tvm_qconv_zoo/{name}_{calibration}.so"
    else:  # "time" (default schedules) or "tuned" (floor holds its tuning_log)
        options = BuildOptions(target="cuda", arch=arch, image_size=size, batch=bs, cuda_graph=True, verify=False,
                               **floor)
        lib = f"/tmp/tvm_qconv_zoo/{name}_b{bs}_{kind}.so"
    t = time.time()
    res = compile_model(zoo_model(name), lib, name=name, progress=False, options=options,
                        config=QuantConfig(calibration=calibration, num_calib_images=images,
                                           unsigned_activations=unsigned),
                        ranges=Calibrate(photos))
    layers = res.report["layers"]
    return dict(build_s=round(time.time() - t, 1), lib_path=res.lib_path, verify=res.report.get("verify", {}),
                int8_layers=f"{sum(r['dtype'] == 'int8' for r in layers)}/{len(layers)}",
                float_ops=res.report["float_ops"])


def tune_all(args) -> dict:
    """Tune, one after another on this GPU, every (model, batch) of the run into
    ``args.tuning_logs`` (``--trials 1``; a database a cut-short run left is resumed, a finished
    one measures nothing).  Returns the seconds each took, None where it failed."""
    seconds = {}
    for name in args.models:
        for bs in args.batches:
            t = time.time()
            try:
                tune_model(name, bs, arch=args.arch, trials_per_task=1, image_size=model_size(name, args.size),
                           max_workers=args.tune_workers, model=zoo_model(name),
                           work_dir=os.path.join(args.tuning_logs, f"{name}-b{bs}-{args.arch}"))
            except Exception as err:  # noqa: BLE001 - one model's failure is a result, not the end of the run
                print(f"TUNING FAILED {name} b{bs}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                seconds[(name, bs)] = None
                continue
            seconds[(name, bs)] = round(time.time() - t, 1)
            print(f"tuned {name} b{bs} in {seconds[(name, bs)]} s", flush=True)
    return seconds


def _save(args, rows) -> list:
    """Write what has been measured so far (a run cut short keeps its rows)."""
    rows = [r for r in (rows.values() if isinstance(rows, dict) else rows) if len(r) > 2]
    out = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               target=args.target, arch=args.arch, rows=rows)
    with open(os.path.join(args.out, f"zoo_{args.target}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SIZES))
    ap.add_argument("--size", type=int, default=64, help="image size (inception_v3: at least 96)")
    ap.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    ap.add_argument("--arch", default=None)
    ap.add_argument("--calibrations", nargs="+", default=["percentile"])
    ap.add_argument("--images", type=int, default=4, help="calibration images")
    ap.add_argument("--per-layer", action="store_true",
                    help="also record each int8 layer's SQNR against float (the verification's report)")
    ap.add_argument("--batches", type=int, nargs="+", default=[], help="(cuda) also time these batch sizes")
    ap.add_argument("--jobs", type=int, default=1, help="builds in parallel (timings always run alone)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for all builds; then time what was built and drop the rest")
    ap.add_argument("--no-verify-builds", action="store_true",
                    help="(cuda) only the timed libraries: skip the calibration-method builds and their SQNR")
    ap.add_argument("--tuning-logs", default=None, metavar="DIR",
                    help="(cuda) also time each model with its database DIR/<model>-b<batch>-<arch>, where there is one")
    ap.add_argument("--tune", action="store_true",
                    help="(with --tuning-logs) first tune every model there (tune.py --trials 1; finished ones are "
                         "skipped, cut-short ones resumed)")
    ap.add_argument("--tune-workers", type=int, default=None,
                    help="(with --tune) parallel candidate builds of each tuning (default: all CPU cores)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="(cuda) a model's default and tuned libraries are timed in turn this many times")
    ap.add_argument("--unsigned-activations", action="store_true",
                    help="QuantConfig.unsigned_activations (never-negative tensors at zero point -128)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if (args.tune or args.tuning_logs) and (args.target != "cuda" or not args.batches):
        ap.error("--tuning-logs / --tune time tuned GPU libraries: give --target cuda and --batches")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1")
    if args.tune_workers is not None and args.tune_workers < 1:
        ap.error(f"--tune-workers {args.tune_workers}: give at least 1 (or leave it out: all CPU cores)")
    if args.tune and not args.tuning_logs:
        ap.error("--tune writes into --tuning-logs DIR: give the folder")
    if args.tuning_logs and not os.path.isdir(args.tuning_logs):
        if not args.tune:
            ap.error(f"--tuning-logs {args.tuning_logs}: no such folder (--tune makes it)")
        os.makedirs(args.tuning_logs)
    if args.target == "cuda" and args.arch is None:
        major, minor = torch.cuda.get_device_capability(0)
        args.arch = f"sm_{major}{minor}"
    tune_s = tune_all(args) if args.tune else {}
    # a floor no build reaches makes the verification report every layer's SQNR
    floor = dict(verify_floor_db=float("inf")) if args.per_layer else {}
    jobs = [("verify", name, calibration, None, floor) for name in args.models for calibration in args.calibrations]
    if args.target == "cuda" and args.no_verify_builds:
        jobs = []
    jobs += [("time", name, "percentile", bs, {}) for name in args.models for bs in args.batches]
    for name in args.models if args.target == "cuda" else ():
        for bs in args.batches:
            log = tuning_log_for(args.tuning_logs, name, bs, args.arch)
            if log and tune_s.get((name, bs), 0) is not None:  # a run that failed here leaves a partial one
                jobs.append(("tuned", name, "percentile", bs, dict(tuning_log=log)))
    # builds run in parallel worker processes; every timing runs afterwards, alone on the GPU
    rows = {name: dict(model=name, size=model_size(name, args.size)) for name in args.models}
    built = {}
    start = time.time()
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(_build, (job, args.target, args.arch, args.size, args.images, args.unsigned_activations)): i
               for i, job in enumerate(jobs)}
    try:
        for fut in concurrent.futures.as_completed(futures, timeout=args.deadline):
            try:
                built[futures[fut]] = fut.result()
            except Exception as err:  # noqa: BLE001 - one model's failure is a result, not the end of the run
                text = str(err)
                log_path = os.path.join(args.out, f"error_{'_'.join(map(str, jobs[futures[fut]][1:4]))}.txt")
                with open(log_path, "w") as f:
                    f.write(text)
                rows[jobs[futures[fut]][1]].setdefault("errors", []).append(
                    f"{jobs[futures[fut]][0]} b{jobs[futures[fut]][3]}: {type(err).__name__}: {text[:300]}")
                print(f"FAILED {jobs[futures[fut]][:4]}: {type(err).__name__} (log: {log_path})", flush=True)
                continue
            print(f"built {jobs[futures[fut]][:4]} in {built[futures[fut]]['build_s']} s", flush=True)
    except concurrent.futures.TimeoutError:
        print(f"deadline: {len(jobs) - len(built)} builds not done after {time.time() - start:.0f} s; "
              "timing what was built", flush=True)
        processes = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            proc.kill()  # the builds still running: their results would come too late
    pool.shutdown(wait=False)
    timed = collections.defaultdict(dict)  # (model, batch) -> {"time" | "tuned": build result}
    for i, (kind, name, calibration, bs, _) in enumerate(jobs):
        if i not in built:
            continue
        res, row = built[i], rows[name]
        if kind == "verify":
            row.setdefault("build_s", res["build_s"])
            row["int8_layers"], row["float_ops"] = res["int8_layers"], res["float_ops"]
            row[f"sqnr_{calibration}"] = res["verify"].get("logits_sqnr_db")
            if args.per_layer:
                row[f"layers_{calibration}"] = {r["layer"]: round(r["sqnr_db"], 1) for r in res["verify"]["layers"]}
            continue
        row.setdefault("int8_layers", res["int8_layers"])
        timed[(name, bs)][kind] = res
    for (name, bs), libs in timed.items():
        row = rows[name]
        photos_b = np.concatenate([skimage_photos(row["size"])] * (-(-bs // 15)))[:bs]
        try:
            ms = time_interleaved({kind: res["lib_path"] for kind, res in libs.items()}, photos_b, args.rounds)
        except Exception as err:  # noqa: BLE001 - a library that does not run is this row's result
            row.setdefault("errors", []).append(f"timing b{bs}: {type(err).__name__}: {str(err)[:300]}")
            print(f"FAILED timing {name} b{bs}: {type(err).__name__}", flush=True)
            _save(args, rows)
            continue
        if "tuned" in ms:
            row[f"int8_tuned_b{bs}_ms"] = ms["tuned"]
            row[f"tune_b{bs}_s"] = tune_s.get((name, bs))
        if "time" in ms:
            row[f"build_b{bs}_s"] = libs["time"]["build_s"]
            row[f"int8_b{bs}_ms"] = ms["time"]
            try:
                half_ms, dtype = torch_half_graph_ms(zoo_model(name), photos_b)
                row[f"torch_fp16_graph_b{bs}_ms"] = half_ms
                if dtype != "float16":
                    row[f"torch_dtype_b{bs}"] = dtype  # fp16 overflowed: timed in this type instead
            except Exception as err:  # noqa: BLE001 - the int8 figures stand without PyTorch's
                row.setdefault("errors", []).append(f"pytorch b{bs}: {type(err).__name__}: {str(err)[:300]}")
        print(json.dumps(row), flush=True)
        _save(args, rows)
    rows = _save(args, rows)
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r if k.startswith(("sqnr_", "int8_b", "int8_tuned_b", "torch_"))))
    print("| model | size | int8 layers | float ops | build s | " + " | ".join(cols) + " |")
    print("|---" * (5 + len(cols)) + "|")
    for r in rows:
        fl = ", ".join(f"{k.removeprefix('relax.')} x{v}" for k, v in sorted(r.get("float_ops", {}).items()))
        print(f"| {r['model']} | {r['size']} | {r.get('int8_layers')} | {fl} | {r.get('build_s', r.get('build_b1_s'))} | "
              + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
