"""The build report: each layer, its kernel implementation, how it was scheduled, what stayed
float, and every conversion kernel (quantize / dequantize at float boundaries, relayout where
two kernel families' layouts meet)."""
from __future__ import annotations


def format_report(meta: dict) -> str:
    rep = meta["report"]
    rows = rep["layers"]
    w = max([len(r["layer"]) for r in rows] + [5])
    wk = max([len(r["kernel"]) for r in rows if r["dtype"] == "int8"] + [6])
    lines = [f"{'layer':<{w}}  {'op':<22} {'kernel':<{wk}} {'dtype':<7} {'schedule':<9} shape"]
    kinds: dict = {}
    for impl, how in rep.get("schedules", {}).values():
        kinds.setdefault(impl, set()).add(how)
    # tuned kernels' shapes, less what the record decided beside the loops (" (wgmma 128x64, 6 stages)")
    decisions = {shape.split(" (")[0]: shape[len(shape.split(" (")[0]):].strip()
                 for shape in rep.get("tuned", {}).values()}
    tuned_shapes = set(decisions)
    tuned_layers = []
    for r in rows:
        how = "/".join(sorted(kinds.get(r["kernel"], {"-"}))) if r["dtype"] == "int8" else "-"
        if "tuned" in how:  # a kernel of this implementation was tuned: was this layer's (its shape)?
            tuned = r.get("shape") in tuned_shapes
            how = "tuned" if tuned else ("default" if "default" in how else "-")
            if tuned:
                tuned_layers.append(r["layer"])
        decided = f" {decisions[r['shape']]}" if how == "tuned" and decisions.get(r.get("shape")) else ""
        lines.append(f"{r['layer']:<{w}}  {r['kind']:<22} {r['kernel']:<{wk}} {r['dtype']:<7} {how:<9} "
                     f"{r.get('shape', '')}{decided}")
    n8 = sum(r["dtype"] == "int8" for r in rows)
    lines.append(f"{n8}/{len(rows)} layers in int8")
    fl = rep.get("float_ops") or {}
    lines.append("stayed float: " + (", ".join(f"{k.removeprefix('relax.')} x{v}" for k, v in sorted(fl.items()))
                                     or "nothing"))
    lines += format_float_ops(rep.get("float_op_details") or [])
    conversions = rep.get("conversions", [])
    lines.append(f"conversions: {len(conversions)} ({rep.get('relayouts', 0)} relayouts): "
                 + (", ".join(conversions) or "none"))
    if rep.get("tuned"):
        lines.append(f"tuned layers ({len(tuned_layers)}, from {len(rep['tuned'])} tuned kernels): "
                     f"{', '.join(tuned_layers)}; the others use their kernel's default schedule")
    search = (rep.get("ranges") or {}).get("search")
    if search:
        lines.append("ranges searched per tensor: " + ", ".join(f"{m} x{n}" for m, n in search["counts"].items())
                     + f"; simulated logits SQNR {search['sqnr_start_db']} dB (all mse) -> {search['sqnr_db']} dB "
                       f"({search['forwards']} forwards)")
    cuda = rep.get("cuda_source")
    if cuda and cuda["status"] == "compiled by nvcc":
        lines.append(f"cuda source: compiled by nvcc for {cuda['arch']} in {cuda['seconds']} s (this TVM has no CUDA "
                     "runtime: the GPU machine's compiles the same source when it loads the library)")
    elif cuda and cuda["status"] == "not checked":
        lines.append(f"cuda source: not compiled here ({cuda['reason']})")
    lines += format_verification(rep.get("verify"))
    for note in (rep.get("output") or "").splitlines():
        # the model's notes on its interface, one a line: an ONNX file's input size (its line says
        # "input: " itself, frontend.onnx_model.OnnxModel.input_note), then what the library takes of its outputs
        lines.append(note if note.startswith("input: ") else "output: " + note)
    lines.append(format_seconds(meta.get("build_seconds", {})))
    return "\n".join(lines)


def format_float_ops(details: list) -> list[str]:
    """One line per (op, dtype, reason) of the ops that stayed float: how many, an output shape, why."""
    groups: dict = {}
    for d in details:
        groups.setdefault((d["op"], d["dtype"], d["why"]), []).append(d)
    return [f"  {op.removeprefix('relax.')} x{len(ds)} {dtype} (e.g. {ds[0]['shape']}): {why}"
            for (op, dtype, why), ds in groups.items()]


def format_seconds(bs: dict) -> str:
    """``built in 18.0 s (export 0.8 s, simplify 7.0 s, ...)``: each phase (libraries built
    before phases were timed have quantize and compile only)."""
    phases = {k: v for k, v in bs.items() if k != "total"}
    total = bs.get("total", sum(phases.values()))
    return f"built in {total:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + ")"


def format_verification(v: dict | None) -> list[str]:
    """The build's self-check, one line when it passed, a loud block when it did not."""
    if not v:
        return []
    if v["status"] == "skipped":
        return [f"verification: skipped ({v['reason']})"]
    which = "held-out images (not used by calibration)" if v.get("held_out") else "calibration images"
    head = (f"logits SQNR {v['logits_sqnr_db']:.1f} dB vs the float model on {v['images']} {which} "
            f"(floor {v['floor_db']:.0f} dB)")
    if v["status"] == "cannot judge":
        return [f"verification: CANNOT JUDGE the library: {v['reason']}"]
    if v["status"] == "ok":
        return ["verification: " + head] + format_losses(v)
    lines = ["!" * 78, f"!! VERIFICATION FAILED: {head}",
             "!! the int8 library does not compute what the float model computes."]
    if v.get("first_bad_layer"):
        worst = ", ".join(f"{ly['layer']} {ly['sqnr_db']:.1f} dB" for ly in v["layers"]
                          if ly["sqnr_db"] < v["floor_db"])[:400]
        lines.append(f"!! first layer whose int8 activations diverge: {v['first_bad_layer']} (below the floor: {worst})")
    else:
        lines.append("!! every int8 layer is above the floor on its own: the loss accumulates; try another "
                     "--calibration, or --skip the most sensitive layers")
    lines.append("!! the library was written beside the output as <stem>.unverified.so, never over a verified one")
    lines.append("!" * 78)
    return lines + format_losses(v)


def format_losses(v: dict, top: int = 5) -> list[str]:
    """Under the accuracy target (``BuildOptions.accuracy_target_db``) or the floor: the layers
    that lose the most, and the own SQNR of those that read no int8 layer (the first conv)."""
    rows, target = v.get("losses"), v.get("target_db")
    if not rows or (v["status"] == "ok" and target is not None and v["logits_sqnr_db"] >= target):
        return []
    ranked = [r for r in rows if r["loss_db"]][:top]  # a layer as good as its input loses nothing
    under = f", under the {target:g} dB target" if target is not None and v["logits_sqnr_db"] < target else ""
    took = f", measured by a per-layer build in {v['per_layer_s']:.0f} s" if "per_layer_s" in v else ""
    lines = [f"accuracy: logits {v['logits_sqnr_db']:.1f} dB{under}; the layers that lose the most "
             f"(SQNR of the best int8 input -> of the output{took}):"]
    lines += [f"  {r['layer']}: -{r['loss_db']:.1f} dB ({r['input_db']:.1f} -> {r['sqnr_db']:.1f})" for r in ranked]
    first = [r for r in rows if r["loss_db"] is None]
    if first:
        lines.append("  no loss measured (they read the image or float ops): " + ", ".join(f"{r['layer']} {r['sqnr_db']:.1f} dB" for r in first[:top])
                     + (f" (+{len(first) - top} more)" if len(first) > top else ""))
    lines.append("  try --weight-rounding gptq, --calibration search / mse, a --calib-dir of your own images, or --skip "
                 "the worst layers (docs/performance.md, 'Which scheme': what each gained held out)")
    return lines
