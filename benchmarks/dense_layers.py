"""Per-layer speed of each int8 dense (linear) kernel on the classifiers' layers, by batch size.

    python benchmarks/dense_layers.py --batches 1 2 4 8 16 32 64 --out results/

For VGG16's three classifier layers and ResNet-50's, at each batch size, builds each dense
implementation of the registry for this GPU -- ``dense.rows.generic`` (dlight's GEMV / SIMT
matmul rules, as the Relax CUDA pipeline applies them: ``registry.compile_kernel``) and ``dense.rows.mma`` (int8 tensor cores),
the latter also below the batch where the registry picks it, which is what this measures --
checks each output against the NumPy reference (float out: the int32 accumulation is exact, so
the two may differ only by the epilogue's float rounding), times it (TVM ``time_evaluator``,
median of 7 repeats of >= 40 ms) and reports ms and the weight stream's GB/s (the layer's floor at
small batch is reading its weights once).  Writes ``<out>/dense_layers.json``, prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import tvm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import build_all  # noqa: E402
from tvm_qconv import registry  # noqa: E402
from tvm_qconv.schedules.dense_int8 import DenseWorkload  # noqa: E402
from tvm_qconv.target import TargetInfo, device_arch, make_target  # noqa: E402

# (name, in_features, out_features, ReLU after it)
LAYERS = [("vgg16.fc6", 25088, 4096, True), ("vgg16.fc7", 4096, 4096, True), ("vgg16.fc8", 4096, 1000, False),
          ("resnet50.fc", 2048, 1000, False)]
IMPLS = ("dense.rows.generic", "dense.rows.mma")
# |got - reference| allowed, relative to the output's largest magnitude: the accumulation is exact
# int32, the epilogue one float multiply-add (FMA-contracted or not: ~1 ulp)
RTOL = 1e-6


def workload(layer, batch):
    _, k, o, relu = layer
    return DenseWorkload(batch=batch, in_features=k, out_features=o, clip=(0.0, float("inf")) if relu else None)


def build(job) -> float:
    """Build one (layer, batch, implementation) to ``path``; returns the build seconds."""
    layer, batch, name, arch, path = job
    t = time.time()
    registry.compile_kernel(registry.get(name), workload(layer, batch), make_target("cuda", arch)).export_library(path)
    return time.time() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="results")
    ap.add_argument("--arch", default=None, help="default: this GPU's")
    args = ap.parse_args(argv)
    arch = args.arch or device_arch(full=True)
    libdir = os.path.join(args.out, "dense_layers_libs")
    os.makedirs(libdir, exist_ok=True)
    jobs = [(layer, b, name, arch, os.path.join(libdir, f"{name}_{layer[0]}_b{b}.so"))
            for b in args.batches for layer in LAYERS for name in IMPLS]
    build_s = build_all(build, jobs, args.jobs)

    dev = tvm.cuda(0)
    rows = []
    for (layer, b, name, _, path), secs_build in zip(jobs, build_s):
        impl, wl = registry.get(name), workload(layer, b)
        rng = np.random.default_rng(0)  # the same layer data for every implementation
        _, k, o, _ = layer
        x = rng.integers(-128, 128, (b, k)).astype(np.int8)
        w = rng.integers(-127, 128, (o, k)).astype(np.int8)
        scale = (rng.uniform(0.5, 2, o) / (128 * 127 * np.sqrt(k))).astype(np.float32)
        bias = rng.standard_normal(o).astype(np.float32)
        params = impl.pack_params(wl, w, scale, bias)
        xp = np.zeros((b, impl.in_features_padded(wl)), np.int8)
        xp[:, :k] = x
        want = impl.reference(wl, xp, *params)
        lib = tvm.runtime.load_module(path)
        tensors = [tvm.runtime.tensor(a, dev) for a in [xp, *params, np.full((b, o), np.nan, np.float32)]]
        lib["main"](*tensors)
        got = tensors[-1].numpy()
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        secs = lib.time_evaluator("main", dev, number=10, repeat=7, min_repeat_ms=40)(*tensors).median
        row = dict(layer=layer[0], in_features=k, out_features=o, batch=b, impl=name, family=impl.family,
                   picked=registry.select("dense", wl, _target_info(arch)).name == name,
                   ms=secs * 1e3, weight_gb_s=o * k / secs / 1e9, tops=2 * b * o * k / secs / 1e12,
                   max_rel_err=err, exact=err <= RTOL, build_s=secs_build)
        rows.append(row)
        print(f"{layer[0]:>12} b{b:<3} {name:>20}: {row['ms']:8.4f} ms {row['weight_gb_s']:7.0f} GB/s"
              + ("" if row["exact"] else f"  MISMATCH ({err:.2g})"), flush=True)
    res = dict(device=dev.device_name, arch=arch, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command="python " + " ".join(sys.argv), rows=rows)
    with open(os.path.join(args.out, "dense_layers.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| layer | batch | " + " | ".join(f"{n} ms" for n in IMPLS) + " | registry picks |\n|---|---|"
          + "---|" * (len(IMPLS) + 1))
    for layer in LAYERS:
        for b in args.batches:
            mine = {r["impl"]: r for r in rows if r["layer"] == layer[0] and r["batch"] == b}
            picked = next((n for n, r in mine.items() if r["picked"]), "-")
            print(f"| {layer[0]} | {b} | " + " | ".join(f"{mine[n]['ms']:.4f}" for n in IMPLS) + f" | {picked} |")
    if any(not r["exact"] for r in rows):
        sys.exit("error: some kernels disagree with the reference (MISMATCH above)")
    return res


def _target_info(arch):
    return TargetInfo.from_target(make_target("cuda", arch))


if __name__ == "__main__":
    main()
