"""Where a built model's GPU time goes: every CUDA kernel it launches, timed by CUPTI.

    python benchmarks/kernel_profile.py --model inception_v3 --batch 64 --size 224 --out results/
    python benchmarks/kernel_profile.py --lib build/vgg16.so --out results/   # a library you built

Builds the zoo model (``tvm_qconv.zoo``'s random-init network, calibrated on photos) without
CUDA graphs -- so that each kernel shows -- or loads ``--lib``, runs it ``--runs`` times under
``torch.profiler`` (CUPTI records the kernels of every library in the process, TVM's included)
and prints the kernels by total GPU time with their share, count and the layer family their name
says.  Saves ``kernel_profile_<name>_b<batch>.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.errors import InputError  # noqa: E402
from tvm_qconv.ranges import Calibrate  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402
from tvm_qconv.target import device_arch  # noqa: E402
from tvm_qconv.zoo import SIZES, zoo_config, zoo_model  # noqa: E402


def build(name: str, batch: int, size: int, images: int, out_dir: str, arch: str | None = None,
          families: tuple[str, ...] = ()) -> str:
    """The zoo model ``name`` built without CUDA graphs (``families``: preferred kernel families, as
    ``deploy.py build --family``; they name the library too)."""
    options = BuildOptions(target="cuda", arch=arch or device_arch(full=True), image_size=size, batch=batch,
                           cuda_graph=False, verify=False, families=tuple(families) or None)
    tag = "".join(f"_{f}" for f in families)
    lib = os.path.join(out_dir, f"{name}_b{batch}{tag}_nograph.so")
    compile_model(zoo_model(name), lib, name=name, options=options, config=zoo_config(name, images),
                  ranges=Calibrate(skimage_photos(size)[:images]), progress=False)
    return lib


def profile(lib: str, runs: int) -> dict:
    """{kernel name: (total us, launches)} over ``runs`` calls, and the wall time per call."""
    model = CompiledModel(lib)
    x = np.random.default_rng(0).normal(0, 1, model.input_shape).astype(np.float32)
    model(x)  # warm-up: module load, allocations
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(runs):
            model(x)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / runs
    kernels = collections.defaultdict(lambda: [0.0, 0])
    batch = model.input_shape[0]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name][0] += ev.device_time_total
            kernels[ev.name][1] += 1
    return {"wall_ms_per_call": wall * 1e3, "batch": batch,
            "kernels": {k: (v[0] / runs, v[1] // runs) for k, v in kernels.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a zoo model to build (tvm_qconv.zoo)")
    ap.add_argument("--lib", help="or: a library built with tvm_qconv (best built with --no-cuda-graph)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--images", type=int, default=2, help="calibration images")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="results")
    ap.add_argument("--arch", default=None, help="default: this GPU's, as sm_90a on an H100 / H200 (wgmma)")
    ap.add_argument("--family", action="append", default=[], metavar="FAMILY",
                    help="prefer this kernel family in the build (as deploy.py build --family); repeatable")
    args = ap.parse_args(argv)
    if not (args.model or args.lib):
        ap.error("give --model NAME (a zoo model) or --lib PATH (a built library)")
    os.makedirs(args.out, exist_ok=True)
    if args.model:
        if args.model not in SIZES:
            ap.error(f"--model {args.model}: not a zoo model; choose from {', '.join(SIZES)}, or give --lib")
    try:
        lib = args.lib or build(args.model, args.batch, args.size, args.images, args.out, args.arch, args.family)
        res = profile(lib, args.runs)
    except InputError as err:
        sys.exit(f"error: {err}")
    args.batch = res["batch"]  # a --lib's own batch
    # the input's host -> device copy (a NumPy array each call: ~4-6 ms for 38.5 MB at batch 64,
    # pageable) is not the model's work: kept apart from the kernels' total and shares
    copies = {k: v for k, v in res["kernels"].items() if k.startswith(("Memcpy", "Memset"))}
    total = sum(us for k, (us, _) in res["kernels"].items() if k not in copies)
    rows = sorted(((k, v) for k, v in res["kernels"].items() if k not in copies), key=lambda kv: -kv[1][0])
    name = args.model or os.path.splitext(os.path.basename(lib))[0]
    print(f"{name} batch {args.batch}: {res['wall_ms_per_call']:.3f} ms per call (wall), "
          f"{total / 1e3:.3f} ms of GPU kernels, {sum(n for _, (_, n) in rows)} launches; "
          f"copies {sum(us for us, _ in copies.values()) / 1e3:.3f} ms")
    print("| kernel | us per call | share | launches |\n|---|---|---|---|")
    for k, (us, n) in rows[:args.top]:
        print(f"| {k[:80]} | {us:.1f} | {100 * us / total:.1f}% | {n} |")
    out = os.path.join(args.out, f"kernel_profile_{name}_b{args.batch}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(dict(res, lib=lib, batch=args.batch,
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       device=torch.cuda.get_device_name(0), command=" ".join(sys.argv), total_us=total),
                  f, indent=1)
    os.replace(out + ".tmp", out)
    print("saved", out)


if __name__ == "__main__":
    main()
