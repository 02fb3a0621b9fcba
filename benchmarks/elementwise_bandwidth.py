"""Issue 35's elementwise kernels against the memory bandwidth: each kind of
``schedules/training/elementwise.py`` at every activation shape of a VGG16 training step, its time,
the bytes it must move and the bandwidth that makes, against a same-run device-to-device copy.

    python benchmarks/elementwise_bandwidth.py --out results/ --batch 32
    python benchmarks/elementwise_bandwidth.py --out results/ --batch 32 --kinds pack pack_transposed
    python benchmarks/elementwise_bandwidth.py --out results/ --device cpu --batch 1 --image-size 32

The training step's profile (performance.md, "Training") puts these kernels at about a third of an
H200's bandwidth; this measures them one at a time, without the rest of the step, so a schedule
change can be judged in a minute (and run under ``ncu`` for the why).  Bytes are what the kernel
must read and write at the least (``bytes_moved``); a copy of the largest tensor, timed the same way,
is the bandwidth anchor (``torch`` ``copy_``, read + write).  On CUDA each figure is one call's
share of 20 captured in a CUDA graph (``cuda_graph_ms``), as the training step runs them: timed one
call at a time, the host's launch made the small shapes look several times slower.  Writes
``elementwise_bandwidth_b<b>.json`` and prints a table by kind: summed time, bytes, GB/s and % of
the copy's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tvm_qconv.cli_args import positive_int  # noqa: E402
from tvm_qconv.fileio import write_json  # noqa: E402

# VGG16's conv outputs at 224 px: (channels, size) of each conv; the 2x2 pools after the marked ones
VGG16_CONVS = ((64, 1), (64, 1), (128, 2), (128, 2), (256, 4), (256, 4), (256, 4), (512, 8), (512, 8), (512, 8),
               (512, 16), (512, 16), (512, 16))
POOLED = (1, 3, 6, 9, 12)           # indices of the convs a pool follows
KINDS = ("quantize", "quantize_grad", "grad_stats", "dequantize", "relu_bits", "relu", "mask", "pack",
         "pack_transposed", "max_pool", "max_pool_grad", "scale_sums", "flip_transpose")
PER_CONV = ("quantize", "quantize_grad", "grad_stats", "dequantize", "relu_bits", "relu", "mask", "pack",
            "pack_transposed")


def bytes_moved(kind: str, shape) -> int:
    """The bytes ``kind`` must read and write at least for a float side of NCHW ``shape`` (module
    docstring): float32 4 bytes, int8 1, the ReLU bits 1/8, NHWC32 padded to 32 channels."""
    n, c, h, w = shape
    e = n * c * h * w
    padded = n * h * w * (-(-c // 32) * 32)
    pooled = n * c * (h // 2) * (w // 2)
    return {"quantize": 4 * e + e,                       # float in, int8 out
            "quantize_grad": 4 * e + e // 8 + 2 * e,     # g and its mask in, two int8 out
            "grad_stats": 4 * e + e // 8,                # g and its mask in (partials: a few KB)
            "dequantize": 4 * padded + 4 * e + e // 2,   # NHWC32 int32 in, float out, its range a thread
            "relu_bits": 4 * e + e // 8,
            "relu": 8 * e + e // 8 + e // 2,             # x in; relu(x), its bits and range out (ResNet's)
            "mask": 4 * e + e // 8 + 4 * e,              # g and the bits in, masked g out (ResNet's ReLUs)
            "scale_sums": 8 * e,                         # the weight's int32 sums in, float dw out (shape: OIHW)
            "flip_transpose": 2 * e,                     # the int8 weight in, dx's flipped weight out (OIHW)
            "pack": e + padded,                          # int8 NCHW in, NHWC32 out
            "pack_transposed": e + -(-c // 32) * 32 * h * w * -(-n // 32) * 32,   # -> [C_p, H, W, N_p] (dw's)
            "max_pool": 4 * e + 5 * pooled,              # float in, float max and 1-byte index out
            "max_pool_grad": 5 * pooled + 4 * e}[kind]


def workloads(batch: int, image_size: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(kind, shape) of every elementwise kernel call a VGG16 step makes at ``batch``: the float
    side's NCHW shape once per conv and pool (``relu`` and ``mask`` too, which VGG16 does not call:
    ResNet-50's ``CompactReLU``, at these shapes), and ``scale_sums`` once per weight (OIHW, the
    linear layers 1 x 1), ``flip_transpose`` once per weight with an input gradient (all but the
    first conv's; the weights' quantizations left out)."""
    out = []
    cin = 3
    for i, (c, down) in enumerate(VGG16_CONVS):
        shape = (batch, c, image_size // down, image_size // down)
        out += [(k, shape) for k in PER_CONV]
        if i in POOLED:
            out += [("max_pool", shape), ("max_pool_grad", shape)]
        out.append(("scale_sums", (c, cin, 3, 3)))
        if i > 0:
            out.append(("flip_transpose", (c, cin, 3, 3)))
        cin = c
    features = 512 * (image_size // 32) ** 2
    for weight in ((4096, features, 1, 1), (4096, 4096, 1, 1), (1000, 4096, 1, 1)):
        out += [("scale_sums", weight), ("flip_transpose", weight)]
    return out


def _timer(device: torch.device, iters: int):
    if device.type == "cuda":   # in a CUDA graph, as in the training step: no host launch gaps
        from tvm_qconv.compare.measure import cuda_graph_ms
        return lambda fn: cuda_graph_ms(fn, reps=20, iters=iters)

    def cpu_median_ms(fn):
        fn()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return cpu_median_ms


def _call(kind: str, shape, device: torch.device):
    """A no-argument function running ``kind``'s kernel on random tensors of ``shape``."""
    from tvm_qconv.schedules.training import elementwise as E
    from tvm_qconv.nn import functional, tvm_kernels

    n, c, h, w = shape
    gen = torch.Generator().manual_seed(0)
    if kind == "scale_sums":   # shape: the weight's OIHW; the sums in the tensor cores' [C, KH, KW, O]
        base = torch.randint(-2 ** 20, 2 ** 20, shape[1:] + shape[:1], generator=gen, dtype=torch.int32).to(device)
        sums, scale = base.permute(3, 0, 1, 2), (torch.rand(n, generator=gen) * 1e-6).to(device)
        return lambda: tvm_kernels.scale_sums(sums, scale)
    if kind == "flip_transpose":   # shape: the weight's OIHW (1000 classes: torch's flip and transpose)
        w_q = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
        return lambda: tvm_kernels.flip_transpose(w_q, 1)
    x = torch.randn(shape, generator=gen).to(device)
    bits = functional.pack_bits(torch.randn(shape, generator=gen) > 0).to(device)
    s, sc = torch.tensor(0.05, device=device), (torch.rand(c, generator=gen) * 0.05 + 0.01).to(device)
    if kind == "quantize":
        return lambda: tvm_kernels.quantize(x, s)
    if kind == "quantize_grad":
        return lambda: tvm_kernels.quantize_grad(x, bits, s, sc, sc)
    if kind == "grad_stats":
        return lambda: tvm_kernels.grad_stats(x, bits)
    if kind == "relu_bits":     # the fused tensor-core layer's: its range came with the dequantize
        wl, out = E.ElementwiseWorkload("relu_bits", shape), torch.empty((x.numel() + 7) // 8, dtype=torch.uint8,
                                                                        device=device)
        return lambda: tvm_kernels._call("relu_bits", wl, device, x.reshape(-1), out)
    if kind == "relu":
        return lambda: tvm_kernels.relu_with_bits(x)
    if kind == "mask":
        return lambda: tvm_kernels.mask(x, bits)
    if kind == "pack":
        x_q = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
        return lambda: tvm_kernels._pack_input_nhwc32(x_q)
    if kind == "pack_transposed":
        x_q = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)
        return lambda: tvm_kernels._pack_input_nhwc32(x_q, transpose=True, pad_rows=True)
    if kind == "max_pool":
        return lambda: tvm_kernels.max_pool(x)
    if kind == "max_pool_grad":
        out, index = tvm_kernels.max_pool(x)
        return lambda: tvm_kernels.max_pool_grad(out, index, shape)
    if kind == "dequantize":   # the fused layer's: per-channel scale, bias, ReLU, from NHWC32, its range
        acc = torch.randint(-2 ** 20, 2 ** 20, (n, h, w, -(-c // 32) * 32), generator=gen, dtype=torch.int32)
        acc, out = acc.to(device), torch.empty(shape, device=device)
        part = torch.empty((n, c // 8, h, w), dtype=torch.int32, device=device)
        wl = E.ElementwiseWorkload("dequantize", shape, per_channel=True, layout="nhwc32", bias=True, relu=True,
                                   amax=True)
        return lambda: tvm_kernels._call("dequantize", wl, device, acc, sc, sc, out, part, outputs=2)
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")


def measure(batch: int, image_size: int, device: torch.device, iters: int = 20,
            kinds: tuple[str, ...] = KINDS) -> dict:
    """Every call of :func:`workloads` of ``kinds`` timed; returns the JSON record (rows and the
    copy anchor).  The kernels are built first, in parallel (``tvm_kernels.prebuild``); each call's
    tensors are made for it and freed after it (all at once they would be ~40 bytes an activation
    element: ~19 GB at batch 32)."""
    from tvm_qconv.nn import tvm_kernels

    timer = _timer(device, iters)
    calls = [(kind, shape) for kind, shape in workloads(batch, image_size) if kind in kinds]

    def dry_run():
        for kind, shape in calls:
            _call(kind, shape, device)()

    built = tvm_kernels.prebuild(dry_run)
    print(f"prebuilt {len(built['built'])} kernels in {built['seconds']:.0f} s", flush=True)
    rows = []
    for kind, shape in calls:
        fn = _call(kind, shape, device)
        fn()    # load the kernel before timing
        ms = timer(fn)
        rows.append({"kind": kind, "shape": list(shape), "ms": ms, "bytes": bytes_moved(kind, shape)})
        del fn
    big = torch.empty(batch * 64 * image_size * image_size, device=device)
    dst = torch.empty_like(big)
    copy_ms = timer(lambda: dst.copy_(big))
    anchor = 2 * big.numel() * 4 / (copy_ms * 1e-3) / 1e9
    return {"benchmark": "elementwise_bandwidth", "device": _device_name(device), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "batch": batch,
            "image_size": image_size, "copy_gb_s": anchor, "rows": rows}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def by_kind(record: dict) -> list[dict]:
    """Rows summed by kind: ms, bytes, GB/s and % of the copy's bandwidth, most time first."""
    sums: dict[str, dict] = {}
    for r in record["rows"]:
        s = sums.setdefault(r["kind"], {"kind": r["kind"], "calls": 0, "ms": 0.0, "bytes": 0})
        s["calls"] += 1
        s["ms"] += r["ms"]
        s["bytes"] += r["bytes"]
    for s in sums.values():
        s["gb_s"] = s["bytes"] / (s["ms"] * 1e-3) / 1e9
        s["pct_of_copy"] = 100.0 * s["gb_s"] / record["copy_gb_s"]
    return sorted(sums.values(), key=lambda s: -s["ms"])


def table(record: dict) -> str:
    lines = [f"elementwise kernels of a VGG16 step, batch {record['batch']}, {record['image_size']} px, "
             f"{record['device']}; copy_ {record['copy_gb_s']:.0f} GB/s",
             "|kind|calls|ms|MB moved|GB/s|% of copy|", "|---|---|---|---|---|---|"]
    for s in by_kind(record):
        lines.append(f"|{s['kind']}|{s['calls']}|{s['ms']:.3f}|{s['bytes'] / 1e6:.1f}|{s['gb_s']:.0f}|"
                     f"{s['pct_of_copy']:.0f}|")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON")
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--image-size", type=positive_int, default=224,
                   help="input height and width (a multiple of 32: five pools)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds to time (default: all)")
    args = p.parse_args(argv)
    if args.image_size % 32:
        p.error(f"--image-size must be a multiple of 32 (VGG16 pools five times), got {args.image_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu (llvm builds) for a dry run")
    record = measure(args.batch, args.image_size, torch.device(args.device), args.iters, tuple(args.kinds))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"elementwise_bandwidth_b{args.batch}.json")
    write_json(path, record, indent=1)
    print(table(record))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
