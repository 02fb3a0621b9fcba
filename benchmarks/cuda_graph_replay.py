"""Does a captured PyTorch CUDA graph compute the model?  One factor at a time.

    python benchmarks/cuda_graph_replay.py --models vgg16 resnet18 [--phases torch tvm row] --out results/

`deploy.py compare` found (H100, 2026-11-25) every PyTorch CUDA-graph row giving logits that were
not the model's; this script found why (the model was freed after its capture; docs/history.md,
"One command against every baseline") and keeps checking it.  Phases:

- ``torch``: captures the float model with the project's recipe
  (``tvm_qconv.compare.baselines.capture``) and with one setting changed at a time, replays it on
  the captured input and on a new one, and prints each replay's relative error against eager
  PyTorch on the same input (a graph that computes the model: < 1e-2);
- ``tvm``: the same after an int8 library (resnet18, CUDA graphs on) was built and run in this
  process (a PyTorch-side cause or a TVM-side one);
- ``row``: a compare row's own steps (``prepare_torch``, new inputs, replays, ``time_calls``),
  the replay checked against eager after each.

Writes ``<out>/cuda_graph_replay.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_qconv.compare.baselines import capture, prepare_torch  # noqa: E402  (imports no TVM: this runs without it)

# TVM (through tvm_qconv.build, .runtime and .compare.measure) is imported by the phases that use it:
# the torch phase measures PyTorch alone in the process.

# One factor changed at a time from the compare recipe (benchmark on, channels_last, no_grad).
VARIANTS = {
    "recipe": {},
    "benchmark_off": dict(benchmark=False),
    "nchw": dict(channels_last=False),
    "inference_mode": dict(grad="inference"),
    "fp16": dict(dtype=torch.float16),
}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check(name: str, batch: int, benchmark=True, channels_last=True, grad="no_grad", dtype=torch.float32) -> dict:
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = benchmark
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.get_model(name).eval().to("cuda", dtype).to(memory_format=fmt)
    xs = [torch.randn(batch, 3, 224, 224, device="cuda").to(dtype).contiguous(memory_format=fmt) for _ in range(2)]
    ctx = torch.inference_mode() if grad == "inference" else torch.no_grad()
    with ctx:
        call, out = capture(model, xs[0].clone())
        torch.cuda.synchronize()
        first = out.clone()                       # what the capture itself left in ``out``
        same = call(xs[0]).clone()                # replay on the captured input
        new = call(xs[1]).clone()                 # replay on a new input
        eager = [model(x) for x in xs]
        torch.cuda.synchronize()
    row = dict(model=name, batch=batch, err_capture_pass=_rel_err(first, eager[0]),
               err_replay_same=_rel_err(same, eager[0]), err_replay_new=_rel_err(new, eager[1]),
               out_abs_max=float(new.float().abs().max()), eager_abs_max=float(eager[1].float().abs().max()))
    del model, call, out
    torch.cuda.empty_cache()
    return row


class _Ctx:
    """What ``prepare_torch`` reads of a comparison's context."""

    device = "cuda"

    def __init__(self, model):
        self.model = model

    def input_sets(self, batch):
        return [torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(k)).numpy() for k in range(4)]


def check_compare_row(name: str, batch: int, precision: str) -> dict:
    """A compare row's steps in order (prepare with its replay check, timing, agreement), the
    replay checked against eager after each step."""
    from tvm_qconv.compare.measure import time_calls  # brings TVM: see the note at the top
    torch.manual_seed(0)
    ctx = _Ctx(torchvision.models.get_model(name).eval())
    x = np.random.default_rng(7).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    row = dict(model=name, batch=batch, precision=precision)
    with torch.no_grad():
        eager = prepare_torch(ctx, batch, precision, graph=False)
        want = torch.from_numpy(eager.get(eager.call(eager.put(x))))
        graph = prepare_torch(ctx, batch, precision, graph=True)

        def err():
            return _rel_err(torch.from_numpy(graph.get(graph.call(graph.put(x)))), want)
        row["after_prepare"] = err()
        inputs = [graph.put(a) for a in ctx.input_sets(batch)]
        row["after_inputs"] = err()
        for _ in range(3):
            graph.call(inputs[0])
        torch.cuda.synchronize()
        row["after_3_replays"] = err()
        time_calls(graph.call, inputs, cuda=True, budget_s=0.5)
        row["after_time_calls"] = err()
    return row


def run_tvm_library(workdir: str) -> dict:
    """Build resnet18 in int8 for this GPU (CUDA graphs on) and run it a few times."""
    from tvm_qconv.build import BuildOptions, compile_model  # brings TVM: see the note at the top
    from tvm_qconv.runtime import CompiledModel
    t = time.perf_counter()
    path = os.path.join(workdir, "resnet18_b1.so")
    major, minor = torch.cuda.get_device_capability()
    compile_model("resnet18", path, options=BuildOptions(target="cuda", arch=f"sm_{major}{minor}", batch=1,
                                                         cuda_graph=True, verify=False), progress=False)
    lib = CompiledModel(path)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype("float32")
    for _ in range(5):
        y = lib(x)
    return dict(build_s=round(time.perf_counter() - t, 1), logits_shape=list(np.asarray(y).shape))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vgg16", "resnet18"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--phases", nargs="+", choices=["torch", "tvm", "row"], default=["torch", "tvm", "row"],
                    help="torch: PyTorch alone; tvm: after an int8 TVM library ran in this process; "
                         "row: a compare row's steps, the replay checked after each")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def sweep(phase: str):
        for name in args.models:
            for batch in args.batches:
                for variant, kw in VARIANTS.items():
                    try:
                        row = check(name, batch, **kw)
                    except Exception as err:  # noqa: BLE001 - a variant that fails is a finding
                        row = dict(model=name, batch=batch, error=f"{type(err).__name__}: {err}"[:300])
                    row.update(phase=phase, variant=variant)
                    rows.append(row)
                    print(json.dumps(row), flush=True)

    if "torch" in args.phases:
        sweep("torch only")
    if "row" in args.phases:
        for name in args.models:
            for batch in args.batches:
                for precision in ("fp32", "fp16"):
                    row = dict(phase="row", **check_compare_row(name, batch, precision))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if "tvm" in args.phases:
        with tempfile.TemporaryDirectory() as tmp:
            info = run_tvm_library(tmp)
            print(json.dumps(dict(tvm_library=info)), flush=True)
            sweep("after a TVM library ran")
    with open(os.path.join(args.out, "cuda_graph_replay.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       cudnn=torch.backends.cudnn.version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
