"""The wgmma kernel's two epilogue stores, layer by layer: staged through shared memory (16-byte
row segments) against each thread's own 2-byte stores.

    python benchmarks/wgmma_epilogue.py --batch 64 --out results/

For every distinct conv of ResNet-50 and VGG16 (224 px) that the registry gives the wgmma family
at ``--batch``, builds the kernel with ``Config.staged_store`` on and off (each with the ring depth
``default_config`` gives it: the staged tiles take shared memory from the ring), checks that both
give the same output bit for bit, and times both (TVM ``time_evaluator``, median of 7 repeats of
>= 40 ms).  Prints ms, TOPS and the output's bandwidth (its int8 bytes / time); writes
``<out>/wgmma_epilogue_b<batch>.json``.  Why: profiled in ResNet-50 at batch 64 (H200,
``kernel_profile.py``), the short-K layers wrote their output at ~0.45 TB/s, 64->256 1x1 @56 at
58 TOPS (docs/history.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import tvm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import build_all  # noqa: E402
from tvm_qconv import registry  # noqa: E402
from tvm_qconv.schedules.kernel import tirx_kernel  # noqa: E402
from tvm_qconv.schedules.requantize import quantize_multiplier  # noqa: E402
from tvm_qconv.schedules.wgmma import conv2d  # noqa: E402
from tvm_qconv.schedules.workload import ConvWorkload  # noqa: E402
from tvm_qconv.target import TargetInfo, make_target  # noqa: E402

# (in, out, size, kernel, stride, relu): ResNet-50's bottleneck convs (the 7x7 stem excluded: the
# stem family), then VGG16's 3x3 convs past the first; repeated shapes listed once
RESNET50 = [(64, 64, 56, 1, 1, True), (64, 64, 56, 3, 1, True), (64, 256, 56, 1, 1, False),
            (256, 64, 56, 1, 1, True), (256, 128, 56, 1, 1, True), (128, 128, 56, 3, 2, True),
            (128, 512, 28, 1, 1, False), (256, 512, 56, 1, 2, False), (512, 128, 28, 1, 1, True),
            (128, 128, 28, 3, 1, True), (512, 256, 28, 1, 1, True), (256, 256, 28, 3, 2, True),
            (256, 1024, 14, 1, 1, False), (512, 1024, 28, 1, 2, False), (1024, 256, 14, 1, 1, True),
            (256, 256, 14, 3, 1, True), (1024, 512, 14, 1, 1, True), (512, 2048, 7, 1, 1, False),
            (1024, 2048, 14, 1, 2, False)]
VGG16 = [(64, 64, 224, 3, 1, True), (64, 128, 112, 3, 1, True), (128, 128, 112, 3, 1, True),
         (128, 256, 56, 3, 1, True), (256, 256, 56, 3, 1, True), (256, 512, 28, 3, 1, True),
         (512, 512, 28, 3, 1, True), (512, 512, 14, 3, 1, True)]


def workload(layer, batch):
    cin, cout, size, k, stride, relu = layer
    return ConvWorkload.with_activation("relu" if relu else "none", batch=batch, in_channels=cin, height=size,
                                        width=size, out_channels=cout, kernel=(k, k), stride=(stride, stride),
                                        padding=(k // 2,) * 4)


def config_of(wl, staged: bool):
    return conv2d.default_config(wl, staged_store=staged)


def build(job) -> float:
    layer, batch, staged, num_sm, path = job
    t = time.time()
    impl, wl, target = registry.get("conv2d.nhwc32.wgmma"), workload(layer, batch), make_target("cuda", "sm_90a")
    kernel = tirx_kernel(impl.compute(wl), conv2d.conv2d_wgmma(wl, config_of(wl, staged), num_sm))
    options = registry.compile_options([impl])
    with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        tvm.compile(tvm.IRModule({"main": kernel}), target=target,
                    tir_pipeline=options["tir_pipeline"]).export_library(path)
    return time.time() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    target = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    impl = registry.get("conv2d.nhwc32.wgmma")
    layers = [(model, ly) for model, lys in (("resnet50", RESNET50), ("vgg16", VGG16)) for ly in lys
              if impl.applies(workload(ly, args.batch), target)]
    libdir = os.path.join(args.out, "wgmma_epilogue_libs")
    os.makedirs(libdir, exist_ok=True)
    jobs = [(ly, args.batch, staged, target.num_sm, os.path.join(libdir, f"{model}_{'_'.join(map(str, ly))}_{staged}.so"))
            for model, ly in layers for staged in (False, True)]
    build_all(build, jobs, args.jobs)

    dev = tvm.cuda(0)
    rows = []
    for i, (model, ly) in enumerate(layers):
        wl = workload(ly, args.batch)
        rng = np.random.default_rng(0)
        cin, cout, size, k = ly[:4]
        x = rng.integers(-128, 128, (args.batch, cin, size, size)).astype(np.int8)
        w = rng.integers(-127, 128, (cout, cin, k, k)).astype(np.int8)
        bias = rng.integers(-5000, 5000, cout).astype(np.int32)
        mult, shift = quantize_multiplier(40 / (128 * 127 / 3 * np.sqrt(k * k * cin)) * rng.uniform(0.5, 2, cout))
        inputs = [registry.layout(impl.input_layout()).pack(x), *impl.pack_params(wl, w, bias, mult, shift)]
        row = dict(model=model, layer=ly, batch=args.batch)
        outs = {}
        for staged in (False, True):
            lib = tvm.runtime.load_module(jobs[2 * i + staged][-1])
            tensors = [tvm.runtime.tensor(a, dev) for a in [*inputs, np.full(impl.out_shape(wl), 77, np.int8)]]
            lib["main"](*tensors)
            outs[staged] = tensors[-1].numpy()
            secs = lib.time_evaluator("main", dev, number=10, repeat=7, min_repeat_ms=40)(*tensors).median
            key = "staged" if staged else "direct"
            row[key] = dict(ms=secs * 1e3, tops=wl.ops / secs / 1e12, out_tbps=outs[staged].nbytes / secs / 1e12,
                            config=dataclasses.asdict(config_of(wl, staged)))
        row["equal"] = bool(np.array_equal(outs[False], outs[True]))
        row["speedup"] = row["direct"]["ms"] / row["staged"]["ms"]
        rows.append(row)
        print(f"{model:8s} {cin:>4}->{cout:<4} {k}x{k} s{ly[4]} @{size:<3}: direct {row['direct']['ms']:.4f} ms "
              f"({row['direct']['tops']:.0f} TOPS, out {row['direct']['out_tbps']:.2f} TB/s), staged "
              f"{row['staged']['ms']:.4f} ms ({row['staged']['tops']:.0f} TOPS, out {row['staged']['out_tbps']:.2f} TB/s)"
              f" x{row['speedup']:.2f}" + ("" if row["equal"] else "  MISMATCH"), flush=True)
    res = dict(device=dev.device_name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command=" ".join(sys.argv), rows=rows)
    with open(os.path.join(args.out, f"wgmma_epilogue_b{args.batch}.json"), "w") as f:
        json.dump(res, f, indent=1)
    if not all(r["equal"] for r in rows):
        sys.exit("error: the two epilogues disagree (MISMATCH above)")
    return res


if __name__ == "__main__":
    main()
