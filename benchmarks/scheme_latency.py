"""Latency of two quantization schemes side by side on the GPU: does the default scheme cost time?

    python benchmarks/scheme_latency.py --models vgg16 resnet50 --batches 1 64 --tuning-logs tuning_logs \
        --out results/                         # the default scheme against the symmetric one (before 2026-12-07)

Each model (random init, seed 0) is built for ``cuda`` ``--arch`` with CUDA graphs and the committed
tuning database of each batch, as ``deploy.py compare`` builds its int8 rows, once per scheme:
``symmetric`` (every activation symmetric, no bias correction: the default until issue 58) and
``default`` (``QuantConfig()``: unsigned activations and bias correction where calibrated).  Both
are calibrated on scikit-image's photos.  Each library is then timed (TVM's time_evaluator, median
of ``--repeat`` runs of ``--number`` calls), the schemes alternating ``--rounds`` times so that a
drift of the GPU's clocks falls on both.  Writes ``<out>/scheme_latency.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.compare.run import tuning_log_for  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402

SCHEMES = {"symmetric": QuantConfig(unsigned_activations=False, bias_correction=False), "default": QuantConfig()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--tuning-logs", default="tuning_logs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--number", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []

    def save():     # after every row: a run cut short keeps what it measured
        record = dict(date=started, command="python benchmarks/scheme_latency.py " + " ".join(argv or sys.argv[1:]),
                      device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.machine(),
                      rows=rows)
        with open(os.path.join(args.out, "scheme_latency.json.tmp"), "w") as f:
            json.dump(record, f, indent=1)
        os.replace(os.path.join(args.out, "scheme_latency.json.tmp"), os.path.join(args.out, "scheme_latency.json"))

    for name in args.models:
        torch.manual_seed(0)
        model = load_model(name)
        for batch in args.batches:
            photos = skimage_photos(224)
            x = np.concatenate([photos] * (batch // len(photos) + 1))[:batch]
            log = tuning_log_for(args.tuning_logs, name, batch, args.arch)
            libs, build_s = {}, {}
            for scheme, config in SCHEMES.items():
                t = time.perf_counter()
                res = compile_model(model, os.path.join(args.out, f"{name}-b{batch}-{scheme}.so"), config=config,
                                    options=BuildOptions(target="cuda", arch=args.arch, batch=batch, tuning_log=log,
                                                         cuda_graph=True, verify=False), name=name, progress=False)
                build_s[scheme] = round(time.perf_counter() - t, 1)
                libs[scheme] = CompiledModel(res.lib_path)
            ms = {scheme: [] for scheme in SCHEMES}
            for _ in range(args.rounds):
                for scheme, lib in libs.items():
                    ms[scheme].append(lib.benchmark(x, number=args.number, repeat=args.repeat)["median_ms"])
            row = dict(model=name, batch=batch, tuning_log=log, build_s=build_s,
                       median_ms={s: float(np.median(v)) for s, v in ms.items()}, rounds_ms=ms)
            rows.append(row)
            save()
            print(f"{name} b{batch}: " + ", ".join(f"{s} {row['median_ms'][s]:.3f} ms" for s in SCHEMES), flush=True)
    print("| model | batch | symmetric ms | default ms | default / symmetric |\n|---|---|---|---|---|")
    for r in rows:
        a, b = r["median_ms"]["symmetric"], r["median_ms"]["default"]
        print(f"| {r['model']} | {r['batch']} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
