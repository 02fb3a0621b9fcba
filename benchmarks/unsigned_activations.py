"""What unsigned int8 activations would buy: the scheme simulated with and without them.

    python benchmarks/unsigned_activations.py --models mobilenet_v2 googlenet --size 224 --images 8 --out results/

By default every int8 tensor of the build is symmetric: ``s = amax / 127``, values -127..127.  A
tensor that is never negative (after a ReLU / ReLU6, a max pool of one, a concat of such) uses
only 0..127 of that grid: 7 bits.  Rounded to 0..255 at the same range (``s = amax / 255``, u8, or
s8 with zero point -128) its rounding noise falls 4x (+6 dB on that tensor).  This script says
what that does to the logits with every never-negative tensor unsigned; the build does it where
every reader can take it (``QuantConfig.unsigned_activations``, ``tvm_qconv/zero_points.py``).

Per zoo model (``tvm_qconv.zoo``'s random-init network and calibration), the float graph the
build quantizes is run with every int8 point fake-quantized (``range_search.FakeQuantModel``:
``clip(round(x / s), -L, L) * s``), the weights rounded per output channel or not, with L = 127 at
every point ("signed", today's scheme) or L = 255 at the points whose calibration values were all
>= 0 ("unsigned").  Logits SQNR against the float PyTorch model on the first ``--verify-images``
calibration photos, as the build's own verification measures it.  Writes
``<out>/unsigned_activations_<size>px.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.zoo import SIZES, zoo_config, zoo_model  # noqa: E402
from tvm_qconv.ranges.calibrate import FloatPoints, calibrate_candidates  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402
from tvm_qconv.fileio import write_json  # noqa: E402
from tvm_qconv.int8_module import float_graph  # noqa: E402
from tvm_qconv.ranges.search import FakeQuantModel  # noqa: E402


def never_negative(graph, images: np.ndarray) -> set[str]:
    """The points whose float values on ``images`` are all >= 0."""
    low: dict = {}
    for _, values in FloatPoints(graph)(images):
        for name, v in values.items():
            low[name] = min(low.get(name, np.inf), float(v.min()))
    return {n for n, lo in low.items() if lo >= 0}


def simulate(name: str, size: int, images: int, verify_images: int, calibration: str | None = None) -> dict:
    model = zoo_model(name)
    graph = float_graph(model, (1, 3, size, size))
    photos = skimage_photos(size)[:images]
    config = zoo_config(name, images)
    if calibration is not None:
        config = dataclasses.replace(config, calibration=calibration)
    candidates, *_ = calibrate_candidates(graph, photos, config, (config.calibration,), progress=False)
    amax = {p: c[config.calibration] for p, c in candidates.items()}
    unsigned = never_negative(graph, photos)
    check = photos[:verify_images]
    with torch.no_grad():
        ref = model(torch.from_numpy(check)).numpy()
    row = dict(model=name, size=size, calibration=config.calibration, points=len(amax),
               never_negative=len(unsigned))
    for weights in (False, True):
        sim = FakeQuantModel(graph, int8_weights=weights)
        tag = "weights_acts" if weights else "acts"
        row[f"{tag}_signed_db"] = round(sqnr_db(ref, sim.logits(check, amax)), 2)
        row[f"{tag}_unsigned_db"] = round(sqnr_db(ref, sim.logits(check, amax, unsigned)), 2)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES), metavar="MODEL")
    ap.add_argument("--size", type=int, default=None, help="image size (default: each model's zoo-test size)")
    ap.add_argument("--images", type=int, default=4, help="calibration photos (the zoo test: 4 on CPU, 8 on GPU)")
    ap.add_argument("--verify-images", type=int, default=4, help="photos the logits are compared on (the build's 4)")
    ap.add_argument("--calibration", choices=["percentile", "max", "entropy", "mse"], default=None,
                    help="the observer (default: the zoo test's, tvm_qconv/zoo.py zoo_config)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"unsigned_activations_{args.size or 'zoo'}px{'_' + args.calibration if args.calibration else ''}.json")
    rows = []
    print("| model | size | never-negative points | acts int8: signed dB | unsigned | acts + weights int8: signed "
          "dB | unsigned | gain dB |\n|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        t0 = time.time()
        row = simulate(name, args.size or SIZES[name], args.images, args.verify_images, args.calibration)
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"| {name} | {row['size']} | {row['never_negative']}/{row['points']} | {row['acts_signed_db']} | "
              f"{row['acts_unsigned_db']} | {row['weights_acts_signed_db']} | {row['weights_acts_unsigned_db']} | "
              f"{row['weights_acts_unsigned_db'] - row['weights_acts_signed_db']:+.2f} |", flush=True)
        res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="python " + " ".join(sys.argv),
                   images=args.images, verify_images=args.verify_images, rows=rows)
        write_json(path, res, indent=1)


if __name__ == "__main__":
    main()
