"""Int8 peaks of this GPU's three instruction paths: the ceilings per-layer figures are held to.

    python benchmarks/int8_peaks.py --out results/

* ``dp4a``: ``__dp4a`` on the CUDA cores (4 multiply-adds per instruction), the dp4a family's.
* ``mma.sync``: ``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`` (sm_80+), the tensor-core
  family's (16*8*32 multiply-adds per warp instruction).
* ``wgmma``: ``wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8`` (sm_90a), Hopper's
  warpgroup MMA with both operands read from shared memory through matrix descriptors (64*128*32
  multiply-adds per warpgroup instruction): the path a wgmma kernel family would use.

Each kernel loops on registers (dp4a, mma.sync: several independent accumulator chains) or, for
wgmma, on a shared-memory tile that never changes (one accumulator chain per warpgroup, several
wgmmas in flight), on enough blocks to fill every SM many times; no global memory traffic but
the final store.  Ops count 2 per multiply-add.  Needs CuPy (on the GPU machine's
image); writes ``<out>/int8_peaks.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

DP4A_CHAINS = 8
DP4A = r"""
extern "C" __global__ void peak(const int* __restrict__ seed, int* __restrict__ out, int iters) {
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
""".replace("CHAINS", str(DP4A_CHAINS))

MMA_CHAINS = 8  # independent 16x8 accumulators per warp (4 registers each)
MMA = r"""
extern "C" __global__ void peak(const int* __restrict__ seed, int* __restrict__ out, int iters) {
    unsigned a0 = seed[threadIdx.x & 31], a1 = a0 ^ 1, a2 = a0 ^ 2, a3 = a0 ^ 3;
    unsigned b0 = seed[(threadIdx.x + 5) & 31], b1 = b0 ^ 7;
    int d[CHAINS][4];
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = c;
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int c = 0; c < CHAINS; ++c)
            asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                         "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                         : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    int s = 0;
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
    if (s == 0x7fffffff) out[blockIdx.x] = s;
}
""".replace("CHAINS", str(MMA_CHAINS))

# wgmma m64n128k32: 64 int32 accumulators per thread of the warpgroup.  Shared-memory matrix
# descriptor (PTX ISA "Matrix Descriptor"): bits 0-13 start address >> 4, 16-29 leading-dimension
# byte offset >> 4, 32-45 stride byte offset >> 4, 62-63 swizzle (0: none).  Without swizzle a
# "core matrix" is 8 rows x 16 bytes (128 contiguous bytes); here LBO = 128 (the next core matrix
# along K), SBO = 256 (the next 8 rows): A (64 x 32 bytes) fills 2 KB, B (128 x 32) 4 KB.
WGMMA_REGS = 64
WGMMA_PER_WAIT = 4  # wgmmas in flight per commit group (one accumulator set: a dependent chain)


def _wgmma_source() -> str:
    d = ", ".join(f"%{i}" for i in range(WGMMA_REGS))
    outs = ", ".join(f'"+r"(d[{i}])' for i in range(WGMMA_REGS))
    one = (f'"wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {{{d}}}, %{WGMMA_REGS}, %{WGMMA_REGS + 1}, p;\\n"')
    scale = f'"{{\\n .reg .pred p;\\n setp.ne.b32 p, %{WGMMA_REGS + 2}, 0;\\n"'
    return r"""
__device__ __forceinline__ unsigned long long desc(const void* smem) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16)
         | ((unsigned long long)(256 >> 4) << 32);
}

extern "C" __global__ void __launch_bounds__(128) peak(const int* __restrict__ seed, int* __restrict__ out, int iters) {
    __shared__ __align__(128) signed char tile[8192];
    for (int i = threadIdx.x; i < 8192 / 4; i += blockDim.x) ((int*)tile)[i] = seed[i & 31];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores -> wgmma's reads
    __syncthreads();
    unsigned long long da = desc(tile), db = desc(tile + 2048);
    int d[REGS];
    #pragma unroll
    for (int i = 0; i < REGS; ++i) d[i] = 0;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int j = 0; j < PER_WAIT; ++j)
            asm volatile(SCALE ONE "}\n" : OUTS : "l"(da), "l"(db), "r"(1));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    int s = 0;
    #pragma unroll
    for (int i = 0; i < REGS; ++i) s += d[i];
    if (s == 0x7fffffff) out[blockIdx.x] = s;
}
""".replace("REGS", str(WGMMA_REGS)).replace("PER_WAIT", str(WGMMA_PER_WAIT)).replace("ONE", one).replace("SCALE", scale) \
        .replace("OUTS", outs)


# name -> (source, threads per block, blocks per SM, multiply-adds per thread-iteration, minimum
# compute capability, arch suffix)
PATHS = {
    "dp4a": (DP4A, 256, 8, DP4A_CHAINS * 4, (6, 1), ""),
    "mma.sync": (MMA, 256, 4, MMA_CHAINS * 16 * 8 * 32 / 32, (8, 0), ""),
    "wgmma": (_wgmma_source(), 128, 2, WGMMA_PER_WAIT * 64 * 128 * 32 / 128, (9, 0), "a"),
}


def measure(name: str, iters: int = 2048, waves: int = 16, repeat: int = 15) -> dict:
    """Time path ``name`` (:data:`PATHS`) on the current GPU; its TOPS and what was run."""
    import cupy as cp  # optional: not a dependency of the project (--help works without it)
    source, threads, per_sm, macs, min_cc, suffix = PATHS[name]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    cc = (props["major"], props["minor"])
    if cc < min_cc or (suffix == "a" and cc != (9, 0)):
        return dict(path=name, skipped=f"needs sm_{min_cc[0]}{min_cc[1]}{suffix}; this GPU is sm_{cc[0]}{cc[1]}")
    kern = cp.RawKernel(source, "peak", options=(f"-arch=sm_{cc[0]}{cc[1]}{suffix}",))
    blocks = props["multiProcessorCount"] * per_sm * waves
    seed = cp.asarray(np.random.default_rng(0).integers(-2**31, 2**31 - 1, 32, dtype=np.int64).astype(np.int32))
    out = cp.zeros(blocks, cp.int32)
    args = (seed, out, np.int32(iters))
    kern((blocks,), (threads,), args)  # warm-up (module load, clocks)
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
    ops = 2 * macs * threads * blocks * iters
    return dict(path=name, tops=ops / t / 1e12, median_s=t, blocks=blocks, threads=threads, iters=iters)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    args = ap.parse_args(argv)
    import cupy as cp  # optional: not a dependency of the project (--help works without it)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    res = dict(device=props["name"].decode(), sms=props["multiProcessorCount"], clock_mhz=props["clockRate"] / 1e3,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), peaks=[measure(p) for p in args.paths])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "int8_peaks.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"int8 peaks on {res['device']} ({res['sms']} SMs, {res['clock_mhz']:.0f} MHz):")
    for p in res["peaks"]:
        print(f"  {p['path']:>9}: " + (f"{p['tops']:7.1f} TOPS" if "tops" in p else p["skipped"]))
    return res


if __name__ == "__main__":
    main()
