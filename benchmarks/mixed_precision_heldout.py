"""What an accuracy target keeps in float on trained networks (issue 58, item 2).

    python benchmarks/mixed_precision_heldout.py --models mobilenet_v2 efficientnet_lite0 --targets 22 25 30 \
        --out results/

Each model is built for ``llvm`` as ``deploy.py build --accuracy-target T --data <foolbox's photos>``
builds it: calibrated on scikit-image's photos (the default scheme), the target measured on
foolbox's 20 labelled ImageNet photos, which calibration never sees.  Records, per target, the
all-int8 figure, the layers kept in float (of how many), the figure reached and the build's
seconds.  A CUDA library of the same plan computes the same integers; what the kept layers cost
in time is the GPU's question (``deploy.py compare --lib``).  Writes
``<out>/mixed_precision_heldout.json`` after every build and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    import scheme_heldout
    from tvm_qconv import pip_assets
    from tvm_qconv.build import BuildOptions, compile_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", choices=list(scheme_heldout.MODELS), default=["mobilenet_v2"])
    p.add_argument("--targets", nargs="+", default=["22", "25", "30"])
    args = p.parse_args(argv)
    os.makedirs(os.path.join(args.out, "libs"), exist_ok=True)
    data, labels = pip_assets.foolbox_imagenet()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    path = os.path.join(args.out, "mixed_precision_heldout.json")
    for model in args.models:
        for target in args.targets:
            t0 = time.time()
            res = compile_model(scheme_heldout.load(model), os.path.join(args.out, "libs", f"{model}-{target}.so"),
                                options=BuildOptions(target="llvm", image_size=scheme_heldout.MODELS[model],
                                                     mixed_precision=target, accuracy_data=data,
                                                     accuracy_labels=labels), name=model, progress=False)
            mp = res.report["mixed_precision"]
            rows.append(dict(model=model, target=target, reached=mp["reached"], all_int8=mp["all_int8"],
                             final=mp["final"], kept=[n for k in mp["kept"] for n in k["layers"]], steps=mp["kept"], candidates=mp["candidates"],
                             builds=mp["builds"], build_s=round(time.time() - t0, 1)))
            print(f"{model} {target}: {mp['all_int8']['sqnr_db']} -> {mp['final']['sqnr_db']} dB, "
                  f"{len(rows[-1]['kept'])} of {mp['candidates']} kept", flush=True)
            with open(path + ".tmp", "w") as f:
                json.dump(dict(date=started, command="python benchmarks/mixed_precision_heldout.py " +
                               " ".join(argv or sys.argv[1:]), device=f"{platform.machine()}, {os.cpu_count()} cores",
                               rows=rows), f, indent=1)
            os.replace(path + ".tmp", path)
    print("| model | target | all int8 dB | reached dB | top-1 agreement | layers kept float | build s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['target']} | {r['all_int8']['sqnr_db']} | {r['final']['sqnr_db']} "
              f"{'' if r['reached'] else '(missed)'} | {r['final']['top1_agreement']:.0f} % | "
              f"{len(r['kept'])} of {r['candidates']} | {r['build_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
