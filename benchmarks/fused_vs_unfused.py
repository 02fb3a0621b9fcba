"""Seed 002's comparison: conv + bias + ReLU (+ requantize) fused in one kernel vs unfused, vs PyTorch.

    python benchmarks/fused_vs_unfused.py --out results/ [--tuning-log DIR]

On seed 002's four shapes (B, C_in, C_out, H=W), 3x3, stride 1, pad 1:
- fused: the project's one int8 kernel (dp4a conv, bias + ReLU + requantize in the epilogue);
- unfused: the same dp4a conv writing int32, then bias, ReLU and requantize as three separate
  elementwise kernels (what a library without epilogue fusion runs);
- PyTorch fp32 and fp16 (cuDNN, channels_last): conv2d with bias, then ReLU.
Times are medians of TVM's time_evaluator / CUDA events after warm-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402

from benchmarks.timing import cuda_median_ms  # noqa: E402
from tvm_qconv.schedules.nchw4c.conv2d import (conv2d_nchw4c_int8, conv2d_nchw4c_int8_ref,  # noqa: E402
                                               pack_channels, pack_oihw4o4i)
from tvm_qconv.schedules.nchw4c.dp4a import schedule_dp4a  # noqa: E402
from tvm_qconv.schedules.nchw4c.layout import ceil4, pack_nchw4c  # noqa: E402
from tvm_qconv.schedules.requantize import quantize_multiplier, requantize_tir  # noqa: E402
from tvm_qconv.schedules.workload import ConvWorkload  # noqa: E402
from tvm_qconv.target import make_target  # noqa: E402

SEED_002_SHAPES = [(4, 32, 64, 64), (4, 32, 32, 64), (8, 32, 64, 128), (8, 64, 64, 512)]


def _elementwise(shape, fn, dtype_in, dtype_out, extra=()):
    x = te.placeholder(shape, dtype_in, name="X")
    out = te.compute(shape, lambda *i: fn(x, *i), name="out")
    func = te.create_prim_func([x, *extra, out])
    sch = tvm.s_tir.Schedule(func)
    blk = sch.get_sblock("out")
    bx, tx = sch.split(sch.fuse(*sch.get_loops(blk)), [None, 256])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


def unfused_kernels(wl):
    occ = ceil4(wl.out_channels) // 4
    shape = (wl.batch, occ, wl.out_height, wl.out_width, 4)
    bias = te.placeholder((occ, 4), "int32", name="Bias")
    mult = te.placeholder((occ, 4), "int32", name="Mult")
    shift = te.placeholder((occ, 4), "int32", name="Shift")
    add = _elementwise(shape, lambda x, n, c, h, w, i: x[n, c, h, w, i] + bias[c, i], "int32", "int32", (bias,))
    relu = _elementwise(shape, lambda x, *i: tirx.max(x(*i), 0), "int32", "int32")
    req = _elementwise(shape, lambda x, n, c, h, w, i: requantize_tir(x[n, c, h, w, i], mult[c, i], shift[c, i], 0),
                       "int32", "int8", (mult, shift))
    return add, relu, req, shape


def build(func, target):
    with target:
        return tvm.compile(tvm.IRModule({"main": func}), target=target)


def time_ms(lib, dev, *args, number=20, repeat=10):
    lib["main"](*args)
    r = lib.mod.time_evaluator("main", dev, number=number, repeat=repeat)(*args)
    return float(np.median(r.results) * 1e3)


def torch_ms(b, cin, cout, hw, dtype):
    conv = torch.nn.Conv2d(cin, cout, 3, padding=1).cuda().to(dtype).to(memory_format=torch.channels_last)
    x = torch.randn(b, cin, hw, hw, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    with torch.no_grad():
        return cuda_median_ms(lambda: torch.relu(conv(x)), iters=30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    target, dev = make_target("cuda", args.arch), tvm.cuda(0)
    rng = np.random.default_rng(0)
    rows = []
    for b, cin, cout, hw in SEED_002_SHAPES:
        wl = ConvWorkload(batch=b, in_channels=cin, height=hw, width=hw, out_channels=cout)  # 3x3, pad 1, ReLU
        a = pack_nchw4c(rng.integers(-128, 128, (b, cin, hw, hw)).astype(np.int8))
        w = pack_oihw4o4i(rng.integers(-127, 128, (cout, cin, 3, 3)).astype(np.int8))
        bias = pack_channels(rng.integers(-5000, 5000, cout).astype(np.int32))
        m, s = quantize_multiplier(rng.uniform(1e-4, 1e-3, cout))
        mult, shift = pack_channels(m), pack_channels(s, fill=1)
        t = [tvm.runtime.tensor(v, dev) for v in (a, w, bias, mult, shift)]
        oshape = (b, ceil4(cout) // 4, hw, hw, 4)
        out8 = tvm.runtime.tensor(np.zeros(oshape, np.int8), dev)
        fused = build(schedule_dp4a(conv2d_nchw4c_int8(wl), target), target)
        fused_ms = time_ms(fused, dev, *t, out8)
        ok = np.array_equal(out8.numpy(), conv2d_nchw4c_int8_ref(wl, a, w, bias, mult, shift))
        conv32 = build(schedule_dp4a(conv2d_nchw4c_int8(dataclasses.replace(wl, out_dtype="int32")), target), target)
        add, relu, req, _ = (build(k, target) if not isinstance(k, tuple) else k for k in unfused_kernels(wl))
        acc, acc2 = (tvm.runtime.tensor(np.zeros(oshape, np.int32), dev) for _ in range(2))
        out8b = tvm.runtime.tensor(np.zeros(oshape, np.int8), dev)
        parts = dict(conv=time_ms(conv32, dev, t[0], t[1], acc), bias=time_ms(add, dev, acc, t[2], acc2),
                     relu=time_ms(relu, dev, acc2, acc), requant=time_ms(req, dev, acc, t[3], t[4], out8b))
        ok_unfused = np.array_equal(out8b.numpy(), out8.numpy())
        ops = wl.ops
        row = dict(shape=f"B={b} Cin={cin} Cout={cout} H=W={hw}", fused_ms=fused_ms, unfused_ms=sum(parts.values()),
                   unfused_parts_ms=parts, speedup=sum(parts.values()) / fused_ms, fused_tops=ops / fused_ms / 1e9,
                   bit_exact=bool(ok and ok_unfused), torch_fp32_ms=torch_ms(b, cin, cout, hw, __import__("torch").float32),
                   torch_fp16_ms=torch_ms(b, cin, cout, hw, __import__("torch").float16))
        rows.append(row)
        print(json.dumps(row))
    res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               device=str(tvm.cuda(0).device_name), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fused_vs_unfused.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['device']}, {res['date']} (default dp4a schedule)")
    print("| shape | fused int8 ms | unfused int8 ms (conv + bias + relu + requant) | speedup | torch fp32 ms | torch fp16 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        p = r["unfused_parts_ms"]
        print(f"| {r['shape']} | {r['fused_ms']:.4f} | {r['unfused_ms']:.4f} ({p['conv']:.4f} + {p['bias']:.4f} + "
              f"{p['relu']:.4f} + {p['requant']:.4f}) | {r['speedup']:.2f}x | {r['torch_fp32_ms']:.4f} | "
              f"{r['torch_fp16_ms']:.4f} |")


if __name__ == "__main__":
    main()
