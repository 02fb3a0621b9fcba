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
import dataclasses
import os
import sys
import time

import numpy as np

from tvm_qconv import cli
from tvm_qconv.artifact import accept_unverified, remove_unverified
from tvm_qconv.cli_args import Parser, positive_float, positive_int as _positive
from tvm_qconv.compare.baselines import BASELINE_KEYS
from tvm_qconv.config import ACCURACY_TARGET_DB, CALIBRATIONS, PRESETS, WEIGHT_ROUNDINGS
from tvm_qconv.errors import InputError
from tvm_qconv.fileio import check_output_file, check_output_folder
from tvm_qconv.report import format_report

EXIT_UNVERIFIED = 3  # built, but its outputs disagree with the float model's (2: bad input)

# A subcommand imports what it runs when it runs (the imports marked "per command"): tvm (~2 s
# here, torch with it), the compiler on top (`build`, `export-onnx`: ~9 s in all) and
# scikit-image's resize (~0.8 s) are not paid by --help, a bad flag or `accept` (~0.1 s).


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
    b.add_argument("--bias-correction", action="store_const", const=True, default=None,
                   help="correct each conv / linear bias for its int8 weights' mean error on the calibration images")
    b.add_argument("--weight-rounding", choices=WEIGHT_ROUNDINGS, default=None,
                   help="round int8 weights to nearest (default), or by GPTQ: column by column so that each layer's "
                        "output on the calibration images moves least")
    b.add_argument("--unsigned-activations", action="store_const", const=True, default=None,
                   help="store never-negative activations (after ReLU / ReLU6) as 0..255 at zero point -128 where "
                        "every reader can take it: half the rounding step there")


def accuracy_target(args: argparse.Namespace) -> float | None:
    """`build`'s --accuracy-target as BuildOptions.accuracy_target_db: the flag, else 30 dB for
    trained weights (--weights, --checkpoint, a model file) and None (off) for a random init."""
    if args.accuracy_target is not None and not args.accuracy_target >= 0:
        raise InputError(f"--accuracy-target is a logits SQNR in dB (>= 0, 0 = off), got {args.accuracy_target:g}")
    if args.no_verify and args.accuracy_target:
        raise InputError("--accuracy-target measures the verification that --no-verify turns off; drop one of them")
    if args.accuracy_target is not None:
        return args.accuracy_target or None
    trained = bool(args.weights or args.checkpoint or ":" in (args.model or ""))
    return ACCURACY_TARGET_DB if trained and not args.no_verify else None


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print no progress (phases, bars), only the results and errors: for scripts")


def _add_force(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--force", action="store_true",
                   help=f"replace {what} (refused without it; the command's own inputs are never replaced)")


def command_inputs(args) -> dict:
    """``{flag: path}`` of the files and folders a command reads: its output may name none of them."""
    inputs = {}
    model = getattr(args, "model", None)
    if model:   # a model file (m.onnx, m.py:factory); a torchvision name is none
        path = model.rsplit(":", 1)[0] if ".py:" in model else model
        if os.path.exists(path):
            inputs["--model"] = path
    for key in ("weights", "checkpoint", "lib", "labels", "classes", "tuning_log", "calib_dir", "data"):
        value = getattr(args, key, None)
        if isinstance(value, str) and os.path.exists(value):
            inputs["--" + key.replace("_", "-")] = value
    if "--lib" in inputs:
        from tvm_qconv.artifact import artifact_paths
        params, meta = artifact_paths(inputs["--lib"])
        inputs.update({"--lib's params": params, "--lib's record": meta})
    return inputs


def check_build_flags(args) -> None:
    """Refuse flags `build` would otherwise ignore in silence: CUDA-only flags on a CPU build, a
    percentile without the percentile observer, a class count beside named weights, a debug
    folder that cannot be written.  (Sets --arch's default for CUDA.)"""
    if args.target != "cuda":
        given = [flag for flag, v in (("--arch", args.arch), ("--cuda-graph", args.cuda_graph)) if v]
        if given:
            raise InputError(f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} for --target cuda; this "
                             f"build is for {args.target}: drop {'them' if len(given) > 1 else 'it'}, or build with "
                             "--target cuda")
    elif args.arch is None:
        args.arch = "sm_90"
    if args.percentile is not None and quant_config(args).calibration != "percentile":
        raise InputError(f"--percentile sets the percentile observer's cut; this build calibrates with "
                         f"{quant_config(args).calibration}: drop --percentile, or add --calibration percentile")
    named = args.weights is not None and not (os.path.exists(args.weights) or os.sep in args.weights
                                              or args.weights.endswith((".pt", ".pth")))
    if args.num_classes is not None and named:
        raise InputError(f"--num-classes sets the classifier's width; torchvision's --weights {args.weights} come with "
                         "their own (1000 ImageNet classes): drop --num-classes")
    if args.debug_dump is not None:
        check_output_folder(args.debug_dump, "--debug-dump folder")


def unused_families(args, report: dict) -> list[str]:
    """The --family names no layer of the build runs (on this target none of them can, or a
    layer prefers another), for one warning line."""
    from tvm_qconv import registry
    ran = {registry.get(row["kernel"]).family for row in report.get("layers", [])
           if row.get("kernel") in {impl.name for impl in registry.IMPLEMENTATIONS}}
    return [f for f in args.family or () if f not in ran]


def check_library_output(path: str, args) -> None:
    """Refuse, before any work, a library path (``build -o``, ``accept -o``) that cannot take the
    library: the checks of ``check_output_file``, for the ``.so`` and the two files beside it."""
    from tvm_qconv.artifact import artifact_paths, not_a_library
    inputs = command_inputs(args)
    check_output_file(path, "library", inputs=inputs, ours=not_a_library, force=args.force)
    params, meta = artifact_paths(path)
    check_output_file(params, "the library's params", inputs=inputs)
    check_output_file(meta, "the library's record", inputs=inputs)


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
    b.add_argument("--accuracy-target", type=float, default=None, metavar="DB",
                   help="where the verified logits SQNR is under DB, also name the layers that lose the most "
                        f"(a second build at batch 1 that returns every int8 activation; default {ACCURACY_TARGET_DB:g} "
                        "for trained weights (--weights, --checkpoint, a model file), off for a random init, whose "
                        "float outputs are noise a per-layer hunt cannot improve; 0 turns it off)")
    b.add_argument("--debug-dump", default=None, metavar="DIR",
                   help="write the IR after each phase into DIR (01_imported.py ... 05_scheduled.py)")
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
                                    "tvm_qconv.rpc_server on the GPU machine), classify images there, print the "
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


# Flags that only steer calibration or --model: with --checkpoint nothing is calibrated and the
# checkpoint holds the weights, so they are refused rather than silently ignored.
_MODEL_ONLY_FLAGS = {"calibration": "--calibration", "percentile": "--percentile", "calib_dir": "--calib-dir",
                      "num_calib": "--num-calib", "weights": "--weights", "num_classes": "--num-classes",
                      "bias_correction": "--bias-correction", "unsigned_activations": "--unsigned-activations",
                      "weight_rounding": "--weight-rounding"}
# Flags that only steer calibration: a Q/DQ file carries its scales (cli_ranges).
_CALIBRATION_FLAGS = {key: flag for key, flag in _MODEL_ONLY_FLAGS.items()
                      if key in ("calibration", "percentile", "calib_dir", "num_calib", "bias_correction")}


def quant_config(args):
    """The scheme of `build` / `export-onnx`: the --scheme preset with --calibration, --percentile,
    --num-calib, --bias-correction, --unsigned-activations, --weight-rounding and --skip applied."""
    cfg = PRESETS[args.scheme]
    over = {k: v for k, v in dict(calibration=args.calibration, percentile=args.percentile,
                                   num_calib_images=args.num_calib,
                                   bias_correction=getattr(args, "bias_correction", None),
                                   unsigned_activations=getattr(args, "unsigned_activations", None),
                                   weight_rounding=getattr(args, "weight_rounding", None)).items()
            if v is not None}
    if args.skip:
        over["skip"] = tuple(cfg.skip) + tuple(args.skip)
    try:
        return dataclasses.replace(cfg, **over)
    except ValueError as err:   # flags that contradict each other (--bias-correction with --weight-rounding gptq)
        raise InputError(str(err)) from None


def cli_ranges(args, model):
    """Where `build` / `export-onnx` take the activation ranges from: a Q/DQ ONNX file's own
    scales (None: ``quantize_module`` reads them from the file), else calibration on --calib-dir.
    A Q/DQ file is calibrated by nobody, so the calibration flags are refused rather than ignored."""
    from tvm_qconv.ranges import Calibrate  # per command
    if not model.has_own_ranges:
        return Calibrate(calib_dir=args.calib_dir)
    given = [flag for key, flag in _CALIBRATION_FLAGS.items() if getattr(args, key, None) is not None]
    if given:
        raise InputError(f"{', '.join(given)} cannot be used with {args.model}: it is a quantized (Q/DQ) file, whose "
                         "scales the library keeps (nothing is calibrated); drop them, or give the float model to "
                         "calibrate it here")
    return None


def refuse_model_only_flags(args) -> None:
    """With --checkpoint, refuse the flags that only steer --model or calibration."""
    given = [flag for key, flag in _MODEL_ONLY_FLAGS.items() if getattr(args, key) is not None]
    if given:
        raise InputError(f"{', '.join(given)} cannot be used with --checkpoint: the checkpoint holds the weights "
                         "and the activation ranges (learned in QAT), nothing is calibrated; drop them")


RANDOM_NOTE = ("the classes it predicts are meaningless; pass --weights FILE (a state dict) or --weights DEFAULT "
               "(torchvision's trained weights) for a real classifier")


def load_cli_model(args, num_classes: int | None, seed: int):
    """The --model of `build` / `export-onnx` / `eval` (a ``frontend.Frontend``), its random init
    seeded by ``seed``; and how its weights read in the output."""
    import torch  # per command

    from tvm_qconv.frontend import as_frontend, load_model
    torch.manual_seed(seed)
    model = as_frontend(load_model(args.model, args.weights, num_classes), args.model)
    from_file = ".py:" in args.model or os.path.isfile(args.model)   # a model file holds its own weights
    return model, args.weights or ("the model file's" if from_file else f"random init (seed {seed})")


def cmd_build(args) -> int:
    from tvm_qconv.build import BuildOptions, compile_checkpoint, compile_model  # per command
    cfg = quant_config(args)
    check_library_output(args.output, args)

    def build_options(image_size: int | None) -> BuildOptions:
        return BuildOptions(target=args.target, arch=args.arch, batch=args.batch,
                            image_size=image_size, tuning_log=args.tuning_log, ignore_stale=args.ignore_stale,
                            cuda_graph=args.cuda_graph,
                            debug_dump=args.debug_dump, verify=not args.no_verify,
                            families=tuple(args.family) if args.family else None,
                            accuracy_target_db=target_db, require_int8=True, **floor)

    floor = {} if args.verify_floor_db is None else dict(verify_floor_db=args.verify_floor_db)

    target_db = accuracy_target(args)
    if args.no_verify and args.verify_floor_db is not None:
        raise InputError("--verify-floor-db sets the floor of the verification that --no-verify turns off; "
                         "drop one of them")
    check_build_flags(args)
    target = f"target={args.target}{' ' + args.arch if args.target == 'cuda' else ''} batch={args.batch}"
    if args.checkpoint:
        refuse_model_only_flags(args)
        print(f"[build] {args.checkpoint} -> {args.output}: {target} size={args.image_size or 'as trained'} "
              f"ranges=learned in QAT (no calibration) config={cfg.to_dict()}", flush=True)
        res = compile_checkpoint(args.checkpoint, args.output, options=build_options(args.image_size), config=cfg,
                                 progress=not args.quiet)
    else:
        model, weights = load_cli_model(args, args.num_classes, args.seed)   # a file may fix the image size
        size = model.image_size(args.image_size)
        options = build_options(size)
        for note in model.input_notes(options.input_shape):
            print(f"[build] {note}", flush=True)
        print(f"[build] {args.model} -> {args.output}: {target} size={size} weights={weights} "
              f"config={cfg.to_dict()}", flush=True)
        res = compile_model(model, args.output, options=options, config=cfg, name=args.model,
                            ranges=cli_ranges(args, model), progress=not args.quiet,
                            extra_meta=dict(weights=weights, seed=args.seed))
    print(format_report(res.meta))
    print("activation ranges: " + describe_ranges(res.meta["report"].get("ranges", {})))
    unused = unused_families(args, res.meta["report"])
    if unused:
        print(f"warning: --family {', '.join(unused)}: no layer of this build runs {'them' if len(unused) > 1 else 'it'} "
              f"(none of its kernels takes these layers on {target.split(' batch')[0].removeprefix('target=')}); "
              "the layers have the registry's choice", file=sys.stderr)
    if res.meta.get("weights", "").startswith("random init"):
        print(f"weights: {res.meta['weights']}: {RANDOM_NOTE}")
    if res.meta["report"].get("verify", {}).get("status") == "failed":
        print(f"error: the built library failed its verification against the float model (see above): it was "
              f"written as {res.lib_path}, {args.output} is unchanged; to use it anyway: python deploy.py accept "
              f"{res.lib_path}", file=sys.stderr)
        return EXIT_UNVERIFIED
    print(f"wrote {res.lib_path} (+ .params.npz, .json)")
    stale = remove_unverified(args.output)
    if stale:
        print(f"removed {stale} (+ .params.npz, .json): an earlier build of {args.output} that failed its "
              "verification, superseded by this one")
    return 0


def cmd_accept(args) -> int:
    if args.output is not None:
        check_library_output(args.output, args)
    path = accept_unverified(args.lib, args.output)
    print(f"{args.lib} is now {path} (+ .params.npz, .json); it stays marked as failed: every load warns")
    return 0


def cmd_export_onnx(args) -> int:
    from tvm_qconv.onnx_export import export_checkpoint, export_onnx, not_our_onnx  # per command
    check_output_file(args.output, "ONNX file", inputs=command_inputs(args), ours=not_our_onnx, force=args.force)
    cfg = quant_config(args)
    if cfg.bias_correction:
        raise InputError("export-onnx does not write bias-corrected biases yet: the ONNX file would not be the "
                         "library `build --bias-correction` makes; export without --bias-correction")
    dynamic = not args.static_batch
    if args.checkpoint:
        refuse_model_only_flags(args)
        print(f"[export-onnx] {args.checkpoint} -> {args.output}: size={args.image_size or 'as trained'} "
              f"ranges=learned in QAT (no calibration) config={cfg.to_dict()}", flush=True)
        res = export_checkpoint(args.checkpoint, args.output, image_size=args.image_size, batch=args.batch,
                                config=cfg, dynamic_batch=dynamic, opset=args.opset, progress=not args.quiet)
    else:
        model, weights = load_cli_model(args, args.num_classes, args.seed)
        size = model.image_size(args.image_size)
        print(f"[export-onnx] {args.model} -> {args.output}: size={size} weights={weights} "
              f"config={cfg.to_dict()}", flush=True)
        res = export_onnx(model, args.output, input_shape=(args.batch, 3, size, size), config=cfg,
                          ranges=cli_ranges(args, model), name=args.model, dynamic_batch=dynamic,
                          opset=args.opset, progress=not args.quiet, require_int8=True)
    s = res.summary
    print(f"wrote {res.path} (ONNX opset {s['opset']}, {s['nodes']} nodes)")
    print("batch: " + ("dynamic (input and output dimension 0 is 'batch')" if s["dynamic_batch"] else
                       f"static {args.batch}" + (f" ({s['static_batch_reason']})" if s["static_batch_reason"] else "")))
    print(f"activation QuantizeLinear/DequantizeLinear: {s['qdq_activations']} int8 tensors (per tensor, zero point 0)")
    print(f"int8 weights: {s['int8_weights']} (per output channel); int8 layers: {s['int8_layers']}/{s['layers']}")
    print("float layers: " + (", ".join(s["float_layers"]) or "none"))
    ops = ", ".join(f"{op.removeprefix('relax.')} x{n}" for op, n in s["float_ops"].items())
    print("float ops: " + (ops or "none"))
    print("activation ranges: " + describe_ranges(s.get("ranges", {})))
    return 0


def cmd_compare(args) -> int:
    from tvm_qconv.compare import CompareOptions, compare, report  # per command
    options = CompareOptions(model=args.model, weights=args.weights, num_classes=args.num_classes,
                             batches=args.batch, image_size=args.image_size, device=args.device, arch=args.arch,
                             libs=tuple(args.lib), tuning_log=args.tuning_log, baselines=args.baselines,
                             config=PRESETS[args.scheme], calib_dir=args.calib_dir, input_sets=args.input_sets,
                             budget_s=args.budget, jobs=args.jobs, agreement_floor_db=args.agreement_floor,
                             seed=args.seed, out_dir=args.out, data=args.data, labels=args.labels,
                             classes=args.classes, work_dir=args.work_dir)
    results = compare(options, progress=(lambda line: None) if args.quiet else (lambda line: print(line, flush=True)))
    if args.quiet:
        print("\n".join(report.summary_lines(results["summary"])))
    return 0


def describe_ranges(ranges: dict) -> str:
    """One line saying where a build's activation ranges came from."""
    if ranges.get("source") == "checkpoint":
        return (f"learned in QAT, from {ranges['checkpoint']} ({len(ranges['points'])} points, no calibration; "
                "each int8 tensor takes the range of the layer input it feeds)")
    if ranges.get("source") == "calibration":
        how = ranges["calibration"] + (f" {ranges['percentile']}" if "percentile" in ranges else "")
        line = f"calibrated ({how}) on {ranges['images']} images"
        if "available" in ranges:
            line += (f" of {ranges['images_from']} (the scheme takes up to {ranges['up_to']}; "
                     + (f"{ranges['held_out']} more held out to verify on)" if ranges["held_out"] else
                        f"{ranges['available']} were there, none left to hold out for the verification)"))
        return line
    if ranges.get("source") == "file":
        notes = ranges.get("notes", [])
        return (f"the Q/DQ file's own scales, from {ranges['file']} ({ranges['points']} points, {ranges['qdq_nodes']} "
                "Q/DQ nodes, no calibration)" + (f"; {len(notes)} note(s): " + " | ".join(notes) if notes else ""))
    return "given by the caller (amax=...)"


def cmd_eval(args) -> int:
    if args.data is not None:
        return _eval_folder(args)
    given = [flag for flag, v in (("--labels", args.labels), ("--classes", args.classes), ("--model", args.model),
                                  ("--limit", args.limit), ("--json", args.json)) if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} go with --data DIR (a labelled image folder); the digits split takes none")
    from tvm_qconv.evaluate import evaluate_library  # per command
    res = evaluate_library(args.lib, seed=args.seed, device=args.device)
    print(f"{args.dataset} test split (seed {res['seed']}, {res['total']} images): compiled int8 "
          f"{res['accuracy']:.2f}% ({res['correct']}/{res['total']}) on {res['device']}")
    if res["recorded"]:
        print("recorded in its checkpoint (PyTorch): " + ", ".join(f"{k} {v:.2f}%" for k, v in res["recorded"].items()))
    return 0


def _float_model_of(args, meta: dict):
    """The float model `eval --model` compares the library with: a random init seeded and sized as
    the library's build made it (its record's seed and class count), checked against the
    library's input before any image is read.

    Raises:
        InputError: the model cannot take the library's input (another image size).
    """
    from tvm_qconv.frontend import list_models
    shape = meta.get("output_shape")
    # a torchvision name's random init at the library's class count (a model file holds its own)
    classes = shape[1] if args.model in list_models() and shape is not None and len(shape) == 2 else None
    # seeded as the build was (libraries from before the record: the build's default, 0)
    model, _ = load_cli_model(args, classes, meta.get("seed", 0))
    shape = tuple(meta["input_shape"])
    if model.fixed_size not in (None, shape[2]):
        takes = (shape[0], 3, model.fixed_size, model.fixed_size)
        raise InputError(f"--model {args.model} takes inputs {takes}, {args.lib} takes {shape}: it is not the model "
                         "the library was built from; give that model, or leave --model out")
    model.probe(shape, f"--model {args.model}")
    return model


def _not_an_eval_result(path: str) -> str | None:
    """Why the file at ``path`` is not a result ``eval --json`` wrote (None: it is one)."""
    import json
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "not a JSON file"
    return None if isinstance(res, dict) and {"int8", "images", "layout"} <= set(res) else "not an `eval` result"


def _eval_folder(args) -> int:
    from tvm_qconv.artifact import read_meta
    from tvm_qconv.evaluate import evaluate_folder
    from tvm_qconv.fileio import check_output_file, write_json
    if args.json is not None:
        check_output_file(args.json, "JSON result", inputs=command_inputs(args), ours=_not_an_eval_result,
                          force=args.force)
    model = None
    if args.model is not None:
        model = _float_model_of(args, read_meta(args.lib))
        built_from = read_meta(args.lib).get("float_weights")
        if built_from is not None and built_from != model.digest():
            print(f"warning: {args.model} does not hold the weights {args.lib} was built from (their digests differ): "
                  "its accuracy is another model's, and agreement and SQNR compare two models", file=sys.stderr)
    res = evaluate_folder(args.lib, args.data, labels=args.labels, classes=args.classes, float_model=model,
                          device=args.device, limit=args.limit)
    print(f"{args.data}: {res['images']} images ({res['layout']}) on {res['device']}")
    if res["skipped"]:
        print(f"skipped {len(res['skipped'])} unreadable: " + "; ".join(f"{p}: {why}" for p, why in res["skipped"][:5]))
    print(f"int8 library:  top-1 {res['int8']['top1']:.2f} %  top-5 {res['int8']['top5']:.2f} %")
    if res["float"] is not None:
        print(f"float model:   top-1 {res['float']['top1']:.2f} %  top-5 {res['float']['top5']:.2f} %")
        print(f"top-1 agreement {res['top1_agreement']:.2f} %, logits SQNR {res['logits_sqnr_db']:.2f} dB")
    if res["images"] < 1000:
        print(f"({res['images']} images: a smoke test, not an accuracy figure)")
    if args.json is not None:
        write_json(args.json, res, indent=1)
        print(f"wrote {args.json}")
    return 0


def _load_batch(paths: list[str], input_shape) -> np.ndarray:
    """The images as one float32 batch of the library's size (fewer are repeated to fill it)."""
    from tvm_qconv.data import load_image  # per command
    n, _, h, _ = input_shape
    x = np.stack([load_image(p, h) for p in paths])
    if len(x) < n:  # a batch-N library takes N images: repeat the given ones to fill it
        x = np.concatenate([x] * (-(-n // len(x))))[:n]
    elif len(x) > n:
        raise InputError(f"{len(x)} images given, the library takes a batch of {n}: rebuild with --batch {len(x)}")
    return x


def _print_top5(paths: list[str], logits, labels) -> None:
    for i, path in enumerate(paths):
        z = logits[i] - logits[i].max()
        prob = np.exp(z) / np.exp(z).sum()
        print(f"{path}:")
        for k in np.argsort(-prob)[:5]:
            name = labels[k] if labels and k < len(labels) else f"class {k}"
            print(f"  {prob[k]:6.3f}  {k:4d}  {name}")


def _print_output(paths: list[str], out: np.ndarray, batch: int, labels) -> None:
    """The top-5 of class scores; for any other output (a feature map, a segmentation map), its
    shape and a summary per image."""
    from tvm_qconv.runtime import class_scores, summarize
    if class_scores(out.shape, batch):
        _print_top5(paths, out, labels)
        return
    print(f"output: {tuple(out.shape)} {out.dtype}, not class scores [batch, classes]: no top-5; a summary instead")
    per_image = out.ndim >= 2 and out.shape[0] == batch
    for i, path in enumerate(paths if per_image else ["the whole batch"]):
        print(f"{path}:")
        for line in summarize(out[i] if per_image else out):
            print("  " + line)


def cmd_run(args) -> int:
    from tvm_qconv.runtime import CompiledModel  # per command
    model = CompiledModel(args.lib, args.device)
    n = model.input_shape[0]
    x = _load_batch(args.image, model.input_shape)
    t = time.time()
    logits = model(x)
    first_ms = (time.time() - t) * 1e3
    _print_output(args.image, logits, n, model.meta.get("categories"))
    if model.meta.get("weights", "").startswith("random init"):
        print(f"(built from a {model.meta['weights']}: {RANDOM_NOTE})")
    # calls per timed repeat: ~0.2 s of them (10 at most), so a slow CPU library times in seconds
    number = max(1, min(10, int(200 / max(first_ms, 1e-3))))
    if not args.quiet:
        print(f"timing: {args.repeat} repeats of {number} call{'s' if number > 1 else ''} on {model.dev} ...", flush=True)
    lat = model.benchmark(x, number=number, repeat=args.repeat, progress=not args.quiet)
    print(f"latency: {lat['median_ms']:.3f} ms median (min {lat['min_ms']:.3f}) for batch {n} on "
          f"{model.dev}; first call {first_ms:.1f} ms")
    return 0


def cmd_rpc(args) -> int:
    from tvm_qconv.remote import Remote  # per command
    from tvm_qconv.remote_model import RemoteModel
    remote = Remote.parse(args.host, args.port, args.tracker, args.key, timeout_s=args.timeout)
    print(f"[rpc] {args.lib} -> {remote.describe()}", flush=True)
    t = time.time()
    with RemoteModel(args.lib, remote) as model:
        print(f"[rpc] uploaded and loaded on {model.device_name} in {time.time() - t:.1f} s", flush=True)
        x = _load_batch(args.image, model.input_shape)
        _print_output(args.image, model(x), model.input_shape[0], model.meta.get("categories"))
        lat = model.latency(x, repeat=args.repeat)
    print(f"latency on {model.device_name} (remote, {lat['runs']} runs): {lat['median_ms']:.3f} ms median, "
          f"p90 {lat['p90_ms']:.3f}, p99 {lat['p99_ms']:.3f}, min {lat['min_ms']:.3f} for batch "
          f"{model.input_shape[0]}")
    return 0


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
