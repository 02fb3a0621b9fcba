"""Each calibration method (and bias correction) on photos it did not see: logits SQNR of the int8
library (llvm) against float PyTorch on held-out photos, and on the calibration photos.

    python benchmarks/calibration_heldout.py --models mobilenet_v2 vgg16 --size 64 --out results/
    python benchmarks/calibration_heldout.py --models mobilenet_v2 --weights mobilenet_v2-b0353104.pth \
        --size 224 --methods percentile max entropy mse search --out results/      # trained weights

The zoo's SQNR (``benchmarks/zoo.py``) is measured on the calibration photos themselves; a method
that chooses ranges by the logits they give (``search``) could fit those few photos.  Here every
model (the zoo test's random-init networks) is calibrated on the first ``--calib`` of
scikit-image's photos and measured on the rest.  Builds run in parallel worker processes
(``--jobs``).  ``--weights`` loads a state-dict file (e.g. torchvision's ImageNet weights) into
the model instead of the random init; ``--weight-rounding both`` builds each with GPTQ too (fitted
on the calibration photos like the ranges).  Writes ``<out>/calibration_heldout.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.zoo import model_size  # noqa: E402
from tvm_qconv.zoo import zoo_model  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.config import CALIBRATIONS, QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402
from tvm_qconv.ranges import Calibrate  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402


def measure(arg) -> dict:
    """One (model, method): build for llvm at batch 1 from the calibration photos, then the
    logits SQNR and top-1 agreement against float PyTorch on the held-out photos."""
    name, method, size, calib, workdir, weights, correct, unsigned, rounding = arg
    size = model_size(name, size)
    photos = skimage_photos(size)
    model = load_model(name, weights) if weights else zoo_model(name)
    lib = os.path.join(workdir, f"{name}_{method}{'_bc' if correct else ''}{'_u8' if unsigned else ''}_{rounding}.so")
    t = time.perf_counter()
    res = compile_model(model, lib, options=BuildOptions(image_size=size, verify=False),
                        config=QuantConfig(calibration=method, num_calib_images=calib, bias_correction=correct,
                                           unsigned_activations=unsigned, weight_rounding=rounding),
                        ranges=Calibrate(photos[:calib]), progress=False)
    build_s = time.perf_counter() - t
    with torch.no_grad():
        ref = model(torch.from_numpy(photos)).numpy()
    lib_model = CompiledModel(lib)
    got = np.concatenate([lib_model(x[None]) for x in photos])
    held = slice(calib, None)
    row = dict(model=name, weights=weights or "random init (the zoo test's)", method=method,
               bias_correction=correct, unsigned_activations=unsigned, weight_rounding=rounding, size=size, calib_images=calib, heldout_images=len(photos) - calib,
               sqnr_db=round(sqnr_db(ref[held], got[held]), 2),
               top1_agree=float((ref[held].argmax(1) == got[held].argmax(1)).mean()),
               sqnr_calib_db=round(sqnr_db(ref[:calib], got[:calib]), 2),
               top1_agree_calib=float((ref[:calib].argmax(1) == got[:calib].argmax(1)).mean()),
               build_s=round(build_s, 1))
    search = res.report.get("ranges", {}).get("search")
    if search:
        row["search"] = {k: v for k, v in search.items() if k != "choices"}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vgg16", "resnet50", "mobilenet_v2", "efficientnet_b0",
                                                     "shufflenet_v2_x1_0", "googlenet", "inception_v3"])
    ap.add_argument("--methods", nargs="+", default=["percentile", "mse", "search"], choices=CALIBRATIONS)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--calib", type=int, default=8, help="calibration photos (the rest are held out)")
    ap.add_argument("--weights", help="a state-dict file for the model(s), e.g. torchvision's trained weights")
    ap.add_argument("--bias-correction", choices=["off", "on", "both"], default="off",
                    help="build each method without it, with it, or both")
    ap.add_argument("--unsigned", choices=["off", "on", "both"], default="off",
                    help="QuantConfig.unsigned_activations: off, on, or a build of each")
    ap.add_argument("--weight-rounding", choices=["nearest", "gptq", "both"], default="nearest",
                    help="QuantConfig.weight_rounding: nearest, gptq, or a build of each (gptq is not combined with "
                         "bias correction)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    n = len(skimage_photos(32))
    if not 1 <= args.calib < n:
        sys.exit(f"error: --calib must leave held-out photos: 1 <= --calib < {n}")
    os.makedirs(args.out, exist_ok=True)
    workdir = os.path.join(args.out, "calibration_heldout_libs")
    os.makedirs(workdir, exist_ok=True)
    if args.weights and not os.path.isfile(args.weights):
        sys.exit(f"error: --weights {args.weights}: no such file")
    corrections = {"off": [False], "on": [True], "both": [False, True]}[args.bias_correction]
    unsigned = {"off": [False], "on": [True], "both": [False, True]}[args.unsigned]
    roundings = {"nearest": ["nearest"], "gptq": ["gptq"], "both": ["nearest", "gptq"]}[args.weight_rounding]
    jobs = [(m, c, args.size, args.calib, workdir, args.weights, bc, u, r)
            for m in args.models for c in args.methods for bc in corrections for u in unsigned for r in roundings
            if not (bc and r == "gptq")]
    rows = []
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(measure, jobs):
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="python " + " ".join(sys.argv),
               seconds=round(time.perf_counter() - t0), rows=rows)
    with open(os.path.join(args.out, "calibration_heldout.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| model | size | method | bias correction | unsigned | weights | held-out SQNR dB (top-1) | calibration photos "
          "SQNR dB (top-1) | search: simulated start -> end |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r.get("search")
        print(f"| {r['model']} | {r['size']} | {r['method']} | {'on' if r['bias_correction'] else 'off'} | "
              f"{'on' if r['unsigned_activations'] else 'off'} | {r['weight_rounding']} | "
              f"{r['sqnr_db']:.1f} ({r['top1_agree']:.0%}) | {r['sqnr_calib_db']:.1f} ({r['top1_agree_calib']:.0%}) | "
              + (f"{s['sqnr_start_db']} -> {s['sqnr_db']}" if s else "-") + " |")
    return res


if __name__ == "__main__":
    main()
