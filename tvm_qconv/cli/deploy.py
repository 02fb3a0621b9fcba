"""deploy.py: build an int8 library from a torchvision model or a QAT checkpoint, run it, evaluate it.

    python deploy.py build --model vgg16 --target llvm -o build/vgg16.so
    python deploy.py run --lib build/vgg16.so --image cat.jpg
    python deploy.py build --checkpoint ckpt.pt --target llvm -o build/small_vgg.so    # train.py --qat
    python deploy.py eval --lib build/small_vgg.so --dataset digits
    python deploy.py rpc --lib build/vgg16.so --tracker 127.0.0.1:9190 --key h100 --image cat.jpg
    python deploy.py export-onnx --model vgg16 -o build/vgg16.onnx     # int8 QDQ ONNX (TensorRT, ONNX Runtime)
    python deploy.py compare --model vgg16 --batch 1,16,64 --out results/  # against every baseline, one GPU
    python deploy.py accept build/vgg16.unverified.so   # use a library that failed its verification anyway
"""
from __future__ import annotations

import argparse
import json
import sys

from tvm_qconv import cli
from tvm_qconv.runtime.artifact import accept_unverified
from tvm_qconv.cli.deploy_flags import (accuracy_target, check_build_flags, check_library_output, command_inputs,
                                        quant_config, refuse_model_only_flags)
from tvm_qconv.cli_args import Parser, positive_float, positive_int as _positive
from tvm_qconv.compare.baselines import BASELINE_KEYS
from tvm_qconv.config import ACCURACY_TARGET_DB, CALIBRATIONS, PRESETS, WEIGHT_ROUNDINGS
from tvm_qconv.errors import InputError
from tvm_qconv.fileio import check_output_file

EXIT_UNVERIFIED = cli.EXIT_UNVERIFIED  # built, but its outputs disagree with the float model's (2: bad input)

# This module parses and checks; the commands' work (tvm_qconv/cli/deploy_commands.py) imports
# torch, TVM and the compiler, and is loaded (_work) only once the arguments are valid: --help, a
# bad flag or `accept` take ~0.2 s, not the ~5 s of that import.


def _work():
    """The commands' work, :mod:`tvm_qconv.cli.deploy_commands`, imported on first use."""
    from tvm_qconv.cli import deploy_commands  # after parsing: torch + tvm, ~5 s, only once the arguments are valid
    return deploy_commands


def _percentile(text: str) -> float:
    v = float(text)
    if not 50.0 < v <= 100.0:
        raise argparse.ArgumentTypeError(f"percentile must be in (50, 100], got {v}")
    return v


def _add_model_flags(b: argparse.ArgumentParser, batch_help: str) -> None:
    """The model-side flags `build` and `export-onnx` share: the model or checkpoint, its weights,
    the input shape and the quantization scheme."""
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="torchvision classifier name (vgg16, resnet50, ...), a float ONNX file "
                     "(model.onnx: its weights and image size come from the file) or your own model as "
                                      "path/to/file.py:factory (a function or class returning the nn.Module)")
    src.add_argument("--checkpoint", metavar="CKPT",
                     help="a checkpoint written by `train.py --qat --out CKPT`: its architecture, weights and "
                          "learned activation ranges (no calibration; --image-size comes from it)")
    b.add_argument("--weights", default=None,
                   help="(--model) a state-dict/checkpoint file, or a torchvision weight name (DEFAULT, "
                        "IMAGENET1K_V1); default: random init")
    b.add_argument("--num-classes", type=_positive, default=None, help="classifier width for random init (default 1000)")
    b.add_argument("--seed", type=int, default=0,
                   help="torch seed of a random init (default 0): the same command builds the same library")
    b.add_argument("--batch", type=_positive, default=1, help=batch_help)
    b.add_argument("--image-size", type=_positive, default=None,
                   help="input height = width (default 224; with --checkpoint: the size it was trained at)")
    b.add_argument("--scheme", choices=sorted(PRESETS), default="int8", help="named quantization preset (default int8)")
    b.add_argument("--calibration", choices=CALIBRATIONS, default=None,
                   help="activation observer, or search: the best of the four per tensor (overrides --scheme)")
    b.add_argument("--percentile", type=_percentile, default=None, help="percentile for --calibration percentile")
    b.add_argument("--skip", action="append", default=[], metavar="LAYER",
                   help="keep this layer in float: a torch module path (classifier.6) or a pattern "
                        "(classifier.*); repeatable")
    b.add_argument("--calib-dir", default=None, help="folder of calibration images (JPEG, PNG, BMP, WebP, GIF, TIFF) "
                                                     "(default: scikit-image's sample photos)")
    b.add_argument("--num-calib", type=_positive, default=None, help="use at most this many calibration images")
    b.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=None,
                   help="correct each conv / linear bias for its int8 weights' mean error on the calibration images "
                        "(default: on where the build calibrates and rounds to nearest)")
    b.add_argument("--weight-rounding", choices=WEIGHT_ROUNDINGS, default=None,
                   help="round int8 weights to nearest (default), or by GPTQ: column by column so that each layer's "
                        "output on the calibration images moves least")
    b.add_argument("--unsigned-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="store never-negative activations (after ReLU / ReLU6) as 0..255 at zero point -128 where "
                        "every reader can take it: half the rounding step there (default: on where the build "
                        "calibrates; off with --checkpoint and a Q/DQ file's own scales)")
    b.add_argument("--equalization", action=argparse.BooleanOptionalAction, default=None,
                   help="widen the narrow channels between two convs (one writes, one reads) so one per-tensor scale "
                        "fits them all; the float model is unchanged (default: off; it needs calibration)")


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print no progress (phases, bars), only the results and errors: for scripts")


def _add_force(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--force", action="store_true",
                   help=f"replace {what} (refused without it; the command's own inputs are never replaced)")


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes are positive integers separated by commas (1,16,64), got {text!r}")
    return values


def _baseline_keys(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in BASELINE_KEYS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"unknown baseline {', '.join(map(repr, unknown)) or repr(text)}: choose from "
                                         f"{', '.join(BASELINE_KEYS)}")
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    b = sub.add_parser("build", help="quantize, compile and export a model",
                       description="Import a torchvision classifier (or your own nn.Module), calibrate it on real "
                                   "images, quantize it to int8 (each conv + bias + activation one kernel of the "
                                   "family that suits the layer and the target: wgmma, mma.sync tensor cores, "
                                   "dp4a, or the CPU's), verify it against the float model and write <out>.so + "
                                   "<out>.params.npz + <out>.json.  A library that fails the verification is "
                                   "written as <out>.unverified.so instead, never over <out>.so (`deploy.py "
                                   "accept` takes it anyway).  With --checkpoint: the model a `train.py --qat` "
                                   "checkpoint was trained as, with its learned ranges instead of calibration.")
    _add_model_flags(b, batch_help="static batch size of the library (default 1)")
    b.add_argument("--target", choices=["llvm", "cuda"], default="llvm", help="CPU (llvm) or NVIDIA GPU (cuda)")
    b.add_argument("--arch", default=None,
                   help="CUDA arch for --target cuda (default sm_90; sm_90a adds the wgmma family, fastest on "
                        "H100 / H200, and its library runs on sm_90 GPUs only)")
    b.add_argument("--tuning-log", default=None, help="MetaSchedule database folder (tuning_logs/...) to apply")
    b.add_argument("--ignore-stale", action="store_true",
                   help="with --tuning-log: schedules tuned with an older template give their kernels the default "
                        "schedule (a warning) instead of stopping the build")
    b.add_argument("--cuda-graph", action="store_true",
                   help="(cuda) capture the kernel launches in a CUDA graph: less launch overhead at small batch")
    b.add_argument("--family", action="append", default=None, metavar="FAMILY",
                   help="prefer this kernel family (wgmma: Hopper, --arch sm_90a; mma: int8 tensor cores; dp4a; "
                        "cpu); repeatable, in order")
    b.add_argument("--no-verify", action="store_true",
                   help="do not run the built library against the float model on calibration images")
    b.add_argument("--verify-floor-db", type=float, default=None, metavar="DB",
                   help="fail the build when its logits' SQNR against the float model is under DB, and then "
                        "print each layer's SQNR (default 15)")
    b.add_argument("--accuracy-target", default=None, metavar="DB|top1:PCT",
                   help="keep the fewest conv / linear layers in float until the library reaches this on images held "
                        "out from calibration: a logits SQNR against the float model (30), or top1:PCT, top-1 "
                        "agreement with it on --data (top1:99); the layers are chosen by measured sensitivity, the "
                        "report lists them (exit 4 where even all kept misses it: the closest library is written). "
                        f"Without it every layer that can is int8, and the report names the layers that lose the "
                        f"most under {ACCURACY_TARGET_DB:g} dB for trained weights; 0 turns both off")
    b.add_argument("--data", default=None, metavar="DIR",
                   help="(--accuracy-target) the image folder the target is measured on, read as `eval --data` "
                        "reads it (default: 4 calibration images held out)")
    b.add_argument("--labels", default=None, metavar="FILE", help="(--data) its labels file, as `eval --labels`")
    b.add_argument("--debug-dump", default=None, metavar="DIR",
                   help="write the IR after each step of the pipeline into DIR (02_export.py ... 12_schedule.py)")
    b.add_argument("-o", "--output", required=True, help="the .so to write (params and report go beside it)")
    _add_force(b, "a file at -o (or its .params.npz / .json) that is not a library of this project")
    _add_quiet(b)
    x = sub.add_parser("export-onnx", help="write the calibrated int8 model as ONNX (Quantize/DequantizeLinear)",
                       description="Import a model, calibrate it on real images exactly as `build` does and write it "
                                   "as ONNX with explicit QuantizeLinear / DequantizeLinear pairs carrying this "
                                   "project's scales (int8 weights per output channel, int8 activations per tensor, "
                                   "float biases): the form TensorRT and ONNX Runtime read.  The layers "
                                   "`build --target llvm` keeps in float stay float.")
    _add_model_flags(x, batch_help="batch size to trace and calibrate at (default 1; the file runs at any batch "
                                   "unless --static-batch)")
    x.add_argument("--static-batch", action="store_true",
                   help="fix the batch dimension at --batch instead of naming it (dim_param 'batch')")
    x.add_argument("--opset", type=int, choices=range(17, 22), default=17, metavar="{17..21}",
                   help="ONNX opset (default 17)")
    x.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    _add_force(x, "a file at -o that is not an ONNX file this project wrote")
    _add_quiet(x)
    c = sub.add_parser("compare", help="time the int8 library against every baseline on this machine's GPU",
                       description="Build the model's int8 library (calibrated once) for each batch size and time "
                                   "it, one after another on the same device, beside PyTorch (fp32, TF32, fp16, "
                                   "bf16; channels_last, cudnn.benchmark; eager and CUDA graphs), "
                                   "torch.compile(mode='max-autotune') fp16, cuDNN's int8 fused convs (optional "
                                   "nvidia-cudnn-frontend; every plan timed, fastest kept, summed over the convs), "
                                   "ONNX Runtime (CUDA and CPU execution providers) and TensorRT on the exported "
                                   "Q/DQ model.  Each row: latency median and p99, images/s, device memory, "
                                   "build time, top-1 agreement and logits SQNR against fp32 PyTorch on the same "
                                   "real photos.  A baseline that cannot run is a row saying why.  Writes "
                                   "<out>/compare_<model>.json, .md and .png.  Rows (--baselines): "
                                   + ", ".join(BASELINE_KEYS) + ".")
    c.add_argument("--model", required=True, help="torchvision classifier name, path/to/file.py:factory or a "
                   "model.onnx (then the reference is ONNX Runtime's fp32 and the PyTorch rows are skipped)")
    c.add_argument("--weights", default=None, help="state-dict file or torchvision weight name; default: random "
                                                   "init seeded by --seed")
    c.add_argument("--num-classes", type=_positive, default=None, help="classifier width for random init")
    c.add_argument("--batch", type=_batches, default=(1, 16, 64), help="batch sizes, comma-separated (default 1,16,64)")
    c.add_argument("--image-size", type=_positive, default=None,
                   help="input height = width (default: an ONNX file's own where it fixes one, else 224)")
    c.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is a GPU")
    c.add_argument("--arch", default=None, help="CUDA arch of the int8 builds (default: the GPU's, sm_90a on H100)")
    c.add_argument("--lib", action="append", default=[], metavar="SO",
                   help="a library from `deploy.py build` to time in its batch size's slot instead of building one "
                        "(repeatable); built from other weights it is timed but not compared")
    c.add_argument("--tuning-log", default=None, metavar="DIR",
                   help="a tuning database, or a folder of <model>-b<N>-<arch> ones (tuning_logs/), for the builds")
    c.add_argument("--baselines", type=_baseline_keys, default=None, metavar="A,B",
                   help="only these rows, comma-separated (default: all)")
    c.add_argument("--scheme", choices=sorted(PRESETS), default="int8", help="quantization preset (default int8)")
    c.add_argument("--calib-dir", default=None, help="calibration images (default: scikit-image's photos)")
    c.add_argument("--input-sets", type=_positive, default=4, help="distinct inputs each row cycles over (default 4)")
    c.add_argument("--budget", type=positive_float, default=3.0, metavar="S",
                   help="seconds of timed runs per row (default 3; at least 3 runs, at most 200)")
    c.add_argument("--jobs", type=_positive, default=1, help="int8 builds in parallel (default 1)")
    c.add_argument("--agreement-floor", type=float, default=10.0, metavar="DB",
                   help="a row whose logits' SQNR against fp32 PyTorch is under DB is marked wrong and left out of "
                        "the speed-ups and the chart (default 10)")
    c.add_argument("--data", default=None, metavar="DIR",
                   help="a labelled image folder (as `eval --data`): each row's top-1 / top-5 on it beside the float "
                        "model's")
    c.add_argument("--labels", default=None, metavar="FILE", help="(--data) '<file> <label>' per line, a flat folder")
    c.add_argument("--classes", default=None, metavar="FILE", help="(--data) the class folders' indices")
    c.add_argument("--seed", type=int, default=0, help="torch seed of a random init (default 0)")
    c.add_argument("--work-dir", default="/tmp/tvm_qconv_compare", help="where the libraries and the ONNX model go")
    c.add_argument("--out", default="results", help="folder for compare_<model>.json / .md / .png (default results)")
    _add_quiet(c)
    r = sub.add_parser("run", help="run a built library on an image",
                       description="Load a built library with the TVM runtime only, classify images, print the "
                                   "top-5 classes and the latency.")
    r.add_argument("--lib", required=True, help="the .so written by `deploy.py build`")
    r.add_argument("--image", nargs="+", required=True,
                   help="image file(s) (JPEG, PNG, BMP, WebP, GIF, TIFF; skimage:NAME for scikit-image's "
                        "photos); one batch of the library's size")
    r.add_argument("--device", choices=["llvm", "cuda"], default=None, help="default: the library's target")
    r.add_argument("--repeat", type=_positive, default=5, help="timing repeats (median is printed)")
    _add_quiet(r)
    a = sub.add_parser("accept", help="use a library that failed its verification anyway",
                       description="Move <stem>.unverified.so (with its params and json), which `deploy.py build` "
                                   "wrote because the library failed its verification against the float model, to "
                                   "<stem>.so (or --output), replacing what is there.  Its json keeps the failed "
                                   "verification: every load of it warns.")
    a.add_argument("lib", help="the <stem>.unverified.so that `deploy.py build` wrote")
    a.add_argument("-o", "--output", default=None, help="where it goes (default: <stem>.so)")
    _add_force(a, "a file at -o (or its .params.npz / .json) that is not a library of this project")
    rp = sub.add_parser("rpc", help="run a built library on a remote device through TVM RPC",
                        description="Upload a built library and its params to a TVM RPC server (python -m "
                                    "tvm_qconv.cli.rpc_server on the GPU machine), classify images there, print the "
                                    "top-5 classes, the latency measured on the remote device (median, p90, p99) "
                                    "and its name.  TVM RPC has no authentication: reach a remote server through "
                                    "an ssh tunnel (docs/usage.md#remote-gpus-tvm-rpc).")
    rp.add_argument("--lib", required=True, help="the .so written by `deploy.py build`")
    rp.add_argument("--image", nargs="+", required=True,
                    help="image file(s) (JPEG, PNG, BMP, WebP, GIF, TIFF; skimage:NAME for scikit-image's "
                         "photos); one batch of the library's size")
    rp.add_argument("--host", default=None, help="the RPC server's address (with --port)")
    rp.add_argument("--port", type=int, default=None, help="the RPC server's port")
    rp.add_argument("--tracker", default=None, metavar="HOST:PORT", help="an RPC tracker (with --key), instead")
    rp.add_argument("--key", default=None, help="the key the tracker's GPU servers registered with")
    rp.add_argument("--repeat", type=_positive, default=100, help="timed runs (default 100; p99 wants >= 100)")
    rp.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for a free server of the tracker (default 60)")
    e = sub.add_parser("eval", help="accuracy of a built library on a labelled image folder or a test split",
                       description="Top-1 / top-5 of a built library on a labelled image folder (--data: one folder "
                                   "per class, or a flat folder with --labels), beside the float model's on the same "
                                   "images (--model), their top-1 agreement and the logits' SQNR; or, without --data, "
                                   "top-1 on the digits test split (the split train.py reports).")
    e.add_argument("--lib", required=True, help="the .so written by `deploy.py build`")
    e.add_argument("--data", default=None, metavar="DIR",
                   help="a labelled image folder: DIR/<class>/<image> (class = index, ImageNet WordNet id, the model's "
                        "category name, or --classes), or flat with --labels")
    e.add_argument("--labels", default=None, metavar="FILE", help="(--data) '<file> <label>' per line for a flat folder")
    e.add_argument("--classes", default=None, metavar="FILE",
                   help="(--data) the class folders' indices: one name per line in index order, 'name index' lines "
                        "or a JSON object")
    e.add_argument("--model", default=None,
                   help="(--data) the float model the library was built from (torchvision name with --weights, "
                        "path/to/file.py:factory or model.onnx): its accuracy, agreement and logits SQNR beside")
    e.add_argument("--weights", default=None, help="(--model) its state-dict file or torchvision weight name")
    e.add_argument("--limit", type=_positive, default=None, help="(--data) the first N images only")
    e.add_argument("--json", default=None, metavar="FILE", help="(--data) also write the result as JSON")
    _add_force(e, "a file at --json that is not an `eval` result")
    e.add_argument("--dataset", choices=["digits"], default="digits", help="without --data: test split (default digits)")
    e.add_argument("--seed", type=int, default=None, help="split seed (default: the checkpoint's)")
    e.add_argument("--device", choices=["llvm", "cuda"], default=None, help="default: the library's target")
    return p


def cmd_build(args) -> int:
    check_library_output(args.output, args)
    target_db, mixed = accuracy_target(args)
    if args.no_verify and args.verify_floor_db is not None:
        raise InputError("--verify-floor-db sets the floor of the verification that --no-verify turns off; "
                         "drop one of them")
    check_build_flags(args)     # (before the scheme: its flags' own words, not QuantConfig's)
    cfg = quant_config(args)
    if args.checkpoint:
        refuse_model_only_flags(args)
    return _work().build(args, cfg, target_db, mixed)


def cmd_accept(args) -> int:
    if args.output is not None:
        check_library_output(args.output, args)
    path = accept_unverified(args.lib, args.output)
    print(f"{args.lib} is now {path} (+ .params.npz, .json); it stays marked as failed: every load warns")
    return 0


def cmd_export_onnx(args) -> int:
    return _work().export(args)     # its first check (the file at -o is ours to replace) reads ONNX


def cmd_compare(args) -> int:
    return _work().compare_baselines(args)


def cmd_eval(args) -> int:
    if args.data is None:
        given = [flag for flag, v in (("--labels", args.labels), ("--classes", args.classes), ("--model", args.model),
                                      ("--limit", args.limit), ("--json", args.json)) if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} go with --data DIR (a labelled image folder); the digits split takes "
                             "none")
        return _work().eval_split(args)
    if args.json is not None:
        check_output_file(args.json, "JSON result", inputs=command_inputs(args), ours=_not_an_eval_result,
                          force=args.force)
    return _work().eval_folder(args)


def _not_an_eval_result(path: str) -> str | None:
    """Why the file at ``path`` is not a result ``eval --json`` wrote (None: it is one)."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "not a JSON file"
    return None if isinstance(res, dict) and {"int8", "images", "layout"} <= set(res) else "not an `eval` result"


def cmd_run(args) -> int:
    return _work().run(args)


def cmd_rpc(args) -> int:
    return _work().rpc(args)


def _kept_output(output: str, what: str):
    """The Ctrl-C line of a command that writes ``output``: unchanged, or (the signal came after
    the save) written whole."""
    def kept(written: list[str]) -> str:
        made = [w for w in written if w.endswith((".so", ".onnx"))]
        if made:
            return f"{made[-1]} had been written whole (the new {what}) before it stopped"
        return f"{output} was not written; the {what} there before, if any, is whole and unchanged"
    return kept


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    kept = (_kept_output(args.output, "library") if args.cmd == "build" else
            f"{args.lib} was not moved; nothing changed" if args.cmd == "accept" else
            _kept_output(args.output, "file") if args.cmd == "export-onnx" else
            f"the rows measured so far are in {args.out}/compare_*.partial.json; the results of an earlier "
            f"comparison there are unchanged" if args.cmd == "compare" else
            f"nothing was written; {args.json}, if it was there, is unchanged" if getattr(args, "json", None) else
            "nothing was written")
    commands = {"build": cmd_build, "run": cmd_run, "eval": cmd_eval, "rpc": cmd_rpc, "export-onnx": cmd_export_onnx,
                "compare": cmd_compare, "accept": cmd_accept}
    return cli.run(lambda: commands[args.cmd](args), kept)


if __name__ == "__main__":
    sys.exit(main())
