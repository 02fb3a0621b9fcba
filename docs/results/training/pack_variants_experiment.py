"""Pack kernel variants timed standalone (cupy): A = TVM pack_nhwc32, B = TVM channels_last (old),
C = registers + __byte_perm, E = shared-memory tile.  Non-transposed NCHW int8 -> NHWC32."""
import json, os, sys
import cupy as cp
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
meta = json.load(open(os.path.join(HERE, "meta.json")))
only = sys.argv[1] if len(sys.argv) > 1 else None

HAND = r'''
extern "C" __global__ void __launch_bounds__(256) packC(const signed char* __restrict__ src, signed char* __restrict__ out,
                                                        int C, int HW, int CP, long total) {
  int Q = HW / 4, G = CP / 32;
  long t = blockIdx.x * 256L + threadIdx.x;
  if (t >= total) return;
  int q = t % Q; int g = (t / Q) % G; long i = t / ((long)Q * G);
  unsigned w[32];
#pragma unroll
  for (int k = 0; k < 32; k++) { int j = g * 32 + k; w[k] = j < C ? __ldg((const unsigned*)(src + (i * C + j) * HW) + q) : 0u; }
#pragma unroll
  for (int p = 0; p < 4; p++) {
    unsigned r[8];
#pragma unroll
    for (int v = 0; v < 8; v++) {
      unsigned lo = __byte_perm(w[4 * v], w[4 * v + 1], p | ((p + 4) << 4));
      unsigned hi = __byte_perm(w[4 * v + 2], w[4 * v + 3], p | ((p + 4) << 4));
      r[v] = __byte_perm(lo, hi, 0x5410);
    }
    uint4* o = (uint4*)(out + ((i * HW) + 4 * q + p) * CP + g * 32);
    o[0] = make_uint4(r[0], r[1], r[2], r[3]); o[1] = make_uint4(r[4], r[5], r[6], r[7]);
  }
}
// a block: 32 channels (group g) x 128 pixels (32 words) of image i, through shared memory
extern "C" __global__ void __launch_bounds__(256) packE(const signed char* __restrict__ src, signed char* __restrict__ out,
                                                        int C, int HW, int CP, long total) {
  __shared__ unsigned s[32][33];
  int Q = HW / 4, G = CP / 32, T = (Q + 31) / 32;
  long b = blockIdx.x;
  int tile = b % T; int g = (b / T) % G; long i = b / ((long)T * G);
  int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    int ch = r * 8 + tid / 32, wq = tile * 32 + tid % 32, j = g * 32 + ch;
    s[ch][tid % 32] = (j < C && wq < Q) ? __ldg((const unsigned*)(src + (i * C + j) * HW) + wq) : 0u;
  }
  __syncthreads();
  int P = tid / 2, h = tid % 2, wq = P / 4, p = P % 4;
  if (tile * 32 + wq >= Q) return;
  unsigned r[4];
#pragma unroll
  for (int v = 0; v < 4; v++) {
    int c0 = 16 * h + 4 * v;
    unsigned lo = __byte_perm(s[c0][wq], s[c0 + 1][wq], p | ((p + 4) << 4));
    unsigned hi = __byte_perm(s[c0 + 2][wq], s[c0 + 3][wq], p | ((p + 4) << 4));
    r[v] = __byte_perm(lo, hi, 0x5410);
  }
  *(uint4*)(out + (i * HW + tile * 128 + P) * CP + g * 32 + 16 * h) = make_uint4(r[0], r[1], r[2], r[3]);
}
'''
hand = cp.RawModule(code=HAND, options=("-std=c++17",))


def timeit(fn, iters=50):
    fn()
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(iters):
        fn()
    b.record(); b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / iters


res = []
shapes = sorted({tuple(m["shape"]) for m in meta.values()})
for shape in shapes:
    n, c, h, w = shape
    cpad = -(-c // 32) * 32
    x = torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
    ref = torch.nn.functional.pad(x.permute(0, 2, 3, 1), (0, cpad - c))
    byts = x.numel() + ref.numel()
    cx = cp.from_dlpack(x)
    variants = {}
    for name in ("A", "B"):
        fn = f"{name}_{'x'.join(map(str, shape))}.cu"
        m = meta[fn]
        mod = cp.RawModule(code=open(os.path.join(HERE, fn)).read(), options=("-std=c++17",))
        k = mod.get_function(m["kernel"])
        items = (n * cpad * h * w // 128) if name == "A" else (n * cpad * h * w // 16)
        grid = -(-items // m["threads"])
        variants[name] = (k, grid, m["threads"], "tvm")
    total = n * (cpad // 32) * (h * w // 4)
    variants["C"] = (hand.get_function("packC"), -(-total // 256), 256, "hand")
    variants["E"] = (hand.get_function("packE"), n * (cpad // 32) * -(-(h * w // 4) // 32), 256, "hand")
    for name, (k, grid, thr, kind) in variants.items():
        if only and name not in only:
            continue
        out = torch.zeros_like(ref)
        co = cp.from_dlpack(out)
        if kind == "tvm":
            call = lambda: k((grid,), (thr,), (co, cx))
        else:
            call = lambda: k((grid,), (thr,), (cx, co, cp.int32(c), cp.int32(h * w), cp.int32(cpad), cp.int64(total)))
        call()
        ok = bool(torch.equal(out, ref))
        ms = timeit(call)
        row = {"shape": shape, "variant": name, "ms": ms, "gb_s": byts / ms / 1e6, "ok": ok}
        res.append(row)
        print(row, flush=True)
    big = torch.empty(n * c * h * w * 2, dtype=torch.int8, device="cuda"); dst = torch.empty_like(big)
    ms = timeit(lambda: dst.copy_(big))
    print({"shape": shape, "copy_gb_s": 2 * big.numel() / ms / 1e6}, flush=True)
out_dir = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out_dir, "pack_variants.json"), "w"), indent=1)
