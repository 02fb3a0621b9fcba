"""Per-layer speed of each conv kernel family on VGG16's convs, against the instruction peaks.

    python benchmarks/int8_peaks.py --out results/
    python benchmarks/conv_layers.py --batches 1 64 --peaks results/int8_peaks.json --out results/

For every distinct 3x3 conv of VGG16 (224 px) at each batch size, builds every kernel
implementation of the registry that applies on this GPU (its default, untuned schedule: dp4a in
NCHW4c, mma.sync tensor cores and, on an H100 / H200, wgmma in NHWC32), builds in parallel, then
on the GPU: checks the output (batch 1: bit-exact against the implementation's NumPy reference;
larger batches: the families bit-identical to each other; a layer only one family runs is not
checked there: "exact" None), times it (TVM ``time_evaluator``, median of 7 repeats of >= 40 ms)
and reports ms, TOPS and % of the peak of the kernel's instruction (``--peaks``, the JSON of
``int8_peaks.py``).  With ``--cudnn``, cuDNN's fused int8 conv of the same layer in the same run
(``cudnn_int8.py``: every plan timed, the fastest kept) and each kernel's speed as % of it.
Writes ``<out>/conv_layers.json`` and prints a markdown table.
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
from tvm_qconv.compare import cudnn_int8  # noqa: E402
from tvm_qconv.schedules.requantize import quantize_multiplier  # noqa: E402
from tvm_qconv.schedules.workload import ConvWorkload  # noqa: E402
from tvm_qconv.target import TargetInfo, device_arch, make_target  # noqa: E402
from tvm_qconv.tuning import read_peaks  # noqa: E402

# VGG16's convs (in, out, size); 3x3, stride 1, pad 1, ReLU; repeated layers listed once
VGG16_CONVS = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
               (256, 512, 28), (512, 512, 28), (512, 512, 14)]


def workload(layer, batch):
    cin, cout, size = layer
    return ConvWorkload.with_activation("relu", batch=batch, in_channels=cin, height=size, width=size,
                                        out_channels=cout)


def implementations(wl, arch):
    return [i for i in registry.candidates("conv2d", wl, TargetInfo.from_target(make_target("cuda", arch)))]


def build(job) -> float:
    """Build one (layer, batch, implementation) to ``path``; returns the build seconds."""
    layer, batch, name, arch, path = job
    t = time.time()
    registry.compile_kernel(registry.get(name), workload(layer, batch), make_target("cuda", arch)).export_library(path)
    return time.time() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--peaks", help="int8_peaks.json of this GPU (for the %% of peak columns)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="results")
    ap.add_argument("--cudnn", action="store_true",
                    help="time cuDNN's int8 fused conv of each layer too (needs nvidia-cudnn-frontend)")
    ap.add_argument("--arch", default=None,
                    help="default: this GPU's, as sm_90a on an sm_90 GPU (the wgmma family needs it)")
    args = ap.parse_args(argv)
    arch = args.arch or device_arch(full=True)
    cudnn_ms = {}                     # (layer, batch) -> cuDNN's fastest plan, or None: not timed
    if args.cudnn:
        why = cudnn_int8.missing()
        if why:
            sys.exit(f"error: --cudnn: {why}")
    peaks = read_peaks(args.peaks) if args.peaks else {}
    libdir = os.path.join(args.out, "conv_layers_libs")
    os.makedirs(libdir, exist_ok=True)
    jobs = [(layer, b, impl.name, arch, os.path.join(libdir, f"{impl.name}_{layer[0]}_{layer[1]}_{layer[2]}_b{b}.so"))
            for b in args.batches for layer in VGG16_CONVS for impl in implementations(workload(layer, b), arch)]
    build_s = build_all(build, jobs, args.jobs)

    dev = tvm.cuda(0)
    rows = []
    for (layer, b, name, _, path), secs_build in zip(jobs, build_s):
        impl, wl = registry.get(name), workload(layer, b)
        rng = np.random.default_rng(0)  # the same layer data for every implementation
        x = rng.integers(-128, 128, (b, layer[0], layer[2], layer[2])).astype(np.int8)
        w = rng.integers(-127, 128, (layer[1], layer[0], 3, 3)).astype(np.int8)
        bias = rng.integers(-5000, 5000, layer[1]).astype(np.int32)
        # outputs spread over ~40 int8 steps (accumulator std ~ 128*127/3 * sqrt(K))
        mult, shift = quantize_multiplier(40 / (128 * 127 / 3 * np.sqrt(9 * layer[0])) * rng.uniform(0.5, 2, layer[1]))
        params = impl.pack_params(wl, w, bias, mult, shift)
        inputs = [registry.layout(impl.input_layout()).pack(x), *params]
        lib = tvm.runtime.load_module(path)
        out = np.full(impl.out_shape(wl), 77, np.int8)  # poisoned
        tensors = [tvm.runtime.tensor(a, dev) for a in [*inputs, out]]
        lib["main"](*tensors)
        got = tensors[-1].numpy()
        logical = registry.layout(impl.layout).unpack(got, layer[1])
        if b == 1:
            exact = bool(np.array_equal(got, impl.reference(wl, *inputs)))
        else:  # the first family of this layer is the yardstick of the others
            first = next((r for r in rows if r["layer"] == layer and r["batch"] == b), None)
            exact = None if first is None else bool(np.array_equal(logical, first["_logical"]))
        secs = lib.time_evaluator("main", dev, number=10, repeat=7, min_repeat_ms=40)(*tensors).median
        tops = wl.ops / secs / 1e12
        peak = peaks.get(impl.instruction)
        if args.cudnn and (layer, b) not in cudnn_ms:
            try:
                cudnn_ms[layer, b] = cudnn_int8.time_workload(wl)
                print(f"{layer[0]:>3}->{layer[1]:<3} @{layer[2]:<3} b{b:<3} {'cudnn':>20}: "
                      f"{cudnn_ms[layer, b]['ms']:8.4f} ms ({cudnn_ms[layer, b]['plans']} plans)", flush=True)
            except Exception as e:       # a row that says why, and the run carries on
                print(f"cuDNN failed on {layer} b{b}: {type(e).__name__}: {e}", flush=True)
                cudnn_ms[layer, b] = None
        cu = cudnn_ms.get((layer, b))
        row = dict(layer=layer, batch=b, impl=name, family=impl.family, ms=secs * 1e3, tops=tops,
                   pct_of_peak=100 * tops / peak if peak else None, exact=exact, build_s=secs_build,
                   cudnn=cu, pct_of_cudnn=100 * cu["ms"] / (secs * 1e3) if cu else None)
        if b > 1 and not any(r["layer"] == layer and r["batch"] == b for r in rows):
            row["_logical"] = logical
        rows.append(row)
        print(f"{layer[0]:>3}->{layer[1]:<3} @{layer[2]:<3} b{b:<3} {name:>20}: {row['ms']:8.4f} ms "
              f"{tops:7.1f} TOPS" + (f" ({row['pct_of_peak']:.0f} % of {impl.instruction})" if peak else "")
              + ("  MISMATCH" if exact is False else ""), flush=True)
    for r in rows:
        r.pop("_logical", None)
    res = dict(device=dev.device_name, arch=arch, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               peaks=peaks, rows=rows)
    with open(os.path.join(args.out, "conv_layers.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| conv | batch | family | ms | TOPS | % of its peak | cuDNN ms | % of cuDNN | exact |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pct = f"{r['pct_of_peak']:.0f}" if r["pct_of_peak"] else "-"
        cu = f"{r['cudnn']['ms']:.4f} | {r['pct_of_cudnn']:.0f}" if r["cudnn"] else "- | -"
        print(f"| {r['layer'][0]}->{r['layer'][1]} @{r['layer'][2]} | {r['batch']} | {r['family']} | "
              f"{r['ms']:.4f} | {r['tops']:.0f} | {pct} | {cu} | {r['exact']} |")
    if any(r["exact"] is False for r in rows):
        sys.exit("error: some kernels disagree with the reference (MISMATCH above)")
    return res


if __name__ == "__main__":
    main()
