"""The build report: each layer, its kernel, and what stayed float."""
from __future__ import annotations


def format_report(meta: dict) -> str:
    rep = meta["report"]
    rows = rep["layers"]
    w = max([len(r["layer"]) for r in rows] + [5])
    lines = [f"{'layer':<{w}}  {'op':<22} {'kernel':<26} {'dtype':<7} {'schedule':<9} shape"]
    sched = rep.get("schedules", {})
    kinds = {}
    for kernel, how in sched.values():
        kinds.setdefault(kernel, set()).add(how)
    for r in rows:
        how = "/".join(sorted(kinds.get(r["kernel"], {"-"}))) if r["dtype"] == "int8" else "-"
        lines.append(f"{r['layer']:<{w}}  {r['kind']:<22} {r['kernel']:<26} {r['dtype']:<7} {how:<9} "
                     f"{r.get('shape', '')}")
    n8 = sum(r["dtype"] == "int8" for r in rows)
    lines.append(f"{n8}/{len(rows)} layers in int8")
    fl = rep.get("float_ops") or {}
    lines.append("stayed float: " + (", ".join(f"{k.removeprefix('relax.')} x{v}" for k, v in sorted(fl.items()))
                                     or "nothing"))
    lines.append("layout transforms: " + (", ".join(rep.get("layout_transforms", [])) or "none"))
    if rep.get("tuned"):
        lines.append(f"tuned kernels: {len(rep['tuned'])}; others use the default schedule")
    bs = meta.get("build_seconds", {})
    lines.append(f"built in {bs.get('quantize', 0) + bs.get('compile', 0):.1f} s "
                 f"(quantize {bs.get('quantize')} s, compile {bs.get('compile')} s)")
    return "\n".join(lines)
