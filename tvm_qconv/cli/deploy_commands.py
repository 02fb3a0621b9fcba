"""The work of `deploy.py`'s commands once their flags are valid: building, exporting, running,
evaluating and comparing libraries.  Torch, TVM and the compiler are imported at the top (~5 s
here); :mod:`tvm_qconv.cli.deploy` loads this module only after parsing the arguments and the
checks that need neither (``deploy._work``), so that --help, a bad flag or `accept` answer at
once."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from tvm_qconv import cli, registry
from tvm_qconv.runtime.artifact import read_meta, remove_unverified
from tvm_qconv.build import BuildOptions, compile_checkpoint, compile_model
from tvm_qconv.cli.deploy_flags import CALIBRATION_FLAGS, command_inputs, quant_config, refuse_model_only_flags
from tvm_qconv.compare import CompareOptions, compare, report as compare_report
from tvm_qconv.config import PRESETS
from tvm_qconv.data import load_image
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import evaluate_folder, evaluate_library
from tvm_qconv.fileio import check_output_file, write_json
from tvm_qconv.frontend import as_frontend, list_models, load_model
from tvm_qconv.onnx_export import export_checkpoint, export_onnx, not_our_onnx
from tvm_qconv.ranges.sources import Calibrate
from tvm_qconv.runtime.remote import Remote
from tvm_qconv.runtime.remote_model import RemoteModel
from tvm_qconv.report import format_report
from tvm_qconv.runtime.compiled_model import CompiledModel, class_scores, summarize

RANDOM_NOTE = ("the classes it predicts are meaningless; pass --weights FILE (a state dict) or --weights DEFAULT "
               "(torchvision's trained weights) for a real classifier")


def load_cli_model(args, num_classes: int | None, seed: int):
    """The --model of `build` / `export-onnx` / `eval` (a ``frontend.Frontend``), its random init
    seeded by ``seed``; and how its weights read in the output."""
    torch.manual_seed(seed)
    model = as_frontend(load_model(args.model, args.weights, num_classes), args.model)
    from_file = ".py:" in args.model or os.path.isfile(args.model)   # a model file holds its own weights
    return model, args.weights or ("the model file's" if from_file else f"random init (seed {seed})")


def cli_ranges(args, model):
    """Where `build` / `export-onnx` take the activation ranges from: a Q/DQ ONNX file's own
    scales (None: ``quantize_module`` reads them from the file), else calibration on --calib-dir.
    A Q/DQ file is calibrated by nobody, so the calibration flags are refused rather than ignored."""
    if not model.has_own_ranges:
        return Calibrate(calib_dir=args.calib_dir)
    given = [flag for key, flag in CALIBRATION_FLAGS.items() if getattr(args, key, None) is not None]
    if given:
        raise InputError(f"{', '.join(given)} cannot be used with {args.model}: it is a quantized (Q/DQ) file, whose "
                         "scales the library keeps (nothing is calibrated); drop them, or give the float model to "
                         "calibrate it here")
    return None


def unused_families(args, report: dict) -> list[str]:
    """The --family names no layer of the build runs (on this target none of them can, or a
    layer prefers another), for one warning line."""
    ran = {registry.get(row["kernel"]).family for row in report.get("layers", [])
           if row.get("kernel") in {impl.name for impl in registry.IMPLEMENTATIONS}}
    return [f for f in args.family or () if f not in ran]


def describe_scheme(config: dict, report: dict | None = None) -> str:
    """One line saying the scheme a build ran, its defaults decided (``QuantConfig.resolved``)."""
    unsigned = "unsigned activations" if config.get("unsigned_activations") else "symmetric activations"
    corrected = "bias correction" if config.get("bias_correction") else "no bias correction"
    if report is not None:
        unsigned += f" ({len(report.get('unsigned', []))} tensors at zero point -128)" \
            if config.get("unsigned_activations") else ""
        n = sum(1 for row in report.get("layers", []) if row.get("bias_corrected"))
        corrected += f" ({n} layers)" if config.get("bias_correction") else ""
    pairs = (report or {}).get("ranges", {}).get("equalization", {}).get("pairs")
    equalized = "" if not config.get("equalization") else "; equalized channels" + \
        (f" ({len(pairs)} conv pairs)" if pairs is not None else "")
    rounded = "by GPTQ" if config.get("weight_rounding") == "gptq" else "to nearest"
    return f"{unsigned}; {corrected}{equalized}; weights rounded {rounded}"


def describe_mixed_precision(entry: dict) -> str:
    """The lines saying what the accuracy target kept in float and what it reached."""
    unit = " dB" if entry["metric"] == "sqnr_db" else " %"

    def figure(score: dict) -> str:
        return f"{score[entry['metric']]:g}{unit}"
    head = (f"accuracy target: {entry['target']} on {entry['images']} images of {entry['images_from']}: "
            f"{'reached' if entry['reached'] else 'NOT reached'}, {figure(entry['final'])} "
            f"(all int8: {figure(entry['all_int8'])})")
    kept = entry.get("kept", [])
    if not kept:
        return head + ("; every layer int8" if entry["reached"] else "; nothing kept in float helped")
    count = sum(len(k["layers"]) for k in kept)
    lines = [head + f"; {count} of {entry.get('candidates', '?')} conv / linear layers kept in float, in "
             "steps (the simulated gain each step bought, on the calibration images):"]
    lines += [f"  {', '.join(k['layers'])}: {k['simulated_gain_db']:+.1f} dB" for k in kept]
    return "\n".join(lines)


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


def build(args, cfg, target_db: float | None, mixed: str | None = None) -> int:
    """`build` once its flags passed ``deploy.cmd_build``'s checks: ``cfg`` is their scheme,
    ``target_db`` and ``mixed`` the accuracy target (``deploy_flags.accuracy_target``)."""
    def build_options(image_size: int | None) -> BuildOptions:
        return BuildOptions(target=args.target, arch=args.arch, batch=args.batch,
                            image_size=image_size, tuning_log=args.tuning_log, ignore_stale=args.ignore_stale,
                            cuda_graph=args.cuda_graph,
                            debug_dump=args.debug_dump, verify=not args.no_verify,
                            families=tuple(args.family) if args.family else None,
                            accuracy_target_db=target_db, mixed_precision=mixed, accuracy_data=args.data,
                            accuracy_labels=args.labels, require_int8=True, **floor)

    floor = {} if args.verify_floor_db is None else dict(verify_floor_db=args.verify_floor_db)
    target = f"target={args.target}{' ' + args.arch if args.target == 'cuda' else ''} batch={args.batch}"
    if args.checkpoint:
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
    print("scheme: " + describe_scheme(res.meta["config"], res.meta["report"]))
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
        return cli.EXIT_UNVERIFIED
    mixed_entry = res.meta["report"].get("mixed_precision")
    if mixed_entry is not None:
        print(describe_mixed_precision(mixed_entry))
    print(f"wrote {res.lib_path} (+ .params.npz, .json)")
    if mixed_entry is not None and not mixed_entry["reached"]:
        print(f"error: --accuracy-target {mixed}: not reached; {res.lib_path} is the closest library built "
              f"(see above)", file=sys.stderr)
        return cli.EXIT_TARGET_MISSED
    stale = remove_unverified(args.output)
    if stale:
        print(f"removed {stale} (+ .params.npz, .json): an earlier build of {args.output} that failed its "
              "verification, superseded by this one")
    return 0


def export(args) -> int:
    """`export-onnx`: the model, calibrated as `build` does, as a Q/DQ ONNX file."""
    check_output_file(args.output, "ONNX file", inputs=command_inputs(args), ours=not_our_onnx, force=args.force)
    cfg = quant_config(args)
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
    zero = "zero point -128 where unsigned, else 0" if res.config.unsigned_activations else "zero point 0"
    print(f"activation QuantizeLinear/DequantizeLinear: {s['qdq_activations']} int8 tensors (per tensor, {zero})")
    print(f"int8 weights: {s['int8_weights']} (per output channel); int8 layers: {s['int8_layers']}/{s['layers']}")
    print("float layers: " + (", ".join(s["float_layers"]) or "none"))
    ops = ", ".join(f"{op.removeprefix('relax.')} x{n}" for op, n in s["float_ops"].items())
    print("float ops: " + (ops or "none"))
    print("activation ranges: " + describe_ranges(s.get("ranges", {})))
    print("scheme: " + describe_scheme(res.config.to_dict()))
    return 0


def compare_baselines(args) -> int:
    """`compare`: the int8 library against every baseline (:func:`tvm_qconv.compare.compare`)."""
    options = CompareOptions(model=args.model, weights=args.weights, num_classes=args.num_classes,
                             batches=args.batch, image_size=args.image_size, device=args.device, arch=args.arch,
                             libs=tuple(args.lib), tuning_log=args.tuning_log, baselines=args.baselines,
                             config=PRESETS[args.scheme], calib_dir=args.calib_dir, input_sets=args.input_sets,
                             budget_s=args.budget, jobs=args.jobs, agreement_floor_db=args.agreement_floor,
                             seed=args.seed, out_dir=args.out, data=args.data, labels=args.labels,
                             classes=args.classes, work_dir=args.work_dir)
    results = compare(options, progress=(lambda line: None) if args.quiet else (lambda line: print(line, flush=True)))
    if args.quiet:
        print("\n".join(compare_report.summary_lines(results["summary"])))
    return 0


def eval_split(args) -> int:
    """`eval` without --data: top-1 on the digits test split."""
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


def eval_folder(args) -> int:
    """`eval --data`: top-1 / top-5 on a labelled image folder, beside the float model's with --model
    (its --json output checked by ``deploy.cmd_eval``)."""
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
    if class_scores(out.shape, batch):
        _print_top5(paths, out, labels)
        return
    print(f"output: {tuple(out.shape)} {out.dtype}, not class scores [batch, classes]: no top-5; a summary instead")
    per_image = out.ndim >= 2 and out.shape[0] == batch
    for i, path in enumerate(paths if per_image else ["the whole batch"]):
        print(f"{path}:")
        for line in summarize(out[i] if per_image else out):
            print("  " + line)


def run(args) -> int:
    """`run`: a built library on images, its top-5 and its latency."""
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


def rpc(args) -> int:
    """`rpc`: a built library on a remote device through TVM RPC."""
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
