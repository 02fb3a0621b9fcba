"""cuDNN's int8 fused conv on VGG16's layers, every engine plan timed and the fastest kept
(``tvm_qconv/compare/cudnn_int8.py``: the graph and why it is the yardstick).

    python benchmarks/cudnn_int8.py --batch 64          # VGG16's convs, one line per layer
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.conv_layers import VGG16_CONVS, workload  # noqa: E402
from tvm_qconv.compare.cudnn_int8 import missing, time_fused_conv, time_workload  # noqa: E402,F401


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None, help="folder for cudnn_int8.json")
    args = ap.parse_args(argv)
    why = missing()
    if why:
        sys.exit(f"error: cuDNN int8 cannot run here: {why}")
    rows = []
    for layer in VGG16_CONVS:
        wl = workload(layer, args.batch)
        r = dict(layer=layer, batch=args.batch, **time_workload(wl))
        r["tops"] = wl.ops / r["ms"] / 1e9
        rows.append(r)
        print(f"{layer[0]:>3}->{layer[1]:<3} @{layer[2]:<3} b{args.batch}: {r['ms']:.4f} ms {r['tops']:7.1f} TOPS "
              f"({r['plans']} plans, heuristic's {r['heuristic_ms']}, C={r['in_channels']})", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cudnn_int8.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
