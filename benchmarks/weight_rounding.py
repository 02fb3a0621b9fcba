"""Where a zoo model's int8 error comes from -- its activations or its weights -- and what GPTQ
weight rounding takes off the weights' share.

    python benchmarks/weight_rounding.py --models vgg16 mobilenet_v2 --size 224 --images 8 --out results/

The build's scheme simulated on the float graph it quantizes (``range_search``'s fake-quantized
model: every int8 point rounded at its calibrated range, 0..255 where the build stores it
unsigned, ``tvm_qconv.zoo``'s random-init network and observer), measured as the build's
verification measures it (logits SQNR against the float PyTorch model on the first
``--verify-images`` calibration photos):

- ``acts``: activations int8, weights float;
- ``weights``: weights int8 per output channel (rounded to nearest), activations float;
- ``both``: the library's scheme with nearest rounding;
- ``gptq_weights`` / ``gptq_both``: the same with the weights GPTQ rounded on the calibration
  photos (``QuantConfig.weight_rounding="gptq"``, ``tvm_qconv/ranges/weight_rounding.py``).

Writes ``<out>/weight_rounding_<size>px.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.zoo import SIZES, zoo_config, zoo_model  # noqa: E402
from tvm_qconv.ranges.calibrate import calibrate_candidates  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.ranges.search import FakeQuantModel  # noqa: E402
from tvm_qconv.ranges.weight_rounding import gptq_model  # noqa: E402
from tvm_qconv.fileio import write_json  # noqa: E402
from tvm_qconv.int8_module import float_graph  # noqa: E402
from tvm_qconv.quantization.zero_points import may_run_int8, planned_unsigned_names  # noqa: E402

# activations left float: a step of 1e-30 (float32's rounding is coarser) out to +-1e8
FLOAT_AMAX, FLOAT_LEVELS = 1e8, 1e38


def simulate(name: str, size: int, images: int, verify_images: int) -> dict:
    model = zoo_model(name)

    graph = float_graph(model, (1, 3, size, size))
    photos = skimage_photos(size)[:images]
    config = zoo_config(name, images)
    candidates, *_ = calibrate_candidates(graph, photos, config, (config.calibration,), progress=False)
    amax = {p: c[config.calibration] for p, c in candidates.items()}
    unsigned = planned_unsigned_names(graph, config)
    check = photos[:verify_images]
    with torch.no_grad():
        ref = model(torch.from_numpy(check)).numpy()

    def db(g, int8_weights, acts):
        sim = FakeQuantModel(g, int8_weights=int8_weights)
        if acts:
            return round(float(sqnr_db(ref, sim.logits(check, amax, unsigned))), 2)
        return round(float(sqnr_db(ref, sim.logits(check, {n: FLOAT_AMAX for n in amax}, frozenset(),
                                                   levels=FLOAT_LEVELS))), 2)

    layers = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense") and may_run_int8(ly, config)]
    t0 = time.time()
    rounded, report, _ = gptq_model(model, photos, layers)
    gptq_s = time.time() - t0
    g2 = float_graph(rounded, (1, 3, size, size))
    return dict(model=name, size=size, calibration=config.calibration, unsigned_points=len(unsigned),
                acts_db=db(graph, False, True), weights_db=db(graph, True, False), both_db=db(graph, True, True),
                gptq_weights_db=db(g2, False, False), gptq_both_db=db(g2, False, True),
                gptq_nearest_layers=report["nearest"], gptq_s=round(gptq_s, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES), metavar="MODEL")
    ap.add_argument("--size", type=int, default=None, help="image size (default: each model's zoo-test size)")
    ap.add_argument("--images", type=int, default=4, help="calibration photos (the zoo test: 4 on CPU, 8 on GPU)")
    ap.add_argument("--verify-images", type=int, default=4, help="photos the logits are compared on (the build's 4)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"weight_rounding_{args.size or 'zoo'}px.json")
    rows = []
    print("| model | size | acts int8 dB | weights int8 dB | both | GPTQ weights | both, GPTQ |\n|---|---|---|---|---|---|---|",
          flush=True)
    for name in args.models:
        t0 = time.time()
        row = simulate(name, args.size or SIZES[name], args.images, args.verify_images)
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"| {name} | {row['size']} | {row['acts_db']} | {row['weights_db']} | {row['both_db']} | "
              f"{row['gptq_weights_db']} | {row['gptq_both_db']} |", flush=True)
        res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="python " + " ".join(sys.argv),
                   images=args.images, verify_images=args.verify_images, rows=rows)
        write_json(path, res, indent=1)


if __name__ == "__main__":
    main()
