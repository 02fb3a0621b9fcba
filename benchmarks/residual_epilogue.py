"""The residual add in the conv's epilogue against the conv then the add kernel, layer by layer.

    python benchmarks/residual_epilogue.py --family mma --batch 64 --out results/

For ResNet-50's four residual convs (the last 1x1 of each bottleneck, 224 px, an unsigned residual
as the sm_90a plan has it) times, with TVM's ``time_evaluator`` (best of 5 repeats of 100 runs):
the family's plain conv kernel, the add kernel on its output (what the unfused build runs after
it), the family's fused kernel (``schedules/epilogue_residual.py``) and, where the GPU has wgmma,
the wgmma conv, which takes no residual: the build's choice is the fused kernel or wgmma + add.
Prints and writes ``<out>/residual_epilogue_<family>_b<batch>.json``.  Why: a wgmma epilogue that
added the residual was measured slower than wgmma + add at three of these four layers (H200,
2026-11-28; docs/performance.md) and was taken out.  The fused kernel's integers are checked in
``tests/test_residual_epilogue.py``, not here.
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

from tests.test_residual_epilogue import RESIDUALS, W, _fused_args  # noqa: E402
from tvm_qconv import registry  # noqa: E402
from tvm_qconv.schedules.workload import AddWorkload  # noqa: E402
from tvm_qconv.target import TargetInfo  # noqa: E402
from tvm_qconv.target import device_arch, make_target  # noqa: E402

# ResNet-50's residual convs at 224 px: (in channels, out channels, map size)
LAYERS = ((64, 256, 56), (128, 512, 28), (256, 1024, 14), (512, 2048, 7))


def measure(family: str, batch: int) -> list[dict]:
    impl = registry.get(f"conv2d.{'nchw4c' if family == 'dp4a' else 'nhwc32'}.{family}")
    dev, target = tvm.cuda(0), make_target("cuda", device_arch(full=True))
    wgmma = registry.get("conv2d.nhwc32.wgmma")
    residual = RESIDUALS[1]     # unsigned: the ReLU'd block input, as ResNet-50's sm_90a plan has it

    def timed(lib, args) -> float:
        f = lib.jit().time_evaluator("main", dev, number=100, repeat=5)
        return min(f(*[tvm.runtime.tensor(a, dev) for a in args]).results) * 1e6

    rows = []
    for c, o, size in LAYERS:
        wl = W("none", batch=batch, in_channels=c, height=size, width=size, out_channels=o, kernel=(1, 1),
               padding=(0, 0, 0, 0))
        args, fused_args, (m_c, m_r, shift) = _fused_args(impl, wl, residual, seed=7)
        out = np.zeros(impl.out_shape(wl), np.int8)
        plain = timed(registry.compile_kernel(impl, wl, target), [*args, out])
        fused = timed(registry.compile_kernel(impl, dataclasses.replace(wl, residual=residual), target),
                      [*fused_args, out])
        add_impl = registry.get(f"add.{impl.name.split('.')[1]}")   # the add in the conv's layout
        add_wl = AddWorkload(tuple(out.shape), m_c, m_r, shift, residual[3], residual[4], *residual[:3])
        add = timed(registry.compile_kernel(add_impl, add_wl, target), [out, fused_args[1], out.copy()])
        row = dict(layer=f"{c}->{o} 1x1 @{size} b{batch}", plain_us=round(plain, 2), add_us=round(add, 2),
                   unfused_us=round(plain + add, 2), fused_us=round(fused, 2), output_mb=round(out.nbytes / 1e6, 1))
        if family == "mma" and wgmma.applies(wl, TargetInfo.from_target(target)):   # same layout, same add
            w_args, _, _ = _fused_args(wgmma, wl, residual, seed=7)
            w_plain = timed(registry.compile_kernel(wgmma, wl, target), [*w_args, out])
            row.update(wgmma_plain_us=round(w_plain, 2), wgmma_unfused_us=round(w_plain + add, 2))
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="mma", choices=["mma", "dp4a"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not tvm.cuda(0).exist:
        print("residual_epilogue.py times CUDA kernels: no CUDA GPU is visible here (run it on the GPU machine)",
              file=sys.stderr)
        return 2
    rows = measure(args.family, args.batch)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"residual_epilogue_{args.family}_b{args.batch}.json")
    with open(path, "w") as f:
        json.dump(dict(rows=rows, device=tvm.cuda(0).device_name, family=args.family, batch=args.batch,
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       command=" ".join(["benchmarks/residual_epilogue.py", *sys.argv[1:]])), f, indent=1)
    print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
