"""Fingerprints of what the compiler builds, to show a restructuring changed nothing: the SHA-256
of each build's int8 logits on fixed photos, with its build time and its torch.export count.

    python benchmarks/bit_identity.py record --target llvm --out before_cpu.json          # the 16 zoo models, 64 px
    python benchmarks/bit_identity.py record --target cuda --arch sm_90a --models vgg16 resnet50 \
        --batches 1 64 --tuning-logs tuning_logs --out before_cuda.json                     # on the GPU
    python benchmarks/bit_identity.py check before_cpu.json after_cpu.json                # exit 1 on any difference

``record`` builds each model as the zoo test does on the CPU (``tvm_qconv.zoo``: random init,
its scheme -- unsigned activations, GPTQ weights -- calibrated on 4 of scikit-image's photos, at
its zoo size); on CUDA at 224 px with the default scheme and, with ``--tuning-logs``, the
committed database of each batch (``<model>-b<batch>-<arch>``).  The logits are those of every
photo (batch 1: one call per photo; batch N: the photos tiled to N), as raw float32 bytes: two
fingerprints agree only if every bit of every logit does.  ``check`` compares two records key by
key (the libraries' kernels too) and prints build times and export counts side by side.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.build import BuildOptions, compile_model  # noqa: E402
from tvm_qconv.compare.run import tuning_log_for  # noqa: E402
from tvm_qconv.config import QuantConfig  # noqa: E402
from tvm_qconv.data import skimage_photos  # noqa: E402
from tvm_qconv.ranges import Calibrate  # noqa: E402
from tvm_qconv.runtime import CompiledModel  # noqa: E402
from tvm_qconv.zoo import SIZES, zoo_config, zoo_model  # noqa: E402

CALIBRATION_IMAGES = 4


class ExportCounter:
    """Counts torch.export.export calls and their seconds while active (every export of the
    project goes through ``torch.export.export``, looked up at call time)."""

    def __init__(self):
        self.calls, self.seconds = 0, 0.0

    def __enter__(self):
        self._real = torch.export.export

        def counted(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t
        torch.export.export = counted
        return self

    def __exit__(self, *exc):
        torch.export.export = self._real


def fingerprint(logits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(logits, dtype=np.float32).tobytes()).hexdigest()


def kernels_digest(kernels: list[str]) -> str:
    """SHA-256 of the kernel of every layer, in order (two builds chose alike only if these agree)."""
    return hashlib.sha256("\n".join(kernels).encode()).hexdigest()


def record_one(name: str, target: str, arch: str | None, batch: int, size: int, tuning_logs: str | None,
               libdir: str) -> dict:
    photos = skimage_photos(size)
    model = zoo_model(name)
    config = zoo_config(name, CALIBRATION_IMAGES) if target == "llvm" else QuantConfig(num_calib_images=CALIBRATION_IMAGES)
    log = tuning_log_for(tuning_logs, name, batch, arch) if target == "cuda" else None
    options = BuildOptions(target=target, arch=arch, batch=batch, image_size=size, tuning_log=log)
    with ExportCounter() as exports:
        t = time.perf_counter()
        res = compile_model(model, os.path.join(libdir, f"{name}_b{batch}.so"), name=name, options=options,
                            config=config, ranges=Calibrate(photos[:CALIBRATION_IMAGES]), progress=False)
        build_s = time.perf_counter() - t
    lib = CompiledModel(res.lib_path)
    if batch == 1:
        logits = np.concatenate([lib(p[None]) for p in photos])
    else:
        logits = lib(np.concatenate([photos] * (-(-batch // len(photos))))[:batch])
    kernels = [r["kernel"] for r in res.report["layers"]]
    return dict(logits_sha256=fingerprint(logits), logits_head=[float(v) for v in logits.reshape(-1)[:4]],
                kernels_sha256=kernels_digest(kernels), layers=len(kernels), tuned=len(res.report.get("tuned") or {}),
                tuning_log=log, verify_sqnr_db=res.report.get("verify", {}).get("logits_sqnr_db"),
                build_s=round(build_s, 2), phases=res.meta.get("build_seconds"), exports=exports.calls,
                export_s=round(exports.seconds, 2))


def record(args) -> None:
    models = args.models or list(SIZES)
    out = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
               target=args.target, arch=args.arch, device=_device(args.target), builds={})
    with tempfile.TemporaryDirectory() as libdir:
        for name in models:
            for batch in args.batches:
                size = args.size or (SIZES[name] if args.target == "llvm" else max(224, SIZES[name]))
                key = f"{name}@{size}px-b{batch}"
                row = record_one(name, args.target, args.arch, batch, size, args.tuning_logs, libdir)
                out["builds"][key] = row
                print(f"{key}: {row['logits_sha256'][:16]}  build {row['build_s']:.1f} s, "
                      f"{row['exports']} exports ({row['export_s']:.1f} s)", flush=True)
                _write(args.out, out)  # each build as it lands: a cut-short run keeps what it measured


def _device(target: str) -> str:
    if target == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)


def check(args) -> int:
    a, b = (json.load(open(p)) for p in (args.before, args.after))
    keys = list(a["builds"])
    missing = [k for k in keys if k not in b["builds"]] + [k for k in b["builds"] if k not in a["builds"]]
    bad = 0
    print("| build | logits | kernels | build s (before -> after) | exports (before -> after) |\n"
          "|---|---|---|---|---|")
    for k in keys:
        if k not in b["builds"]:
            continue
        x, y = a["builds"][k], b["builds"][k]
        same = x["logits_sha256"] == y["logits_sha256"]
        kernels = x["kernels_sha256"] == y["kernels_sha256"]
        bad += not (same and kernels)
        print(f"| {k} | {'identical' if same else 'DIFFERENT'} | {'same' if kernels else 'DIFFERENT'} | "
              f"{x['build_s']:.1f} -> {y['build_s']:.1f} | {x['exports']} ({x['export_s']:.1f} s) -> "
              f"{y['exports']} ({y['export_s']:.1f} s) |")
    tb, ta = (sum(r["build_s"] for k, r in d["builds"].items() if k in b["builds"] and k in a["builds"])
              for d in (a, b))
    eb, ea = (sum(r["export_s"] for k, r in d["builds"].items() if k in b["builds"] and k in a["builds"])
              for d in (a, b))
    print(f"\ntotal build {tb:.1f} -> {ta:.1f} s; torch.export {eb:.1f} -> {ea:.1f} s")
    if missing:
        print(f"only in one record: {missing}")
    print(f"{len(keys) - bad - len([k for k in keys if k not in b['builds']])} of {len(keys)} builds bit-identical"
          + (f"; {bad} DIFFER" if bad else ""))
    return 1 if bad or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="build and fingerprint")
    r.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    r.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90a")
    r.add_argument("--models", nargs="+", choices=list(SIZES), default=None, help="default: the 16 zoo models")
    r.add_argument("--batches", type=int, nargs="+", default=[1])
    r.add_argument("--size", type=int, default=None, help="default: the zoo size (llvm), 224 px (cuda)")
    r.add_argument("--tuning-logs", default=None, help="folder of <model>-b<N>-<arch> databases (cuda)")
    r.add_argument("--out", required=True)
    c = sub.add_parser("check", help="compare two records")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
