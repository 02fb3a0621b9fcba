"""A torchvision model in int8 on CUDA (each kernel family, default and tuned schedules) against
PyTorch, and the CUDA build's agreement with the CPU build.

    python benchmarks/model_gpu.py --model vgg16 --batches 1 64 --tuning-logs tuning_logs --out results/

1. Calibrates the model (random init, seed 0) once on scikit-image's photos; every build below
   uses those ranges.
2. Builds the int8 library for llvm and for cuda (the registry's default: tensor cores where
   they apply) at batch 1 with every int8 activation exposed, runs both on the same photo and
   compares every int8 tensor element by element (they must be bit-identical).
3. At each batch size builds and times (TVM time_evaluator, median; Relax CUDA graphs) the
   ``--variants``: the default build (the registry's order: wgmma with ``--arch sm_90a``, else
   mma.sync tensor cores; dp4a for the few-channel first conv), mma.sync preferred, dp4a only;
   and with ``--tuning-logs`` each tuned (the database picks the family per layer); beside
   PyTorch fp16 and fp32 (channels_last, cudnn.benchmark, eager and CUDA graphs) and, with
   ``--compile``, ``torch.compile(mode="max-autotune")`` fp16.  Every int8 variant is checked
   to give the default build's exact logits.
4. Prints a markdown table and writes everything to ``<out>/<model>_gpu.json``.
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
from tvm_qconv import registry  # noqa: E402
from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.compare.baselines import capture, check_replay  # noqa: E402
from tvm_qconv.compare.run import tuning_log_for  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.frontend import load_model  # noqa: E402
from tvm_qconv.int8_module import quantize_module  # noqa: E402
from tvm_qconv.ranges import Calibrate, GivenRanges  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402
from tvm_qconv.target import TargetInfo, make_target  # noqa: E402


def torch_latency(model, x, graphs: bool, iters: int = 50) -> float:
    """Median ms per forward (CUDA events), eager or replaying a captured CUDA graph; a graph whose
    replay does not reproduce eager PyTorch is refused (``check_replay``; docs/history.md, "One
    command against every baseline", tells the fault it guards against)."""
    with torch.no_grad():
        fn = lambda: model(x)  # noqa: E731
        if graphs:
            replay, out = capture(model, x.clone())
            check_replay(replay, out, model, x.flip(-1).contiguous(memory_format=torch.channels_last))
            fn = lambda: replay(x)  # noqa: E731  (the input copy is one small device copy)
        return cuda_median_ms(fn, iters)


# The int8 builds a run can time (``--variants``): the kernel families each prefers.
VARIANTS = {"default": {}, "mma": dict(families=("mma", "stem", "dp4a", "generic")),
            "dp4a": dict(families=("dp4a", "generic"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--arch", default=None, help="default: the GPU's")
    ap.add_argument("--out", default="results")
    ap.add_argument("--lib-dir", default="/tmp/tvm_qconv_libs", help="where the built libraries go")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--variants", nargs="+", default=["default", "dp4a"], choices=sorted(VARIANTS),
                    help="int8 builds to time: default (the registry's order: wgmma on sm_90a, else mma.sync), "
                         "mma (mma.sync preferred), dp4a (dp4a only)")
    ap.add_argument("--tuning-logs", default=None,
                    help="folder holding <model>-b<N>-<arch>/ databases: adds the tuned builds")
    ap.add_argument("--compile", action="store_true", help="also torch.compile(mode='max-autotune') fp16")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    size = args.image_size
    major, minor = torch.cuda.get_device_capability(0)
    arch = args.arch or f"sm_{major}{minor}"
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               model=args.model, device=torch.cuda.get_device_name(0), torch=torch.__version__, arch=arch,
               nvidia_smi=subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
    torch.manual_seed(0)
    model = load_model(args.model)
    photos = skimage_photos(size)
    cfg = QuantConfig()
    t = time.time()
    amax = quantize_module(model, (1, 3, size, size), TargetInfo.from_target(make_target("llvm")), config=cfg,
                           ranges=Calibrate(photos), progress=False).amax
    given = GivenRanges(amax)
    res["calibrate_s"] = round(time.time() - t, 1)
    libdir = args.lib_dir

    def build(tag, **options):
        t0 = time.time()
        lib = compile_model(model, f"{libdir}/{args.model}_{tag}.so", name=args.model, ranges=given, config=cfg,
                            progress=False, options=BuildOptions(image_size=size, **options))
        return lib, time.time() - t0

    if not args.skip_agreement:
        outs, exposed = {}, {}
        for target in ("llvm", "cuda"):
            lib, secs = build(f"{target}_dbg", target=target, arch=arch if target == "cuda" else None,
                              expose_activations=True, verify=False)
            outs[target] = CompiledModel(lib.lib_path).outputs(photos[:1])
            exposed[target] = lib.report["exposed"]
            res[f"build_{target}_dbg_s"] = round(secs, 1)
            res[f"kernels_{target}"] = {r["layer"]: r["kernel"] for r in lib.report["layers"]}
        agree = []
        for e_cpu, e_gpu, a, b in zip(exposed["llvm"], exposed["cuda"], outs["llvm"][1:], outs["cuda"][1:]):
            # each in its library's layout (NCHW4c on the CPU, NHWC32 after tensor-core convs): compare as NCHW
            a = registry.layout(e_cpu["layout"]).unpack(a, e_cpu["channels"])
            b = registry.layout(e_gpu["layout"]).unpack(b, e_gpu["channels"])
            agree.append(dict(layer=e_cpu["layer"], layouts=[e_cpu["layout"], e_gpu["layout"]],
                              equal=float((a == b).mean()), max_abs_diff=int(np.abs(a.astype(int) - b).max())))
        logits_equal = bool(np.array_equal(outs["llvm"][0], outs["cuda"][0]))
        res["agreement"] = dict(layers=agree, logits_bit_identical=logits_equal,
                                logits_max_abs_diff=float(np.abs(outs["llvm"][0] - outs["cuda"][0]).max()))
        print(f"CUDA vs CPU int8: logits bit-identical: {logits_equal}; "
              f"{sum(a['equal'] == 1.0 for a in agree)}/{len(agree)} int8 activations identical", flush=True)

    rows = []
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    for bs in args.batches:
        row = dict(batch=bs)
        x = np.concatenate([photos] * (-(-bs // len(photos))))[:bs]
        variants = {f"int8_{name}_graph": VARIANTS[name] for name in args.variants}
        log = tuning_log_for(args.tuning_logs, args.model, bs, arch)
        if log:
            variants["int8_tuned_graph"] = dict(tuning_log=log)
            if "dp4a" in args.variants:
                variants["int8_dp4a_tuned_graph"] = dict(tuning_log=log, families=("dp4a", "generic"))
        reference = None
        for tag, kw in variants.items():
            lib, secs = build(f"cuda_b{bs}_{tag}", target="cuda", arch=arch, batch=bs, cuda_graph=True, **kw)
            cm = CompiledModel(lib.lib_path)
            logits = cm(x)
            reference = logits if reference is None else reference
            row[f"{tag}_ms"] = cm.benchmark(x, number=10 if bs == 1 else 3, repeat=10)["median_ms"]
            row[f"{tag}_same_logits"] = bool(np.array_equal(logits, reference) and np.array_equal(cm(x), logits))
            row[f"{tag}_build_s"] = round(secs, 1)
            row[f"{tag}_families"] = sorted({r["kernel"] for r in lib.report["layers"] if r["kind"].startswith("conv")})
            row[f"{tag}_layer_kernels"] = [r["kernel"] for r in lib.report["layers"] if r["kind"].startswith("conv")]
            if kw.get("tuning_log"):
                row[f"{tag}_tuned"] = lib.report["tuned"]  # layer -> shape (and the wgmma tile)
            if bs == 1 and tag == next(iter(variants)):
                ref = model(torch.from_numpy(photos)).detach().numpy()
                got = np.concatenate([cm(photos[i:i + 1]) for i in range(len(photos))])
                row["sqnr_db"] = sqnr_db(ref, got)
                row["top1_agree"] = float((ref.argmax(1) == got.argmax(1)).mean())
        xt = torch.from_numpy(x).to(dev)
        for dtype, tag in ((torch.float16, "fp16"), (torch.float32, "fp32")):
            m = load_model(args.model)
            m.load_state_dict(model.state_dict())
            m = m.to(dev, dtype).to(memory_format=torch.channels_last).eval()
            xi = xt.to(dtype).contiguous(memory_format=torch.channels_last)
            row[f"torch_{tag}_ms"] = torch_latency(m, xi, graphs=False)
            row[f"torch_{tag}_graph_ms"] = torch_latency(m, xi, graphs=True)
            if args.compile and dtype == torch.float16:
                cm_ = torch.compile(m, mode="max-autotune")
                row["torch_fp16_compile_ms"] = torch_latency(cm_, xi, graphs=False)
            del m
        best_torch = min(v for k, v in row.items() if k.startswith("torch_") and k.endswith("_ms"))
        best_int8 = min(v for k, v in row.items() if k.startswith("int8_") and k.endswith("_ms"))
        row["speedup_vs_best_torch"] = best_torch / best_int8
        rows.append(row)
        print(json.dumps(row), flush=True)
        res["latency"] = rows  # saved after every batch: a run cut short keeps what it measured
        path = os.path.join(args.out, f"{args.model}_gpu.json")
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)
    print(f"\n{args.model}, {res['device']}, {res['date']}")
    cols = [k for k in rows[0] if k.endswith("_ms")]
    print("| batch | " + " | ".join(c.removesuffix("_ms") + " (ms)" for c in cols) + " | int8 vs best torch |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" if c in r else "-" for c in cols)
              + f" | {r['speedup_vs_best_torch']:.2f}x |")


if __name__ == "__main__":
    main()
