"""Which quantization scheme is best on trained networks, scored on labelled photos the calibration
never saw (issue 58, item 1).

    python benchmarks/scheme_heldout.py --out results/                          # every scheme, MobileNet-V2 + Lite0
    python benchmarks/scheme_heldout.py --models efficientnet_lite1 efficientnet_lite2 --jobs 4 --out results/
    python benchmarks/scheme_heldout.py --schemes percentile percentile+unsigned+gptq --out results/

Each model is built for ``llvm`` as ``deploy.py build`` builds it (calibrated on scikit-image's
photos, the default range source) under each scheme, then evaluated on foolbox's 20 labelled
ImageNet photos (``deploy.py eval --data``) beside its float model: logits SQNR against float, and
top-1 agreement with float.  A CUDA library of the same plan computes the same integers
(``docs/performance.md``), so the CPU's figures are the GPU's.  **Twenty photos are a smoke test
for top-1** (one photo is 5 points); the SQNR over 20 x 1000 logits is the steadier figure.

A scheme is ``default`` (``QuantConfig()``, what ``deploy.py build`` does) or
``<observer>[+unsigned][+gptq|+bias]``: the observer (``QuantConfig.calibration``:
percentile, max, entropy, mse, search), unsigned activations after ReLU / ReLU6, and GPTQ weight
rounding or bias correction.  Builds run in worker processes (``--jobs``).  Writes
``<out>/scheme_heldout.json`` and prints a markdown table, best scheme first per model.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv import pip_assets  # noqa: E402
from tvm_qconv.config import CALIBRATIONS, QuantConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LITE = os.path.join(ROOT, "tvm_qconv", "models", "efficientnet_lite.py")
MODELS = {"mobilenet_v2": 224, **{f"efficientnet_lite{v}": s for v, s in pip_assets.EFFICIENTNET_LITE_SIZES.items()}}
ROUNDINGS = ("", "+gptq", "+bias")


def all_schemes() -> list[str]:
    return ["default"] + [f"{obs}{uns}{rnd}" for obs, uns, rnd in
                          itertools.product(CALIBRATIONS, ("", "+unsigned"), ROUNDINGS)]


def scheme_config(scheme: str) -> QuantConfig:
    """``percentile+unsigned+gptq`` -> its QuantConfig, every field named (a flag left out is off);
    ``default``: ``QuantConfig()`` as it is."""
    if scheme == "default":
        return QuantConfig()
    observer, *flags = scheme.split("+")
    unknown = set(flags) - {"unsigned", "gptq", "bias", "eq"}
    if observer not in CALIBRATIONS or unknown:
        raise SystemExit(f"scheme {scheme!r}: <observer>[+unsigned][+eq][+gptq|+bias], observer one of {CALIBRATIONS}")
    return QuantConfig(calibration=observer, unsigned_activations="unsigned" in flags,
                       weight_rounding="gptq" if "gptq" in flags else "nearest", bias_correction="bias" in flags,
                       equalization="eq" in flags)


def load(model: str):
    from tvm_qconv.frontend import load_model
    if model == "mobilenet_v2":
        return load_model("mobilenet_v2", pip_assets.mobilenet_v2_weights())
    return load_model(f"{LITE}:lite{model[-1]}")


def one(model: str, scheme: str, out: str) -> dict:
    """Build ``model`` under ``scheme`` and evaluate it on the held-out labelled photos."""
    import torch
    torch.set_num_threads(1)     # the workers share the machine's cores
    from tvm_qconv.build import BuildOptions, compile_model
    from tvm_qconv.evaluate import evaluate_folder

    data, labels = pip_assets.foolbox_imagenet()
    float_model = load(model)
    lib = os.path.join(out, "libs", f"{model}-{scheme}.so")
    t0 = time.time()
    res = compile_model(float_model, lib, options=BuildOptions(target="llvm", image_size=MODELS[model]),
                        config=scheme_config(scheme), name=model, progress=False)
    build_s = time.time() - t0
    ev = evaluate_folder(res.lib_path, data, labels=labels, float_model=float_model, progress=False)
    verify = res.report.get("verify", {})
    return {"model": model, "scheme": scheme, "image_size": MODELS[model], "images": ev["images"],
            "logits_sqnr_db": round(ev["logits_sqnr_db"], 2), "top1_agreement": ev["top1_agreement"],
            "float_top1": ev["float"]["top1"], "int8_top1": ev["int8"]["top1"],
            "calibration_heldout_sqnr_db": verify.get("sqnr_db"), "build_s": round(build_s, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| model | scheme | held-out logits SQNR (dB) | top-1 agreement | int8 / float top-1 | build s |",
             "|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for r in sorted((r for r in rows if r["model"] == model), key=lambda r: -r["logits_sqnr_db"]):
            lines.append(f"| {model} | {r['scheme']} | {r['logits_sqnr_db']:.2f} | {r['top1_agreement']:.0f} % | "
                         f"{r['int8_top1']:.0f} / {r['float_top1']:.0f} % | {r['build_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for scheme_heldout.json (and the libraries, in libs/)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["mobilenet_v2", "efficientnet_lite0"])
    p.add_argument("--schemes", nargs="+", default=None, help="default: every <observer>[+unsigned][+gptq|+bias]")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = p.parse_args(argv)
    schemes = args.schemes or all_schemes()
    for s in schemes:
        scheme_config(s)    # a bad name before any work
    os.makedirs(os.path.join(args.out, "libs"), exist_ok=True)
    pip_assets.foolbox_imagenet()           # fetched once, before the workers read the cache
    for m in args.models:
        load(m)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, failed = [], []
    path = os.path.join(args.out, "scheme_heldout.json")

    def save():     # after every build: a run cut short keeps what it measured
        record = {"date": started, "command": "python benchmarks/scheme_heldout.py " + " ".join(argv or sys.argv[1:]),
                  "device": f"{platform.machine()}, {os.cpu_count()} cores", "calibration": "scikit-image's photos",
                  "held_out": "foolbox 3.3.4's 20 labelled ImageNet photos", "rows": rows, "failed": failed}
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(one, m, s, args.out): (m, s) for m in args.models for s in schemes}
        for f in concurrent.futures.as_completed(futures):
            m, s = futures[f]
            try:
                rows.append(f.result())
                print(f"{m} {s}: {rows[-1]['logits_sqnr_db']:.2f} dB, agreement {rows[-1]['top1_agreement']:.0f} %",
                      flush=True)
            except Exception as err:    # one scheme's failure is a row, not the end of the run
                failed.append({"model": m, "scheme": s, "error": f"{type(err).__name__}: {err}"[:300]})
                print(f"{m} {s}: FAILED {failed[-1]['error']}", flush=True)
            save()
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
