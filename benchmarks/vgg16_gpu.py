"""VGG16 int8 on CUDA (default and tuned schedules) against PyTorch, and CUDA vs CPU int8 agreement.

    python benchmarks/vgg16_gpu.py --batches 1 64 --out results/

1. Calibrates VGG16 (random init, seed 0) once on scikit-image's photos; every build below
   uses those ranges.
2. Builds the int8 library for llvm and cuda at batch 1 with every int8 activation exposed,
   runs both on the same photo and compares each layer's int8 tensor element by element.
3. Builds the cuda library at each batch size and times it (TVM time_evaluator, median),
   beside PyTorch fp32 and fp16 (channels_last, cudnn.benchmark, eager and CUDA graphs);
   with ``--tuning-logs`` also the tuned build, with ``--cuda-graph`` also Relax CUDA graphs
   (each checked to give the untuned build's exact output; with both flags the graph variant
   is the tuned build's).
4. Prints a markdown table and writes everything to ``<out>/vgg16_gpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_median_ms  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402
from tvm_qconv.quantize import quantize_module  # noqa: E402
from tvm_qconv.ranges import Calibrate, GivenRanges  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402
from tvm_qconv.target import TargetInfo, make_target  # noqa: E402


def torch_latency(model, x, graphs: bool, iters: int = 50) -> float:
    """Median ms per forward (CUDA events), eager or replaying a captured CUDA graph."""
    with torch.no_grad():
        fn = lambda: model(x)  # noqa: E731
        if graphs:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    model(x)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                model(x)
            fn = g.replay
        return cuda_median_ms(fn, iters)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="results")
    ap.add_argument("--lib-dir", default="/tmp/tvm_qconv_libs", help="where the built libraries go")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--tuning-logs", default=None,
                    help="folder holding <model>-b<N>-<arch>/ databases: adds a tuned column per batch")
    ap.add_argument("--cuda-graph", action="store_true", help="also time int8 builds with Relax CUDA graphs")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    size = args.image_size
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               device=torch.cuda.get_device_name(0), torch=torch.__version__,
               nvidia_smi=subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
    torch.manual_seed(0)
    model = load_model("vgg16")
    photos = skimage_photos(size)
    cfg = QuantConfig()
    t = time.time()
    amax = quantize_module(model, (1, 3, size, size), TargetInfo.from_target(make_target("llvm")), config=cfg,
                           ranges=Calibrate(photos)).amax
    given = GivenRanges(amax)
    res["calibrate_s"] = round(time.time() - t, 1)
    libdir = args.lib_dir

    if not args.skip_agreement:
        outs = {}
        for target in ("llvm", "cuda"):
            t = time.time()
            lib = compile_model(model, f"{libdir}/vgg16_{target}_dbg.so", name="vgg16", ranges=given, config=cfg,
                                options=BuildOptions(target=target, arch=args.arch if target == "cuda" else None,
                                                     image_size=size, expose_activations=True))
            cm = CompiledModel(lib.lib_path)
            outs[target] = cm.outputs(photos[:1])
            res[f"build_{target}_dbg_s"] = round(time.time() - t, 1)
            names = [e["layer"] for e in lib.report["exposed"]]
        agree = []
        for name, a, b in zip(names, outs["llvm"][1:], outs["cuda"][1:]):
            d = np.abs(a.astype(np.int32) - b.astype(np.int32))
            agree.append(dict(layer=name, equal=float((d == 0).mean()), max_abs_diff=int(d.max()),
                              nonzero=float((a != 0).mean())))
        la, lb = outs["llvm"][0], outs["cuda"][0]
        res["agreement"] = dict(layers=agree, logits_max_abs_diff=float(np.abs(la - lb).max()),
                                logits_max_abs=float(np.abs(la).max()))
        print("CUDA vs CPU int8 activations:")
        for r in agree:
            print(f"  {r['layer']:<14} equal {r['equal'] * 100:7.3f}%  max |diff| {r['max_abs_diff']}")

    rows = []
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    for bs in args.batches:
        t = time.time()
        lib = compile_model(model, f"{libdir}/vgg16_cuda_b{bs}.so", name="vgg16", ranges=given, config=cfg,
                            options=BuildOptions(target="cuda", arch=args.arch, batch=bs, image_size=size))
        build_s = time.time() - t
        cm = CompiledModel(lib.lib_path)
        x = np.concatenate([photos] * (-(-bs // len(photos))))[:bs]
        lat = cm.benchmark(x, number=10 if bs == 1 else 3, repeat=10)
        row = dict(batch=bs, tvm_int8_ms=lat["median_ms"], build_s=round(build_s, 1))
        variants = {}
        log = args.tuning_logs and os.path.join(args.tuning_logs, f"vgg16-b{bs}-{args.arch}")
        if log and os.path.isdir(log):
            variants["tuned"] = dict(tuning_log=log)
        if args.cuda_graph:  # the tuned build's when there is one (each build of VGG16 takes ~30 s)
            variants[("tuned_" if "tuned" in variants else "") + "graph"] = dict(variants.get("tuned", {}),
                                                                              cuda_graph=True)
        for tag, kw in variants.items():
            vlib = compile_model(model, f"{libdir}/vgg16_cuda_b{bs}_{tag}.so", name="vgg16", ranges=given, config=cfg,
                                 options=BuildOptions(target="cuda", arch=args.arch, batch=bs, image_size=size, **kw))
            vm = CompiledModel(vlib.lib_path)
            same = all(np.array_equal(vm(x), cm(x)) for _ in range(2))  # twice: a replayed graph must not go stale
            row[f"tvm_int8_{tag}_ms"] = vm.benchmark(x, number=10 if bs == 1 else 3, repeat=10)["median_ms"]
            row[f"tvm_int8_{tag}_same_output"] = bool(same)
            if tag == "tuned":
                row["tuned_kernels"] = len(vlib.report.get("tuned", {}))
        if bs == 1:
            ref = model(torch.from_numpy(photos)).detach().numpy()
            got = np.concatenate([cm(photos[i:i + 1]) for i in range(len(photos))])
            row["sqnr_db"] = sqnr_db(ref, got)
            row["top1_agree"] = float((ref.argmax(1) == got.argmax(1)).mean())
        xt = torch.from_numpy(x).to(dev)
        for dtype, tag in ((torch.float32, "fp32"), (torch.float16, "fp16")):
            m = load_model("vgg16")
            m.load_state_dict(model.state_dict())
            m = m.to(dev, dtype).to(memory_format=torch.channels_last).eval()
            xi = xt.to(dtype).contiguous(memory_format=torch.channels_last)
            row[f"torch_{tag}_ms"] = torch_latency(m, xi, graphs=False)
            row[f"torch_{tag}_graph_ms"] = torch_latency(m, xi, graphs=True)
            del m
        rows.append(row)
        print(json.dumps(row))
    res["latency"] = rows
    with open(os.path.join(args.out, "vgg16_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['device']}, {res['date']}")
    cols = [k for k in rows[0] if k.endswith("_ms")]
    print("| batch | " + " | ".join(c.removesuffix("_ms") + " (ms)" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" if c in r else "-" for c in cols) + " |")


if __name__ == "__main__":
    main()
