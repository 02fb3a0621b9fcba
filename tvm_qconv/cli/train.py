"""train.py: train a VGG on scikit-learn's digits, in float or int8 quantization-aware (QAT).

    python train.py --model small_vgg --epochs 5 --qat --out ckpt.pt

With --qat it trains the int8 model and, for comparison, the float model from the same initial
weights (--no-baseline skips it), then prints the float, post-training-quantized and QAT test
accuracies.  The checkpoint holds the float-compatible state dict, the learned ranges
("features.0.in0", "features.0.out", ...), the config and the accuracies; `deploy.py build
--checkpoint` compiles it with those ranges (no calibration).
"""
from __future__ import annotations

import argparse
import logging
import sys

from tvm_qconv import cli
from tvm_qconv.cli_args import positive_float as _positive_float
from tvm_qconv.cli_args import Parser, positive_int as _positive
from tvm_qconv.fileio import check_output_file
from tvm_qconv.nn.functional import INPUT_GRADS
from tvm_qconv.nn.modules import INPUT_RANGES
from tvm_qconv.training import MODELS, TrainConfig, run_training
from tvm_qconv.training.checkpoint import not_a_checkpoint


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default=d.model, help=f"model (default {d.model})")
    p.add_argument("--epochs", type=_positive, default=d.epochs, help=f"training epochs (default {d.epochs})")
    p.add_argument("--batch-size", type=_positive, default=d.batch_size, help=f"batch size (default {d.batch_size})")
    p.add_argument("--lr", type=_positive_float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument("--qat", action="store_true", help="quantization-aware training with the int8 layers")
    p.add_argument("--input-grad", choices=INPUT_GRADS, default=d.input_grad,
                   help="with --qat: input gradients in float32 (default) or from the gradient quantized to int8")
    p.add_argument("--weight-grad", choices=INPUT_GRADS, default=d.weight_grad,
                   help="with --qat: weight gradients in float32 (default) or from the gradient quantized to int8 "
                        "per channel")
    p.add_argument("--input-range", choices=INPUT_RANGES, default=d.input_range,
                   help="with --qat: quantize each layer's input with the batch's range (default) or the one "
                        "learned before the batch (delayed: what int8 activations between layers need)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="with --qat: do not train the float model for comparison")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"initialization, batch order, data split (default {d.seed})")
    p.add_argument("--out", default=None, help="checkpoint file to write (default: none)")
    p.add_argument("--force", action="store_true",
                   help="replace a file at --out that is not a train.py checkpoint (refused without it)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value, default in (("--input-grad", args.input_grad, "float32"),
                                 ("--weight-grad", args.weight_grad, "float32"),
                                 ("--input-range", args.input_range, "batch")):
        if value != default and not args.qat:
            parser.error(f"{flag} {value} is for the int8 layers: add --qat (the float model quantizes nothing)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = TrainConfig(model=args.model, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         qat=args.qat, seed=args.seed, input_grad=args.input_grad,
                         weight_grad=args.weight_grad, input_range=args.input_range)
    print("config:", config.to_dict(), "| baseline:", args.baseline and args.qat, "| out:", args.out)
    def train() -> int:
        if args.out:   # before any work: a file there that is not a checkpoint is the user's
            check_output_file(args.out, "checkpoint", ours=not_a_checkpoint, force=args.force)
        run_training(config, out=args.out, baseline=args.baseline, report=print)
        return 0
    code = cli.run(train, f"{args.out} was not written (a checkpoint there before is unchanged)" if args.out
                   else "nothing was saved")
    if code:
        return code
    if args.out and args.qat:
        print(f"compile it with its learned scales: python deploy.py build --checkpoint {args.out} --target llvm "
              f"-o build/{args.model}.so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
