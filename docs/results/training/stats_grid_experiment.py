"""Experiment (device, not in the project): the statistics kernels' grid, blocks a channel capped,
against the current one; each timed with its torch reduction of the partials, 20 calls in a CUDA
graph.  Decides whether fewer, longer threads (smaller partials) beat the current grid.  Run at
tree 4d4d7d1, where ``_bn_sums`` and ``bn_grad_sums`` still added the partials by torch (since
then ``bn_finish`` / ``bn_coeffs`` add them, and these two return the partials)."""
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd())
import torch
from tvm_qconv.compare.measure import cuda_graph_ms
from tvm_qconv.nn import functional, tvm_kernels
from tvm_qconv.schedules.training import elementwise as E

cuda = torch.device("cuda")
functional._load_lazy_kernels("cuda")
original = E.stats_grid
SHAPES = [(128, 64, 56, 56), (128, 256, 56, 56), (128, 512, 28, 28), (128, 1024, 14, 14), (128, 2048, 7, 7),
          (32, 64, 224, 224), (32, 512, 14, 14)]
rows = []
for cap in (None, 64, 16, 8, 4):
    def grid(shape, cap=cap):
        blocks, threads, per = original(shape)
        if cap is None or blocks <= cap:
            return blocks, threads, per
        n, c, h, w = shape
        m = n * h * w // (4 if E.quads(shape) else 1)
        return cap, threads, -(-m // (cap * threads))
    E.stats_grid = grid
    os.environ[tvm_kernels.CACHE_ENV] = tempfile.mkdtemp(prefix=f"grid{cap}-")
    tvm_kernels._kernels.clear()
    for shape in SHAPES:
        g = torch.Generator(device=cuda).manual_seed(0)
        y = torch.randn(shape, device=cuda, generator=g)
        bits = functional.pack_bits(torch.randn(shape, device=cuda, generator=g) > 0)
        r = {"cap": cap, "shape": shape, "grid": list(grid(shape)),
             "bn_stats_ms": cuda_graph_ms(lambda: tvm_kernels._bn_sums(y)),
             "grad_stats_ms": cuda_graph_ms(lambda: tvm_kernels.grad_stats(y, bits)),
             "bn_grad_sums_ms": cuda_graph_ms(lambda: tvm_kernels.bn_grad_sums(y, bits, y, y.new_zeros(shape[1])))}
        rows.append(r)
        print(r, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "stats_grid.json"), "w"), indent=1)
