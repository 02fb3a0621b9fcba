"""What `deploy.py build` / `export-onnx` flags mean and the checks made of them before any work,
with neither torch nor TVM: the scheme as a :class:`~tvm_qconv.config.QuantConfig`, the flags that
contradict each other or the command, and the outputs that may not be written.  Used by
:mod:`tvm_qconv.cli.deploy` before it loads the commands' work and by that work
(:mod:`tvm_qconv.cli.deploy_commands`) itself."""
from __future__ import annotations

import argparse
import dataclasses
import os

from tvm_qconv.runtime.artifact import artifact_paths, not_a_library
from tvm_qconv.config import ACCURACY_TARGET_DB, PRESETS, AccuracyTarget
from tvm_qconv.errors import InputError
from tvm_qconv.fileio import check_output_file, check_output_folder

# Flags that only steer calibration or --model: with --checkpoint nothing is calibrated and the
# checkpoint holds the weights, so they are refused rather than silently ignored.
_MODEL_ONLY_FLAGS = {"calibration": "--calibration", "percentile": "--percentile", "calib_dir": "--calib-dir",
                      "num_calib": "--num-calib", "weights": "--weights", "num_classes": "--num-classes",
                      "bias_correction": "--bias-correction", "unsigned_activations": "--unsigned-activations",
                      "weight_rounding": "--weight-rounding", "equalization": "--equalization"}
# Flags that only steer calibration: a Q/DQ file carries its scales (deploy_commands.cli_ranges).
CALIBRATION_FLAGS = {key: flag for key, flag in _MODEL_ONLY_FLAGS.items()
                     if key in ("calibration", "percentile", "calib_dir", "num_calib", "bias_correction",
                                "equalization")}


def quant_config(args):
    """The scheme of `build` / `export-onnx`: the --scheme preset with --calibration, --percentile,
    --num-calib, --bias-correction, --unsigned-activations, --weight-rounding, --equalization and --skip
    applied."""
    cfg = PRESETS[args.scheme]
    over = {k: v for k, v in dict(calibration=args.calibration, percentile=args.percentile,
                                   num_calib_images=args.num_calib,
                                   bias_correction=getattr(args, "bias_correction", None),
                                   unsigned_activations=getattr(args, "unsigned_activations", None),
                                   weight_rounding=getattr(args, "weight_rounding", None),
                                   equalization=getattr(args, "equalization", None)).items()
            if v is not None}
    if args.skip:
        over["skip"] = tuple(cfg.skip) + tuple(args.skip)
    try:
        return dataclasses.replace(cfg, **over)
    except ValueError as err:   # flags that contradict each other (--bias-correction with --weight-rounding gptq)
        raise InputError(str(err)) from None


def accuracy_target(args: argparse.Namespace) -> tuple[float | None, str | None]:
    """`build`'s --accuracy-target as ``(BuildOptions.accuracy_target_db, BuildOptions.mixed_precision)``.

    Given (``30``, ``top1:99``): the build keeps the fewest layers in float that reach it, and a
    dB target is also where the report names the layers that lose most.  Not given: no layer is
    kept, and the report names them under 30 dB for trained weights (--weights, --checkpoint, a
    model file; off for a random init).  ``0``: both off."""
    text = args.accuracy_target
    if text is not None and text.strip() in ("0", "0.0"):
        if args.data is not None:
            raise InputError("--data is where --accuracy-target is measured; --accuracy-target 0 turns it off")
        return None, None
    if text is not None:
        goal = AccuracyTarget.parse(text)
        if args.no_verify:
            raise InputError("--accuracy-target measures the verification that --no-verify turns off; drop one of them")
        if args.checkpoint:
            raise InputError("--accuracy-target keeps layers of a calibrated build in float; a QAT checkpoint's "
                             "layers were trained for int8: build it without the target")
        if goal.metric == "sqnr_db":
            return goal.value, text.strip()
    if args.data is not None and text is None:
        raise InputError("--data DIR is the folder --accuracy-target is measured on: give the target too "
                         "(e.g. --accuracy-target top1:99)")
    trained = bool(args.weights or args.checkpoint or ":" in (args.model or ""))
    report_db = ACCURACY_TARGET_DB if trained and not args.no_verify else None
    return report_db, None if text is None else text.strip()


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
    calibration = args.calibration or PRESETS[args.scheme].calibration   # (QuantConfig says it in its own words)
    if args.percentile is not None and calibration != "percentile":
        raise InputError(f"--percentile sets the percentile observer's cut; this build calibrates with "
                         f"{calibration}: drop --percentile, or add --calibration percentile")
    named = args.weights is not None and not (os.path.exists(args.weights) or os.sep in args.weights
                                              or args.weights.endswith((".pt", ".pth")))
    if args.num_classes is not None and named:
        raise InputError(f"--num-classes sets the classifier's width; torchvision's --weights {args.weights} come with "
                         "their own (1000 ImageNet classes): drop --num-classes")
    if args.debug_dump is not None:
        check_output_folder(args.debug_dump, "--debug-dump folder")


def check_library_output(path: str, args) -> None:
    """Refuse, before any work, a library path (``build -o``, ``accept -o``) that cannot take the
    library: the checks of ``check_output_file``, for the ``.so`` and the two files beside it."""
    inputs = command_inputs(args)
    check_output_file(path, "library", inputs=inputs, ours=not_a_library, force=args.force)
    params, meta = artifact_paths(path)
    check_output_file(params, "the library's params", inputs=inputs)
    check_output_file(meta, "the library's record", inputs=inputs)


def refuse_model_only_flags(args) -> None:
    """With --checkpoint, refuse the flags that only steer --model or calibration."""
    given = [flag for key, flag in _MODEL_ONLY_FLAGS.items() if getattr(args, key) is not None]
    if given:
        raise InputError(f"{', '.join(given)} cannot be used with --checkpoint: the checkpoint holds the weights "
                         "and the activation ranges (learned in QAT), nothing is calibrated; drop them")
