"""Every torchvision classifier of the zoo test through the compiler: int8 layers, what stays float,
logits SQNR against float PyTorch per calibration method, build time; on a GPU also the latency
of the int8 library (batch 1 and 64, Relax CUDA graphs) beside PyTorch fp16 with CUDA graphs.

    python benchmarks/zoo.py --size 64 --calibrations percentile max entropy mse --out results/
    python benchmarks/zoo.py --models mobilenet_v2 --per-layer --out results/          # where it is lost
    python benchmarks/zoo.py --target cuda --size 224 --batches 1 64 --out results/      # on the GPU

The models are the zoo test's (``tests/test_zoo.py``: random init, last layer's bias zeroed,
GoogLeNet with PyTorch's default init), calibrated on scikit-image's photos; SQNR is the build's
own verification (logits on the calibration photos).  Writes ``<out>/zoo_<target>.json`` and
prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_zoo import ZOO, zoo_model  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.ranges import Calibrate  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402


def torch_fp16_graph_ms(model, x) -> float:
    from benchmarks.model_gpu import torch_latency
    m = model.to("cuda", torch.float16).to(memory_format=torch.channels_last).eval()
    return torch_latency(m, torch.from_numpy(x).to("cuda", torch.float16).contiguous(memory_format=torch.channels_last),
                         graphs=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(ZOO))
    ap.add_argument("--size", type=int, default=64, help="image size (inception_v3: at least 96)")
    ap.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    ap.add_argument("--arch", default=None)
    ap.add_argument("--calibrations", nargs="+", default=["percentile"])
    ap.add_argument("--images", type=int, default=4, help="calibration images")
    ap.add_argument("--per-layer", action="store_true",
                    help="also record each int8 layer's SQNR against float (the verification's report)")
    ap.add_argument("--batches", type=int, nargs="+", default=[], help="(cuda) also time these batch sizes")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.target == "cuda" and args.arch is None:
        major, minor = torch.cuda.get_device_capability(0)
        args.arch = f"sm_{major}{minor}"
    # a floor no build reaches makes the verification report every layer's SQNR
    floor = dict(verify_floor_db=float("inf")) if args.per_layer else {}
    rows = []
    for name in args.models:
        size = max(args.size, 96) if name == "inception_v3" else args.size
        photos = skimage_photos(size)[:args.images]
        row = dict(model=name, size=size)
        for calibration in args.calibrations:
            t = time.time()
            res = compile_model(zoo_model(name), f"/tmp/tvm_qconv_zoo/{name}.so", name=name, progress=False,
                                options=BuildOptions(target=args.target, arch=args.arch, image_size=size,
                                                     **floor),
                                config=QuantConfig(calibration=calibration, num_calib_images=args.images),
                                ranges=Calibrate(photos))
            row.setdefault("build_s", round(time.time() - t, 1))
            layers = res.report["layers"]
            row["int8_layers"] = f"{sum(r['dtype'] == 'int8' for r in layers)}/{len(layers)}"
            row["float_ops"] = res.report["float_ops"]
            row[f"sqnr_{calibration}"] = res.report["verify"].get("logits_sqnr_db")
            if args.per_layer:
                row[f"layers_{calibration}"] = {r["layer"]: round(r["sqnr_db"], 1) for r in res.report["verify"]["layers"]}
        for bs in args.batches:
            photos_b = np.concatenate([skimage_photos(size)] * (-(-bs // 15)))[:bs]
            lib = compile_model(zoo_model(name), f"/tmp/tvm_qconv_zoo/{name}_b{bs}.so", name=name, progress=False,
                                options=BuildOptions(target="cuda", arch=args.arch, image_size=size, batch=bs,
                                                     cuda_graph=True, verify=False),
                                config=QuantConfig(num_calib_images=args.images), ranges=Calibrate(photos))
            row[f"int8_b{bs}_ms"] = CompiledModel(lib.lib_path).benchmark(photos_b, number=10 if bs == 1 else 3,
                                                                          repeat=10)["median_ms"]
            row[f"torch_fp16_graph_b{bs}_ms"] = torch_fp16_graph_ms(zoo_model(name), photos_b)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               target=args.target, arch=args.arch, rows=rows)
    with open(os.path.join(args.out, f"zoo_{args.target}.json"), "w") as f:
        json.dump(out, f, indent=1)
    cols = [k for k in rows[0] if k.startswith(("sqnr_", "int8_b", "torch_"))]
    print("| model | size | int8 layers | float ops | build s | " + " | ".join(cols) + " |")
    print("|---" * (5 + len(cols)) + "|")
    for r in rows:
        fl = ", ".join(f"{k.removeprefix('relax.')} x{v}" for k, v in sorted(r["float_ops"].items()))
        print(f"| {r['model']} | {r['size']} | {r['int8_layers']} | {fl} | {r['build_s']} | "
              + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
