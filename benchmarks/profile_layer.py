"""Run one int8 conv kernel of a family a few times, for a profiler to look at.

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python benchmarks/profile_layer.py --family mma --cin 256 --cout 256 --size 56 --batch 64

Builds the family's default schedule for one 3x3 conv (pad 1), runs it ``--runs`` times on
random int8 data and prints its median time (TVM time_evaluator) and TOPS.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tvm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv import registry  # noqa: E402
from tvm_qconv.schedules.requantize import quantize_multiplier  # noqa: E402
from tvm_qconv.schedules.workload import ConvWorkload  # noqa: E402
from tvm_qconv.target import TargetInfo, device_arch, make_target  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="mma", help="mma, wgmma (H100 / H200) or dp4a")
    ap.add_argument("--cin", type=int, default=256)
    ap.add_argument("--cout", type=int, default=256)
    ap.add_argument("--size", type=int, default=56)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    target = make_target("cuda", device_arch(full=True))
    wl = ConvWorkload.with_activation("relu", batch=args.batch, in_channels=args.cin, height=args.size,
                                      width=args.size, out_channels=args.cout)
    impl = next(i for i in registry.candidates("conv2d", wl, TargetInfo.from_target(target)) if i.family == args.family)
    lib = registry.compile_kernel(impl, wl, target)
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = rng.integers(-127, 128, (wl.out_channels, wl.in_channels, 3, 3)).astype(np.int8)
    mult, shift = quantize_multiplier(np.full(wl.out_channels, 1e-3))
    params = impl.pack_params(wl, w, np.zeros(wl.out_channels, np.int32), mult, shift)
    out = np.zeros(impl.out_shape(wl), np.int8)
    args_ = [tvm.runtime.tensor(a, dev) for a in [registry.layout(impl.input_layout()).pack(x), *params, out]]
    for _ in range(args.runs):
        lib["main"](*args_)
    dev.sync()
    secs = lib.mod.time_evaluator("main", dev, number=5, repeat=5)(*args_).median
    print(f"{impl.name} {wl.describe()}: {secs * 1e3:.4f} ms, {wl.ops / secs / 1e12:.1f} TOPS")


if __name__ == "__main__":
    main()
