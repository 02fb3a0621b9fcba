"""tune.py: MetaSchedule-tune the int8 conv kernels of a model for a CUDA GPU (--target cuda, the
default) or for the CPU (--target llvm).

    python tune.py --model vgg16 --batch 1 --arch sm_90a --trials 1 --prune     (H100 / H200: every family's
                                                                                default, every wgmma tile)
    python deploy.py build --model vgg16 --batch 1 --target cuda --arch sm_90a \\
        --tuning-log tuning_logs/vgg16-b1-sm_90a -o build/vgg16_tuned.so

Every distinct conv layer is one task per kernel family that can run it (on sm_80+: int8 tensor
cores and dp4a; on sm_90a also Hopper's wgmma, whose few tiles per layer are each measured once;
the build picks the fastest per layer; --family limits it), tuned until
it has --trials valid measurements on this machine's GPU (with --target llvm: its CPU) in a
MetaSchedule database under
tuning_logs/<model>-b<batch>-<arch>/ (<model>-b<batch>-llvm/ for the CPU; logs/
holds MetaSchedule's full per-task logs).  Run the same command again to continue an
interrupted run: records already in the database count, finished tasks are skipped.  Tune with
the batch size and image size you will build with: the database matches kernels by their exact
shape.

Where the candidates are measured:

    python tune.py --model vgg16 --batch 64 --local-gpus 2         this machine's first 2 GPUs, through
                                                                   a tracker and 2 RPC servers it starts
                                                                   on 127.0.0.1 and stops at the end
    python tune.py --model vgg16 --rpc-tracker 127.0.0.1:9190 --rpc-key h100
                                                                   the GPUs of a tracker's servers (e.g. a
                                                                   GPU machine reached by ssh -L): build
                                                                   here, measure there, one candidate per
                                                                   server at a time
    python tune.py --model resnet18 --target llvm                  this CPU (or --rpc-* for another one)

The training step's int8 convs (``models/``, ``train.py``) are tiled per conv by measurement too:

    python tune.py --training --model vgg16 --batch 32             every conv of one step (forward, dx, dw):
                                                                   the mma.sync template's tiles, fastest kept
                                                                   in tuning_logs/training-convs-<arch>.json
"""
from __future__ import annotations

import argparse
import sys

from tvm_qconv import cli
from tvm_qconv.cli_args import Parser, positive_int as _positive
from tvm_qconv.errors import InputError

# This module parses; the tuning itself (tvm_qconv/cli/tune_commands.py) imports TVM, torch and the
# tuning package, and is loaded (_work) only once the arguments are parsed: --help and a bad flag
# answer at once, not after the ~5 s of that import.


def _work():
    """The tuning's work, :mod:`tvm_qconv.cli.tune_commands`, imported on first use."""
    from tvm_qconv.cli import tune_commands  # after parsing: torch + tvm, ~5 s, only once the arguments are valid
    return tune_commands


def run_job(job):
    """:func:`tvm_qconv.tuning.tune` of ``job`` (a name tests can replace).

    Returns:
        One row per task.
    """
    return _work().run_job(job)


def _arch(text: str) -> str:
    if not (text.startswith("sm_") and text[3:].rstrip("a").isdigit()):
        raise argparse.ArgumentTypeError(f"expected a CUDA arch such as sm_90 or sm_80, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="torchvision classifier name, e.g. vgg16, resnet50")
    p.add_argument("--batch", type=_positive, default=1, help="batch size to tune for (default 1)")
    p.add_argument("--target", choices=["cuda", "llvm"], default="cuda",
                   help="cuda (default: the mma and dp4a families) or llvm (the CPU conv)")
    p.add_argument("--arch", type=_arch, default="sm_90", help="CUDA arch of the GPU (default sm_90)")
    p.add_argument("--trials", type=_positive, default=64,
                   help="valid measurements per task, counting those already in the database (default 64); the "
                        "wgmma family's few tiles per layer are all measured whatever this says")
    p.add_argument("--work-dir", default=None,
                   help="database folder (default tuning_logs/<model>-b<batch>-<arch>)")
    p.add_argument("--image-size", type=_positive, default=224, help="input height = width (default 224)")
    p.add_argument("--workers", type=_positive, default=None, help="parallel builds (default: all CPU cores)")
    p.add_argument("--trials-per-iter", type=_positive, default=32,
                   help="candidates built and measured per round (default 32)")
    p.add_argument("--space", default=None,
                   help="search space by name (default: each kernel implementation's first; on sm_90a give "
                        "--family mma or dp4a with it, wgmma's one space is its tiles); mma.sync and dp4a "
                        "have template (the default schedule's structure with its decisions searched); dp4a also "
                        "has mlt (MetaSchedule's generic multi-level tiling): see schedules/nchw4c/dp4a_space.py "
                        "and schedules/tensorcore/space.py")
    p.add_argument("--family", action="append", default=None, metavar="FAMILY",
                   help="tune only this kernel family (wgmma: Hopper's, sm_90a; mma: int8 tensor cores; dp4a); "
                        "repeatable; default: every family that can run a layer, so that the build picks the "
                        "fastest one per layer")
    p.add_argument("--no-seed-default", action="store_true",
                   help="do not measure the default schedule first (by default it seeds the search, "
                        "so the tuned kernel is never slower than the default)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    p.add_argument("--only", nargs="+", default=None, metavar="TASK",
                   help="tune only these tasks (names as printed in the table, e.g. 64to64_3x3s1_224x224_b1)")
    p.add_argument("--peaks", metavar="FILE", default=None,
                   help="int8_peaks.json of this GPU (python benchmarks/int8_peaks.py --out DIR), to print "
                        "each task's %% of the peak of its kernel's instruction (dp4a or mma.sync)")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on the servers of this TVM RPC tracker (python -m tvm_qconv.cli.rpc_server --tracker "
                        "... --key K on each GPU machine; docs/usage.md#remote-gpus-tvm-rpc)")
    p.add_argument("--rpc-key", default=None, help="the key the tracker's servers registered with")
    p.add_argument("--local-gpus", type=_positive, default=None, metavar="N",
                   help="measure on this machine's first N GPUs at once (starts a tracker and N servers on "
                        "127.0.0.1, stops them at the end)")
    p.add_argument("--prune", action="store_true",
                   help="afterwards keep only the best record per task (small enough to commit)")
    t = p.add_argument_group("the training step's int8 convs (tvm_qconv/nn/conv_tiles.py)")
    t.add_argument("--training", action="store_true",
                   help="measure the mma.sync tiles of every int8 conv of one training step (forward, dx, dw) of "
                        "--model (vgg16, resnet50) at --batch on this machine's GPU and keep the fastest per conv in "
                        "tuning_logs/training-convs-<arch>.json, which the training kernels are then built with")
    t.add_argument("--seconds", type=_positive, default=None,
                   help="with --training: stop measuring after this long (what was measured is kept; run the same "
                        "command to go on)")
    t.add_argument("--redo", action="store_true", help="with --training: measure convs the table already holds again")
    return p


def tune_training(args) -> int:
    """``--training``: :func:`tvm_qconv.nn.conv_tiles.tune_model`."""
    if args.target != "cuda":
        raise InputError("--training measures the training step's CUDA kernels: drop --target llvm")
    return _work().tune_training_convs(args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.training:
        return cli.run(lambda: tune_training(args), "the convs measured so far are kept in the table: run the same "
                                                   "command to go on from them")
    work = _work()
    arch = args.arch if args.target == "cuda" else None
    work_dir = work.work_dir_of(args, arch)
    print(f"[tune] {args.model} batch={args.batch} size={args.image_size} target={args.target} {arch or ''} "
          f"trials/task={args.trials} per-iter={args.trials_per_iter} workers={args.workers or 'all cores'} "
          f"space={args.space or 'default'} seed={args.seed} only={args.only or 'all'} work_dir={work_dir}", flush=True)
    return cli.run(lambda: work.tune_tasks(args, arch, work_dir, run_job),
                   f"the measurements made so far are kept in {work_dir}: run the same command to go on from them")


if __name__ == "__main__":
    sys.exit(main())
