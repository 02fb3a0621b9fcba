"""Issue 35's benchmark: peak memory and step time of one training step, the int8 QAT layers (ours)
against the float twins people train with, VGG16 or ResNet-50, each variant in a fresh process.

    python benchmarks/train_memory.py --out results/ --model vgg16 --batch 32
    python benchmarks/train_memory.py --out results/ --model resnet50 --batch 128 --variants ours,tf32,amp

One training step = zero_grad, forward, cross-entropy, backward, SGD (momentum 0.9) step, random
images and labels, same seed and weights in every variant:

* ``ours``: ``QuantizedVGG16`` / ``quantized_resnet50`` with ``quantized=True`` (int8 forward and
  gradients through TVM kernels, int8 saved activations).  A first process (``ours_compile``) fills
  the kernel cache (``$TVM_QCONV_KERNEL_CACHE`` or ``~/.cache/tvm_qconv/kernels``; its first step's
  time is the compile time, reported apart); the measured process loads every kernel from disk.
* ``tf32``: the float twin (``nn.Conv2d`` / ``nn.Linear``, cuDNN), TF32 on for convs and matmuls,
  ``cudnn.benchmark`` on: issue 35's "float twin".  Every twin runs without its range records
  (``set_range_records(model, False)``): as plain float training, which computes no max|x| (until
  2026-11-29 the twins paid two such reductions a layer a step, e.g. 3.7 ms of ResNet-50 b128's 64
  ms, and the ratios looked that much better).
* ``amp``: the float twin in channels_last under ``torch.autocast(dtype=torch.bfloat16)``,
  ``cudnn.benchmark`` on: what people train with.
* ``defaults``: the float twin with PyTorch's defaults (cuDNN's convs in TF32, matmuls in fp32,
  ``cudnn.benchmark`` off: the 2026-11-22 figure's twin).

``--input-grad int8`` / ``--weight-grad int8`` run ours with int8 input / weight gradients
(``QuantizedConv2d``'s ``input_grad`` / ``weight_grad``).  ``--cuda-graph`` also times every
variant's step captured in one CUDA graph (``torch.cuda.graph``, torch's recipe: warm-up on a side
stream, autocast without its cast cache), replayed: the step without the host's launch overhead.

Measured per variant: peak RAM (``ru_maxrss``), peak CUDA allocated / reserved over the whole run,
device memory used at the end (``cudaMemGetInfo``, which also counts the CUDA context and TVM's
modules), the median step time of ``--steps`` synchronized steps after ``--warmup``, and one
profiled step: every CUDA kernel's launches and summed time (GPU-busy time against the step's wall
time says how much is launch overhead), and any PyTorch conv / matmul op (ours must have none).
Ours also lists the TVM kernels it called.  Prints a table and writes
``train_memory_<model>_b<batch>.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tvm_qconv.cli_args import positive_int  # noqa: E402
from tvm_qconv.fileio import write_json  # noqa: E402
from tvm_qconv.models import QuantizedVGG16, quantized_resnet50  # noqa: E402  (imports no TVM)
from tvm_qconv.nn import set_range_records  # noqa: E402
from tvm_qconv.nn.functional import INPUT_GRADS  # noqa: E402

# The torch twin's child process runs this file too, and its peak RAM is a result: TVM is imported
# only where ours needs it (tvm_kernels) and for the report.

MB = 2 ** 20
TORCH_MATMULS = ("aten::conv2d", "aten::convolution", "aten::cudnn_convolution", "aten::convolution_backward",
                 "aten::linear", "aten::mm", "aten::addmm", "aten::matmul")
VARIANTS = ("ours", "tf32", "amp", "defaults")
METRICS = [("peak_ram_mb", "Peak RAM (MB)"), ("peak_cuda_allocated_mb", "Peak CUDA alloc (MB)"),
           ("peak_cuda_reserved_mb", "Peak CUDA reserved (MB)"), ("device_used_mb", "Device used (MB)"),
           ("step_ms", "Step time (ms)")]


def build_model(model: str, num_classes: int, image_size: int, quantized: bool,
                input_grad: str = "float32", weight_grad: str = "float32", fuse_bn_relu: bool = False
                ) -> torch.nn.Module:
    """The model of a variant, seeded: every variant starts from the same weights.  ``fuse_bn_relu``
    (ResNet-50, ours only): BatchNorm, the residual add and the ReLU as one op (``BatchNormReLU``)."""
    torch.manual_seed(0)
    if model == "vgg16":
        return QuantizedVGG16(num_classes=num_classes, image_size=image_size, quantized=quantized,
                              input_grad=input_grad, weight_grad=weight_grad)
    return quantized_resnet50(num_classes=num_classes, quantized=quantized, input_grad=input_grad,
                              weight_grad=weight_grad, fuse_bn_relu=fuse_bn_relu and quantized)


def child(variant: str, model_name: str, batch: int, image_size: int, steps: int, warmup: int,
          num_classes: int, input_grad: str = "float32", weight_grad: str = "float32",
          cuda_graph: bool = False, fuse_bn_relu: bool = False) -> dict:
    """One variant in this (fresh) process: peaks, step times, one profiled step and, for ours,
    the TVM kernels that ran."""
    ours = variant.startswith("ours")
    dev = torch.device("cuda")
    if variant in ("tf32", "amp"):
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = variant == "tf32"
    model = build_model(model_name, num_classes, image_size, quantized=ours, input_grad=input_grad,
                        weight_grad=weight_grad, fuse_bn_relu=fuse_bn_relu).to(dev).train()
    set_range_records(model, False)     # the twins as plain float training (module docstring)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(batch, 3, image_size, image_size, device=dev, generator=g)
    labels = torch.randint(0, num_classes, (batch,), device=dev, generator=g)
    if variant == "amp":
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step(cache: bool = True):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=variant == "amp", cache_enabled=cache):
            loss = F.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        return loss

    prebuilt = None
    if variant == "ours_compile":   # the kernels first, in parallel (tvm_kernels.prebuild)
        from tvm_qconv.nn import tvm_kernels  # TVM: see the note at the top
        dry = copy.deepcopy(model)
        prebuilt = tvm_kernels.prebuild(lambda: F.cross_entropy(dry(x), labels).backward())
        del dry
        print(f"[ours_compile] prebuilt {len(prebuilt['built'])} kernels in {prebuilt['seconds']:.0f} s"
              + (f"; failed: {prebuilt['failed']}" if prebuilt["failed"] else ""), flush=True)
    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(step()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "variant": variant, "model": model_name, "input_grad": input_grad if ours else None,
        "weight_grad": weight_grad if ours else None, "batch": batch,
        "image_size": image_size,
        "peak_ram_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,
        "peak_cuda_allocated_mb": torch.cuda.max_memory_allocated(dev) / MB,
        "peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(dev) / MB,
        "device_used_mb": (lambda free, total: (total - free) / MB)(*torch.cuda.mem_get_info(dev)),
        "step_ms": 1000 * statistics.median(times[warmup:]),
        "first_step_s": times[0], "losses": losses,
    }
    if prebuilt is not None:
        out["prebuild_s"], out["prebuilt"] = prebuilt["seconds"], len(prebuilt["built"])
    if ours:
        from tvm_qconv.nn import tvm_kernels  # TVM: see the note at the top
        out["kernels"] = tvm_kernels.report()
        out["kernel_cache"] = tvm_kernels.cache_dir()
    out.update(_profile(step))
    if cuda_graph:
        try:
            out["graph_step_ms"] = _graph_step_ms(step, steps)
        except Exception as e:  # recorded, not fatal: the eager figures above stand
            out["graph_error"] = f"{type(e).__name__}: {e}"
    return out


def _graph_step_ms(step, steps: int) -> float:
    """Median ms of ``steps`` replays of one step captured in a CUDA graph (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cache=False)
    times = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


OPS_KEPT = 40     # the ops (with input shapes) kept per variant, most device time first


def _profile(step) -> dict:
    """One step under the profiler: each CUDA kernel's launches and summed microseconds (most time
    first), the GPU-busy time, the step's wall time, the PyTorch conv / matmul ops among its ops,
    and the :data:`OPS_KEPT` ops (by input shapes) whose own kernels took the most time."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t0)
    # the ops that launched the kernels: each CPU op's own kernels' time, by op and input shapes
    # (which copy, which reduction: the kernels' names alone do not say)
    by_op = [{"op": a.key, "shapes": str(a.input_shapes)[:300], "calls": a.count,
              "us": round(a.self_device_time_total, 1)}
             for a in prof.key_averages(group_by_input_shape=True)
             if a.device_type == torch.autograd.DeviceType.CPU and a.self_device_time_total > 0]
    kernels, ops = {}, set()
    for e in prof.events():
        # a user annotation's span on the GPU (``Optimizer.step#SGD.step``) is not a kernel: it
        # covers the optimizer's kernels, which would count twice in the busy time
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            n, us = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, us + e.time_range.elapsed_us())
        elif e.name in TORCH_MATMULS:
            ops.add(e.name)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"cuda_kernels": {k: {"launches": n, "us": round(us, 1)} for k, (n, us) in top},
            "launches": sum(n for n, _ in kernels.values()),
            "gpu_busy_ms": round(sum(us for _, us in kernels.values()) / 1000, 3),
            "profiled_wall_ms": round(wall_ms, 3), "torch_matmul_ops": sorted(ops),
            "ops_by_device_time": sorted(by_op, key=lambda r: -r["us"])[:OPS_KEPT]}


def run_child(variant: str, args) -> dict:
    # a file of its own: two runs writing into one --out at once (two GPUs of one host) must not
    # read each other's variants (they did: a batch-128 result in a batch-32 table)
    fd, out = tempfile.mkstemp(prefix=f".{args.model}_b{args.batch}_{variant}_", suffix=".json", dir=args.out)
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--child-out", out, "--model", args.model,
           "--input-grad", args.input_grad, "--weight-grad", args.weight_grad,
           *(["--cuda-graph"] if args.cuda_graph and variant != "ours_compile" else []),
           "--fuse-bn-relu" if args.fuse_bn_relu else "--no-fuse-bn-relu",
           "--batch", str(args.batch), "--image-size", str(args.image_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--num-classes", str(args.num_classes)]
    print(f"[{variant}] {args.model} batch {args.batch} ...", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    if (res["variant"], res["model"], res["batch"]) != (variant, args.model, args.batch):
        raise RuntimeError(f"{out} holds {res['variant']} {res['model']} batch {res['batch']}, not the {variant} "
                           f"{args.model} batch {args.batch} this run asked for")
    res["process_s"] = time.time() - t0
    return res


def _reduction(ours: float, twin: float) -> float:
    return 100.0 * (twin - ours) / twin if twin else 0.0


def summarize(results: dict, compile_run: dict | None) -> dict:
    """Print the table (every variant, ours against each twin) and the kernel reports; return the rows."""
    names = list(results)
    print("\n|metric|" + "|".join(names) + "|\n|---|" + "---|" * len(names))
    rows = {}
    extra = [("graph_step_ms", "Step time, CUDA graph (ms)")] if all("graph_step_ms" in r for r in results.values()) else []
    for key, label in METRICS + extra + [("launches", "Kernel launches"), ("gpu_busy_ms", "GPU busy (ms, profiled step)")]:
        rows[key] = {v: round(results[v][key], 2) for v in names}
        print(f"|{label}|" + "|".join(f"{results[v][key]:.2f}" for v in names) + "|")
    if "ours" in results:
        ours = results["ours"]
        rows["ours_vs"] = {v: {"step_time_ratio": round(ours["step_ms"] / results[v]["step_ms"], 3),
                               **({"graph_step_time_ratio": round(ours["graph_step_ms"] / results[v]["graph_step_ms"], 3)}
                                  if extra else {}),
                               "allocated_reduction_pct": round(_reduction(ours["peak_cuda_allocated_mb"],
                                                                           results[v]["peak_cuda_allocated_mb"]), 2),
                               "reserved_reduction_pct": round(_reduction(ours["peak_cuda_reserved_mb"],
                                                                          results[v]["peak_cuda_reserved_mb"]), 2)}
                           for v in names if v != "ours"}
        for v, r in rows["ours_vs"].items():
            graph = f" ({r['graph_step_time_ratio']:.2f}x in CUDA graphs)" if extra else ""
            print(f"ours against {v}: step {r['step_time_ratio']:.2f}x its time{graph}, "
                  f"{r['allocated_reduction_pct']:.1f} % less allocated, "
                  f"{r['reserved_reduction_pct']:.1f} % less reserved")
        if compile_run is not None:
            compile_s = compile_run.get("prebuild_s", 0.0) + compile_run["first_step_s"] - ours["first_step_s"]
            rows["compile_seconds"] = round(compile_s, 1)
            print(f"\nkernel compilation (the compile run's parallel prebuild and first step, minus a cached first "
                  f"step): {compile_s:.1f} s; compile run {compile_run['process_s']:.0f} s in all")
        print("\nTVM kernels called in the measured run (kind, workload, calls over all its steps):")
        for k in ours["kernels"]:
            print(f"  {k['kind']:<12} {k['workload']:<48} {k['calls']:>4}")
    for v in names:
        if "graph_error" in results[v]:
            print(f"\n{v}: the step did not capture in a CUDA graph: {results[v]['graph_error']}")
        print(f"\n{v}: CUDA kernels of one profiled step, most time first (launches, us):")
        for name, k in list(results[v]["cuda_kernels"].items())[:15]:
            print(f"  {k['launches']:>4} {k['us']:>9.1f}  {name[:100]}")
        print(f"  PyTorch conv/matmul ops: {results[v]['torch_matmul_ops'] or 'none'}")
        print(f"{v}: the ops whose own kernels took the most time (calls, us, input shapes):")
        for r in results[v].get("ops_by_device_time", [])[:15]:
            print(f"  {r['calls']:>4} {r['us']:>9.1f}  {r['op'][:40]:<40} {r['shapes'][:90]}")
    return rows


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}: choose from {', '.join(VARIANTS)}")
    return names


def _write_report(path: str, args, command: str, results: dict, compile_run: dict | None, rows: dict | None) -> None:
    """The run's JSON (atomically): ``complete`` false until every variant ran and ``table`` is in."""
    report = {"benchmark": "train_memory", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": command,
              "model": args.model, "input_grad": args.input_grad,
              "weight_grad": args.weight_grad, "batch": args.batch, "image_size": args.image_size,
              "steps": args.steps, "warmup": args.warmup, "twin_range_records": False,
              "fuse_bn_relu": args.fuse_bn_relu and args.model == "resnet50",
              "complete": rows is not None, "table": rows,
              "variants": results}
    if compile_run is not None:
        report["compile_run"] = {k: compile_run[k] for k in ("first_step_s", "process_s", "kernels", "prebuild_s",
                                                               "prebuilt") if k in compile_run}
    try:
        import tvm  # see the note at the top
        report["tvm"] = tvm.__version__
    except ImportError:
        pass
    write_json(path, report, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results", help="folder for train_memory_<model>_b<batch>.json")
    p.add_argument("--model", choices=["vgg16", "resnet50"], default="vgg16")
    p.add_argument("--variants", type=_variants, default=["ours", "tf32", "amp"],
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default ours,tf32,amp)")
    p.add_argument("--input-grad", choices=INPUT_GRADS, default="float32",
                   help="ours: input gradients in float32 or from the int8-quantized gradient (QuantizedConv2d)")
    p.add_argument("--weight-grad", choices=INPUT_GRADS, default="float32",
                   help="ours: weight gradients in float32 or from the int8-quantized gradient (QuantizedConv2d)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time each variant's step captured in a CUDA graph and replayed")
    p.add_argument("--fuse-bn-relu", action=argparse.BooleanOptionalAction, default=True,
                   help="(resnet50) ours with BatchNorm, the residual add and the ReLU as one op (BatchNormReLU, "
                        "tvm_qconv/nn/batch_norm.py; the default); the twins keep torch's modules")
    p.add_argument("--batch", type=positive_int, default=32, help="batch size (32: activations dominate)")
    p.add_argument("--image-size", type=positive_int, default=224)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--num-classes", type=positive_int, default=1000)
    p.add_argument("--child", choices=("ours_compile",) + VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child(args.child, args.model, args.batch, args.image_size, args.steps, args.warmup, args.num_classes,
                    args.input_grad, args.weight_grad, args.cuda_graph, args.fuse_bn_relu)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0

    os.makedirs(args.out, exist_ok=True)
    print(f"{args.model} training step, batch {args.batch}, {args.image_size}x{args.image_size}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, each variant in a fresh process")
    tag = "".join(f"_{value}_{name}" for name, value in (("dx", args.input_grad), ("dw", args.weight_grad))
                  if value != "float32") + ("_graph" if args.cuda_graph else "") \
        + ("_unfused" if args.model == "resnet50" and not args.fuse_bn_relu else "")
    path = os.path.join(args.out, f"train_memory_{args.model}_b{args.batch}{tag}.json")
    command = " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))
    compile_run = run_child("ours_compile", args) if "ours" in args.variants else None
    results = {}
    for v in args.variants:     # each variant on disk as it finishes: a run cut off keeps what it measured
        results[v] = run_child(v, args)
        r = results[v]
        print(f"[{v}] step {r['step_ms']:.2f} ms" + (f", {r['graph_step_ms']:.2f} ms in a CUDA graph"
                                                      if "graph_step_ms" in r else "")
              + f"; peak allocated {r['peak_cuda_allocated_mb']:.0f} MB, reserved {r['peak_cuda_reserved_mb']:.0f} MB",
              flush=True)
        _write_report(path, args, command, results, compile_run, rows=None)

    rows = summarize(results, compile_run)
    _write_report(path, args, command, results, compile_run, rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
