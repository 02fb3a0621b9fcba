"""What a trained network's int8 error is made of, held out from calibration (issue 58).

    python benchmarks/error_budget.py --models mobilenet_v2 efficientnet_lite0 --out results/

The model is calibrated as ``deploy.py build`` calibrates it (the default scheme, scikit-image's
photos), then its fake-quantized float graph (``ranges/search.py: FakeQuantModel``, conv and matmul
in torch) is scored on foolbox's 20 labelled ImageNet photos against the float model, one source of
error at a time:

- ``clip``: every activation clipped at its calibrated range, nothing rounded (the rounding grid
  made 10^7 levels fine): what the observer's cut costs on photos it never saw;
- ``activations``: clipped and rounded to int8 (0..255 where the build stores a tensor unsigned);
- ``weights``: weights rounded per output channel, activations only clipped;
- ``all``: both (bias correction is the library's, not simulated here: ``scheme_heldout.py``
  scores the real library).

Then, per activation tensor, the logits SQNR gained when that tensor alone is left unrounded
(the rest as ``activations``): whether a few tensors hold the loss or it is spread.  Writes
``<out>/error_budget.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FINE = 1e7   # levels of a grid that rounds nothing (float32 keeps x / (amax / 1e7) to ~1e-7)


def budget(model_name: str) -> dict:
    import tvm

    import scheme_heldout
    from tvm_qconv import pip_assets, pipeline
    from tvm_qconv.config import QuantConfig
    from tvm_qconv.data import static_batches
    from tvm_qconv.evaluate import sqnr_db
    from tvm_qconv.labelled_images import labelled_images, read_batch
    from tvm_qconv.pipeline import BuildState
    from tvm_qconv.quantization.zero_points import planned_unsigned_names
    from tvm_qconv.ranges.search import FakeQuantModel
    from tvm_qconv.target import TargetInfo, make_target

    size = scheme_heldout.MODELS[model_name]
    model = scheme_heldout.load(model_name)
    llvm = make_target("llvm")
    q = pipeline.run(BuildState(model, (1, 3, size, size), TargetInfo.from_target(llvm), config=QuantConfig(),
                                target=llvm), until="ranges")
    x, _ = read_batch(labelled_images(*pip_assets.foolbox_imagenet()), 0, 20, size)
    unsigned = planned_unsigned_names(q.graph, q.config)
    sims = {False: FakeQuantModel(q.graph), True: FakeQuantModel(q.graph, int8_weights=True)}
    names = sims[False].names

    def logits(int8_weights: bool, fine=frozenset()) -> np.ndarray:
        """The simulated logits: every point at its int8 grid but those in ``fine`` (clipped only)."""
        sim, scalars = sims[int8_weights], []
        for n in names:
            grid = FINE if n in fine else 255.0 if n in unsigned else 127.0
            scalars += [tvm.runtime.tensor(np.array(max(q.amax[n], 1e-30) / grid, np.float32), tvm.cpu()),
                        tvm.runtime.tensor(np.array(grid, np.float32), tvm.cpu())]
        out = [sim._quant["main"](tvm.runtime.tensor(b, tvm.cpu()), *scalars).numpy()[:n]
               for n, b in static_batches(x, sim.batch)]
        return np.concatenate(out).reshape(len(x), -1)

    ref = sims[False].logits(x)
    every = frozenset(names)
    rows = dict(clip=sqnr_db(ref, logits(False, every)), activations=sqnr_db(ref, logits(False)),
                weights=sqnr_db(ref, logits(True, every)), all=sqnr_db(ref, logits(True)))
    gains = {n: sqnr_db(ref, logits(False, frozenset({n}))) - rows["activations"] for n in names}
    top = sorted(gains, key=gains.get, reverse=True)
    return dict(model=model_name, image_size=size, points=len(names),
                sqnr_db={k: round(float(v), 2) for k, v in rows.items()},
                point_gain_db={n: round(float(gains[n]), 2) for n in top},
                top5_gain_db=round(float(sum(gains[n] for n in top[:5])), 2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["mobilenet_v2", "efficientnet_lite0"])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [budget(m) for m in args.models]
    with open(os.path.join(args.out, "error_budget.json"), "w") as f:
        json.dump({"date": started, "command": "python benchmarks/error_budget.py " + " ".join(argv or sys.argv[1:]),
                   "device": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows}, f, indent=1)
    print("| model | clip only | activations (clip + round) | weights (+ clip) | all | best 5 tensors unrounded |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = r["sqnr_db"]
        print(f"| {r['model']} | {s['clip']:.1f} | {s['activations']:.1f} | {s['weights']:.1f} | {s['all']:.1f} | "
              f"+{r['top5_gain_db']:.1f} dB of {r['points']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
