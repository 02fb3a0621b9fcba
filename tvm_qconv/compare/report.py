"""What a comparison writes: ``compare_<model>.json`` (every row and the machine it ran on),
``compare_<model>.md`` (a table per batch size) and ``compare_<model>.png`` (latency bars)."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
from PIL import Image

from ..fileio import atomic_path
from .measure import mark_wrong

# The PNG's colour per family: the project's bars stand out, the int8 tools share a hue.
COLORS = {"tvm_qconv": "#d62728", "pytorch": "#1f77b4", "cudnn": "#9467bd", "onnxruntime": "#8c564b",
          "tensorrt": "#2ca02c"}


def paths(out_dir: str, tag: str) -> dict:
    """The result files of a comparison, and ``partial``: the rows of a run in progress (a run cut
    short keeps them there, and a complete result from before stays whole at ``json``)."""
    found = {kind: os.path.join(out_dir, f"compare_{tag}.{kind}") for kind in ("json", "md", "png")}
    return dict(found, partial=os.path.join(out_dir, f"compare_{tag}.partial.json"))


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - not installed (or broken): recorded as absent
        return None
    return str(getattr(mod, "__version__", getattr(mod, "backend_version", lambda: "?")()))


def gpu_state() -> dict:
    """The GPU's clocks, temperature and power now (read again at the end of a run: the clocks
    under load, not those of an idle GPU at its start)."""
    return {k.replace(".", "_"): v for k, v in _nvidia_smi().items() if k != "name"}


def _nvidia_smi() -> dict:
    fields = ["name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit", "temperature.gpu", "memory.total"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values = [v.strip() for v in out.split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """The machine and software a comparison ran on: date, command, GPU (name, clocks, driver),
    CPU, and the versions of every library a row uses (None: not installed)."""
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               python=platform.python_version(), cpu=_cpu_name(), cpu_count=os.cpu_count(),
               versions={name: _version(module) for name, module in
                         (("torch", "torch"), ("torchvision", "torchvision"), ("tvm", "tvm"), ("numpy", "numpy"),
                          ("onnx", "onnx"), ("onnxruntime", "onnxruntime"), ("tensorrt", "tensorrt"),
                          ("cudnn_frontend", "cudnn"))})
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        env["gpu"] = dict(name=torch.cuda.get_device_name(0), capability=f"{major}.{minor}",
                          **{k.replace(".", "_"): v for k, v in _nvidia_smi().items() if k != "name"})
        env["versions"].update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def _plain(value):
    """``value`` as strict JSON: an infinite SQNR (identical logits) becomes the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_json(path: str, results: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(_plain(results), f, indent=1, default=str, allow_nan=False)


def _num(value):
    """A JSON value back as a number ("inf", written for an exact match, is infinity)."""
    return float(value) if isinstance(value, str) else value


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "exact" if value > 0 else "-inf"
    return f"{value:{spec}}{suffix}"


def progress_line(tag: str, row: dict) -> str:
    head = f"[compare] {tag} b{row['batch']:<3} {row['name']:<38}"
    if row["status"] not in ("ok", "wrong"):
        return f"{head} {row['status']}: {row['reason']}"
    parts = [f"{row['median_ms']:.3f} ms"]
    if row.get("p99_ms") is not None:
        parts[0] += f" (p99 {row['p99_ms']:.3f})"
    parts.append(f"{_fmt(row.get('images_per_s'), '.0f')} img/s")
    if row.get("peak_mem_mib") is not None:
        parts.append(f"{row['peak_mem_mib']:.0f} MiB")
    if row.get("top1_agree") is not None:
        parts.append(f"top-1 {row['top1_agree']:.0%}, {_fmt(_num(row.get('sqnr_db')), '.1f', ' dB')}")
    if row.get("note"):
        parts.append(row["note"])
    if row["status"] == "wrong":
        parts.append(f"WRONG: {row['reason']}")
    return f"{head} " + ", ".join(parts)


def summary(rows: list[dict]) -> list[dict]:
    """Per batch: the fastest row of each family, and the project's speed-up over each."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        best = {}
        for r in rows:
            if r["batch"] == batch and r["status"] == "ok" and r.get("median_ms"):
                if r["family"] not in best or r["median_ms"] < best[r["family"]]["median_ms"]:
                    best[r["family"]] = r
        ours = best.get("tvm_qconv")
        entry = dict(batch=batch, best={f: dict(name=r["name"], median_ms=r["median_ms"]) for f, r in best.items()})
        if ours:
            entry["speedup"] = {f: r["median_ms"] / ours["median_ms"] for f, r in best.items() if f != "tvm_qconv"}
        out.append(entry)
    return out


def summary_lines(entries: list[dict]) -> list[str]:
    lines = []
    for e in entries:
        ours = e["best"].get("tvm_qconv")
        if not ours:
            lines.append(f"[compare] b{e['batch']}: no tvm_qconv row ran")
            continue
        others = ", ".join(f"{e['best'][f]['name']} {e['best'][f]['median_ms']:.3f} ms ({s:.2f}x)"
                           for f, s in e["speedup"].items())
        lines.append(f"[compare] b{e['batch']}: {ours['name']} {ours['median_ms']:.3f} ms; best of the others: "
                     f"{others or 'none ran'}")
    return lines


def markdown(results: dict) -> str:
    env = results["environment"]
    gpu = env.get("gpu", {})
    where = (f"{gpu.get('name')} (driver {gpu.get('driver_version')}, SM clock {gpu.get('clocks_sm')} of max "
             f"{gpu.get('clocks_max_sm')}, memory clock {gpu.get('clocks_mem')})" if gpu else f"CPU: {env['cpu']}")
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
    lines = [f"# {results['model']} ({results['weights']}, {results['image_size']} px): int8 against the baselines",
             "", f"- **Device:** {where}", f"- **Date:** {env['date']}", f"- **Command:** `{env['command']}`",
             f"- **Software:** {versions}",
             f"- **Method:** median and p99 of CUDA-event latencies per forward (wall time on the CPU), cycling "
             f"over {results['input_sets']} input sets, up to {results['budget_s']} s per row after warm-up; "
             "memory is the device memory a row holds after its runs (cudaMemGetInfo delta); agreement is "
             f"against {results.get('reference', 'fp32 PyTorch (TF32 off)')} on the same real photos; a row under "
             f"{results.get('agreement_floor_db', 10):g} dB is marked wrong and left out of the speed-ups and the "
             "chart.", ""]
    end = results.get("gpu_at_end") or {}
    if end:
        lines.insert(-2, f"- **GPU at the end of the run:** SM clock {end.get('clocks_sm')}, memory clock "
                         f"{end.get('clocks_mem')}, {end.get('temperature_gpu')} C")
    labelled = results.get("labelled")
    if labelled:
        ref = labelled["reference"]
        lines.insert(-1, f"- **Accuracy:** top-1 / top-5 on {labelled['images']} labelled images of "
                         f"`{labelled['data']}` ({labelled['layout']}); {results.get('reference', 'fp32 PyTorch')}: "
                         f"{ref['top1']:.1f} / {ref['top5']:.1f} %"
                         + (" (fewer than 1,000 images: a smoke test, not an accuracy figure)"
                            if labelled["images"] < 1000 else ""))
    acc_head, acc_rule = (" top-1 % | top-5 % |", "---|---|") if labelled else ("", "")
    for batch in results["batches"]:
        lines += [f"## Batch {batch}", "",
                  "| baseline | median ms | p99 ms | images/s | peak MiB | build s | top-1 agree | SQNR dB |"
                  + acc_head + " tvm_qconv speed-up | note |", "|---|---|---|---|---|---|---|---|" + acc_rule + "---|---|"]
        best_ours = min((r["median_ms"] for r in results["rows"] if r["batch"] == batch and r["status"] == "ok"
                         and r["family"] == "tvm_qconv"), default=None)
        for r in (r for r in results["rows"] if r["batch"] == batch):
            if r["status"] not in ("ok", "wrong"):
                lines.append(f"| {r['name']} | {r['status']}: {r['reason']} | | | | | | | |" + (" | |" if labelled else "")
                             + " |")
                continue
            up = r["median_ms"] / best_ours if best_ours and r["family"] != "tvm_qconv" and r["status"] == "ok" \
                else None
            note = r.get("note", "") + (f" **wrong outputs**: {r['reason']}" if r["status"] == "wrong" else "")
            lines.append(f"| {r['name']} | {r['median_ms']:.3f} | {_fmt(r.get('p99_ms'), '.3f')} | "
                         f"{_fmt(r.get('images_per_s'), '.0f')} | {_fmt(r.get('peak_mem_mib'), '.0f')} | "
                         f"{_fmt(r.get('build_s'), '.1f')} | {_fmt(r.get('top1_agree'), '.0%')} | "
                         f"{_fmt(_num(r.get('sqnr_db')), '.1f')} |"
                         + (f" {_fmt(r.get('top1'), '.1f')} | {_fmt(r.get('top5'), '.1f')} |" if labelled else "")
                         + f" {_fmt(up, '.2f', 'x')} | {note.strip()} |")
        lines.append("")
    return "\n".join(lines)


def _on_cpu(row: dict) -> bool:
    return bool(row.get("on_cpu")) or row.get("note", "").startswith("on the CPU")


def plot(results: dict, path: str) -> None:
    """Horizontal latency bars, one panel per batch size, coloured by family (the project's in
    red); on a GPU run, rows that ran on the CPU stay in the table only (they would flatten
    every other bar)."""
    # matplotlib (~1 s to import) draws the chart only; Agg is picked here, where a chart is
    # drawn, not for whoever imports this module
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    batches = results["batches"]
    gpu_run = results.get("device") == "cuda"
    per = {b: sorted((r for r in results["rows"] if r["batch"] == b and r["status"] == "ok"
                      and not (gpu_run and _on_cpu(r))), key=lambda r: r["median_ms"]) for b in batches}
    height = max(2.5, 0.32 * max((len(v) for v in per.values()), default=1) + 1.6)
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), height), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = per[batch][::-1]
        ax.barh([r["name"] for r in rows], [r["median_ms"] for r in rows],
                color=[COLORS.get(r["family"], "grey") for r in rows])
        for i, r in enumerate(rows):
            ax.text(r["median_ms"], i, f" {r['median_ms']:.3g}", va="center", fontsize=7)
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xlabel("median latency (ms), lower is better", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, max((r["median_ms"] for r in rows), default=1) * 1.25)
    families = sorted({r["family"] for rows in per.values() for r in rows}, key=list(COLORS).index)
    fig.legend(handles=[Patch(color=COLORS[f], label=f) for f in families], loc="lower center",
               ncol=len(families), fontsize=7, frameon=False)
    where = results["environment"].get("gpu", {}).get("name") or results["environment"]["cpu"]
    fig.suptitle(f"{results['model']} int8 (tvm_qconv) against the baselines on {where}, "
                 f"{results['environment']['date']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90)
        # 64 colours are all a bar chart has: a third of the size, so charts can be committed
        # without crowding what a device call can carry
        Image.open(tmp).convert("RGB").quantize(colors=64).save(tmp, format="PNG", optimize=True)
    plt.close(fig)


def write_all(p: dict, results: dict) -> None:
    """The finished comparison's JSON, table and chart; the in-progress rows file is dropped."""
    write_json(p["json"], results)
    with atomic_path(p["md"]) as tmp, open(tmp, "w") as f:
        f.write(markdown(results))
    plot(results, p["png"])
    if "partial" in p and os.path.exists(p["partial"]):
        os.remove(p["partial"])


def render(json_path: str, floor_db: float | None = None) -> dict:
    """Write the table and the chart again from a comparison's JSON (edited, merged, or from an
    older version), marking rows under the agreement floor ``wrong`` first (default: the run's)."""
    with open(json_path) as f:
        results = json.load(f)
    floor = results.get("agreement_floor_db", 10.0) if floor_db is None else floor_db
    results["agreement_floor_db"] = floor
    for row in results["rows"]:
        mark_wrong(row, floor)
    results["summary"] = summary(results["rows"])
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    write_all({kind: f"{stem}.{kind}" for kind in ("json", "md", "png")}, results)
    return results


if __name__ == "__main__":  # python -m tvm_qconv.compare.report results/compare_vgg16.json [floor dB]
    for line in summary_lines(render(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)["summary"]):
        print(line)
