"""How much a *float* network amplifies small input noise: the part of the zoo's int8 SQNR gap that
belongs to the random network, not to int8.

    python benchmarks/noise_gain.py --models mobilenet_v2 resnet50 vgg16 --size 64

Adds Gaussian noise at ``--input-db`` SQNR to scikit-image's photos and prints the float model's
logits SQNR (clean vs noisy), for the zoo's models (``tvm_qconv.zoo``: random init) and
for the same models with their BatchNorm statistics re-estimated on the photos.  A network whose
logits keep most of the input's dB is benign; one that falls far below it is chaotic, and no int8
scheme can reach a high SQNR on it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.zoo import zoo_model  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.evaluate import sqnr_db  # noqa: E402


def reestimate_batchnorm(model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """BatchNorm running statistics replaced by ``x``'s (cumulative average over one pass)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(x)
    return model.eval()


def noise_gain_db(model: torch.nn.Module, x: torch.Tensor, input_db: float, seed: int = 0) -> float:
    """Logits SQNR of ``model`` on ``x`` plus Gaussian noise at ``input_db`` SQNR."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen)
    noise *= x.norm() / noise.norm() * 10 ** (-input_db / 20)
    with torch.no_grad():
        return sqnr_db(model(x).numpy(), model(x + noise).numpy())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mobilenet_v2", "resnet50", "vgg16"])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--input-db", type=float, default=35.0, help="SQNR of the input noise")
    args = ap.parse_args(argv)
    x = torch.from_numpy(skimage_photos(args.size)[:args.images])
    print("| model | input dB | logits dB (zoo init) | logits dB (BatchNorm re-estimated) |")
    print("|---|---|---|---|")
    for name in args.models:
        plain = noise_gain_db(zoo_model(name), x, args.input_db)
        reest = noise_gain_db(reestimate_batchnorm(zoo_model(name), x), x, args.input_db)
        print(f"| {name} | {args.input_db:.1f} | {plain:.1f} | {reest:.1f} |")


if __name__ == "__main__":
    main()
