"""dp4a peak: how many int8 ops per second the CUDA cores' ``__dp4a`` sustains on this GPU.

    python benchmarks/dp4a_peak.py --out results/

Each thread runs ``CHAINS`` independent accumulator chains of ``__dp4a`` on register operands
(one dp4a = 4 multiply-adds = 8 ops); enough blocks to fill every SM several times over.  The
result is the ceiling the tuned dp4a conv schedules are measured against (per-layer "% of peak").
Needs CuPy (on the GPU machine's image) for the raw kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

CHAINS = 8
KERNEL = r"""
extern "C" __global__ void dp4a_peak(const int* __restrict__ seed, int* __restrict__ out, int iters) {
    int a = seed[threadIdx.x & 31], b = seed[(threadIdx.x + 7) & 31];
    int acc[CHAINS];
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc[c] = c;
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int c = 0; c < CHAINS; ++c) acc[c] = __dp4a(a ^ c, b, acc[c]);
    }
    int s = 0;
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += acc[c];
    if (s == 0x7fffffff) out[blockIdx.x] = s;  // keeps the chains alive; never true in practice
}
""".replace("CHAINS", str(CHAINS))


def measure(iters: int = 4096, threads: int = 256, waves: int = 8, repeat: int = 20) -> dict:
    import cupy as cp
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sms = props["multiProcessorCount"]
    blocks = sms * waves * (2048 // threads)
    kern = cp.RawKernel(KERNEL, "dp4a_peak", options=(f"-arch=sm_{props['major']}{props['minor']}",))
    seed = cp.asarray(np.random.default_rng(0).integers(-2**31, 2**31 - 1, 32, dtype=np.int64).astype(np.int32))
    out = cp.zeros(blocks, cp.int32)
    args = (seed, out, np.int32(iters))
    kern((blocks,), (threads,), args)  # warm-up (module load)
    cp.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        kern((blocks,), (threads,), args)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    t = float(np.median(times))
    ops = blocks * threads * iters * CHAINS * 8  # 4 multiply-adds per dp4a
    return dict(device=props["name"].decode(), sms=sms, clock_mhz=props["clockRate"] / 1e3, blocks=blocks,
                threads=threads, iters=iters, chains=CHAINS, median_s=t, tops=ops / t / 1e12,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    res = measure()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dp4a_peak.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"dp4a peak on {res['device']} ({res['sms']} SMs, {res['clock_mhz']:.0f} MHz): {res['tops']:.1f} TOPS "
          f"({res['median_s'] * 1e3:.3f} ms for {res['blocks']} blocks x {res['threads']} threads)")
    return res


if __name__ == "__main__":
    main()
