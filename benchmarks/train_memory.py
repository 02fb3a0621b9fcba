"""Seed 000's mem_check.py for VGG16: peak memory and step time of a training step, int8 QAT (ours) vs float twin.

    python benchmarks/train_memory.py --out results/ [--batch 32] [--image-size 224] [--steps 10]

One training step = zero_grad, forward, cross-entropy, backward, SGD (momentum 0.9) step, on
``tvm_qconv.models.QuantizedVGG16`` with ``quantized=True`` (ours: int8 forward through the TVM dp4a
kernel, TVM gradient kernels, int8 saved activations) or ``quantized=False`` (the twin:
``nn.Conv2d`` + ReLU and ``nn.Linear``, cuDNN, PyTorch defaults).  Same seed, same weights, same
random batch.  Each variant runs in a fresh subprocess, so peaks do not mix:

* peak RAM: ``ru_maxrss`` of the process (ours includes importing TVM and, on the compile run,
  LLVM/nvcc work in-process);
* peak CUDA allocated / reserved: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
  over the whole run (first step included: the caching allocator keeps what it reserved);
* device used: ``total - free`` from ``cudaMemGetInfo`` at the end, which also counts what
  PyTorch's allocator does not see (CUDA context, TVM's loaded modules);
* step time: median wall time of ``--steps`` synchronized steps after ``--warmup`` steps.

Ours runs twice: first a compile run (fills the kernel cache, ``$TVM_QCONV_KERNEL_CACHE`` or
``~/.cache/tvm_qconv/kernels``; its first step's time is the compile time, reported apart), then
the measured run, which loads every kernel from disk.  The measured run also reports which
kernels ran: tvm_kernels' call counts, the CUDA kernels the profiler saw in one step, and any
PyTorch conv/matmul op (there must be none).  Prints a table and writes ``train_memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tvm_qconv.cli_args import positive_int  # noqa: E402
from tvm_qconv.models import QuantizedVGG16  # noqa: E402  (imports no TVM)

# The torch twin's child process runs this file too, and its peak RAM is a result: TVM is imported
# only where ours needs it (tvm_kernels) and for the report.

MB = 2 ** 20
TORCH_MATMULS = ("aten::conv2d", "aten::convolution", "aten::cudnn_convolution", "aten::convolution_backward",
                 "aten::linear", "aten::mm", "aten::addmm", "aten::matmul")
METRICS = [("peak_ram_mb", "Peak RAM (MB)"), ("peak_cuda_allocated_mb", "Peak CUDA alloc (MB)"),
           ("peak_cuda_reserved_mb", "Peak CUDA reserved (MB)"), ("device_used_mb", "Device used (MB)"),
           ("step_ms", "Step time (ms)")]


def child(variant: str, batch: int, image_size: int, steps: int, warmup: int, num_classes: int) -> dict:
    """One variant in this (fresh) process: peaks, step times and, for ours, the kernels that ran."""
    ours = variant.startswith("ours")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = QuantizedVGG16(num_classes=num_classes, image_size=image_size, quantized=ours).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(batch, 3, image_size, image_size, device=dev, generator=g)
    labels = torch.randint(0, num_classes, (batch,), device=dev, generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        return loss

    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(step()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "variant": variant, "batch": batch, "image_size": image_size,
        "peak_ram_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,
        "peak_cuda_allocated_mb": torch.cuda.max_memory_allocated(dev) / MB,
        "peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(dev) / MB,
        "device_used_mb": (lambda free, total: (total - free) / MB)(*torch.cuda.mem_get_info(dev)),
        "step_ms": 1000 * statistics.median(times[warmup:]),
        "first_step_s": times[0], "losses": losses,
    }
    if ours:
        from tvm_qconv.nn import tvm_kernels  # TVM: see the note at the top
        out["kernels"] = tvm_kernels.report()
        out["kernel_cache"] = tvm_kernels.cache_dir()
    out.update(_profile(step))
    return out


def _profile(step) -> dict:
    """The CUDA kernels of one step (name -> launches) and the PyTorch conv/matmul ops among its ops."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels, ops = {}, set()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0) + 1
        elif e.name in TORCH_MATMULS:
            ops.add(e.name)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])
    return {"cuda_kernels": dict(top), "torch_matmul_ops": sorted(ops)}


def run_child(variant: str, args) -> dict:
    out = os.path.join(args.out, f".{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--child-out", out,
           "--batch", str(args.batch), "--image-size", str(args.image_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--num-classes", str(args.num_classes)]
    print(f"[{variant}] {' '.join(cmd[1:3])} ...", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    res["process_s"] = time.time() - t0
    return res


def _reduction(ours: float, twin: float) -> float:
    return 100.0 * (twin - ours) / twin if twin else 0.0


def summarize(compile_run: dict, twin: dict, ours: dict) -> tuple[dict, float]:
    """Print the table and the kernel report; return the table rows and the compile seconds."""
    print("\n|Memory / time |PyTorch twin|Ours (int8, TVM)|Reduction|\n|---|---|---|---|")
    rows = {}
    for key, label in METRICS:
        red = _reduction(ours[key], twin[key])
        rows[key] = {"torch": round(twin[key], 2), "ours": round(ours[key], 2), "reduction_pct": round(red, 2)}
        print(f"|{label}|{twin[key]:.2f}|{ours[key]:.2f}|{red:.2f}%|")
    compile_s = compile_run["first_step_s"] - ours["first_step_s"]
    print(f"\nkernel compilation (first step of the compile run minus a cached first step): {compile_s:.1f} s; "
          f"compile run {compile_run['process_s']:.0f} s in all")
    print("\nTVM kernels called in the measured run (kind, workload, calls over all its steps):")
    for k in ours["kernels"]:
        print(f"  {k['kind']:<12} {k['workload']:<48} {k['calls']:>4}")
    print("\nCUDA kernels in one profiled step of ours (launches):")
    for name, n in list(ours["cuda_kernels"].items())[:20]:
        print(f"  {n:>4}  {name[:110]}")
    print(f"\nPyTorch conv/matmul ops in ours: {ours['torch_matmul_ops'] or 'none'}; "
          f"in the twin: {twin['torch_matmul_ops']}")
    return rows, compile_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results", help="folder for train_memory.json")
    p.add_argument("--batch", type=positive_int, default=32, help="batch size (32: activations dominate)")
    p.add_argument("--image-size", type=positive_int, default=224)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--num-classes", type=positive_int, default=1000)
    p.add_argument("--child", choices=["ours_compile", "ours", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child(args.child, args.batch, args.image_size, args.steps, args.warmup, args.num_classes)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0

    os.makedirs(args.out, exist_ok=True)
    print(f"VGG16 training step, batch {args.batch}, {args.image_size}x{args.image_size}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, each variant in a fresh process")
    compile_run = run_child("ours_compile", args)
    twin, ours = run_child("torch", args), run_child("ours", args)

    rows, compile_s = summarize(compile_run, twin, ours)
    report = {"benchmark": "train_memory", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
              "batch": args.batch, "image_size": args.image_size, "steps": args.steps, "warmup": args.warmup,
              "table": rows, "compile_seconds": round(compile_s, 1), "ours": ours, "torch_twin": twin,
              "compile_run": {k: compile_run[k] for k in ("first_step_s", "process_s", "kernels")}}
    try:
        import tvm  # see the note at the top
        report["tvm"] = tvm.__version__
    except ImportError:
        pass
    path = os.path.join(args.out, "train_memory.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
