"""Per-tensor choice among the observers' ranges, by the logits they give (``calibration="search"``).

Each observer (``observers.py``) picks a tensor's clipping threshold from that tensor's own
values; none sees what its rounding does to the layers after it.  ``search`` calibrates once
with all four observers, so every int8 tensor (every *point*) has up to four candidate ranges,
then walks the points in graph order and keeps, for each, the candidate whose fake-quantized
model gives logits closest to the float model's on the calibration images (greedy coordinate
descent, one pass, starting from every point at the MSE observer's range).

The fake-quantized model is the float graph with every point rounded to its int8 grid,
``clip(round(x / s), -127, 127) * s`` with ``s = amax / 127``, conv and matmul in float (torch,
as in calibration).  Weights stay float there: their per-channel rounding does not depend on the
activation ranges this chooses.  Cost: two compiles and, per point, one forward of the
calibration images per distinct candidate (VGG16: 63 forwards; MobileNet-V2: 64
points, 192 forwards, ~20 min for 8 photos at 224 px on 2 CPU cores).

The build report records each point's choice (``ranges.search.choices``) and the simulated logits
SQNR before and after the search.
"""
from __future__ import annotations

import numpy as np
import tvm
from tqdm import tqdm
from tvm import relax

from .calibrate import offload_to_torch
from .data import static_batches
from .evaluate import sqnr_db
from .graph import Graph
from .relax_utils import bindings_of, substitute

START = "mse"      # the ranges the search starts from (the least-error observer per tensor)
MIN_GAIN_DB = 1e-3  # a candidate replaces the current range only if the logits improve by more


def _fake_quant(bb: relax.BlockBuilder, x, scale: relax.Var, name: str):
    q = relax.op.round(relax.op.divide(x, scale))
    q = relax.op.minimum(relax.op.maximum(q, relax.const(-127.0, "float32")), relax.const(127.0, "float32"))
    return bb.emit(relax.op.multiply(q, scale), name_hint=f"{name}_fq")


def _logits_module(graph: Graph, fake_quant: bool) -> tuple[tvm.IRModule, int]:
    """``main(x, s0, s1, ...)`` -> logits with every point fake-quantized at its scale ``s_i``
    (a float32 scalar per point, in ``graph.points`` order), or ``main(x)`` -> float logits."""
    func = graph.func
    index = {var: i for i, var in enumerate(graph.points)} if fake_quant else {}
    scales = [relax.Var(f"s{i}", relax.TensorType((), "float32")) for i in range(len(index))]
    bb = relax.BlockBuilder()
    with bb.function("main", [*func.params, *scales]):
        with bb.dataflow():
            vmap = {p: _fake_quant(bb, p, scales[index[p]], p.name) for p in func.params if p in index}
            for b in bindings_of(func):
                v = bb.emit(offload_to_torch(substitute(b.value, vmap), b.var.ty), name_hint=b.var.name)
                vmap[b.var] = _fake_quant(bb, v, scales[index[b.var]], b.var.name) if b.var in index else v
            out = substitute(func.body.body, vmap)
            if isinstance(out.ty, relax.TupleType):   # a model returning a tuple: its first item
                out = bb.emit(relax.TupleGetItem(out, 0))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get(), len(scales)


class FakeQuantModel:
    """The float model's logits, and the same with every point rounded to its int8 grid:
    ``logits(images)`` (float) and ``logits(images, amax)`` (``amax``: ``{point: amax}``)."""

    def __init__(self, graph: Graph):
        self.batch = int(graph.func.params[0].ty.shape.values[0])
        self.names = list(graph.points.values())
        target = tvm.target.Target("llvm")
        self._float = relax.VirtualMachine(tvm.compile(_logits_module(graph, False)[0], target=target), tvm.cpu())
        self._quant = relax.VirtualMachine(tvm.compile(_logits_module(graph, True)[0], target=target), tvm.cpu())

    def logits(self, images: np.ndarray, amax: dict | None = None) -> np.ndarray:
        if amax is None:
            vm, scales = self._float, []
        else:
            vm = self._quant
            scales = [tvm.runtime.tensor(np.array(max(amax[n], 1e-30) / 127, np.float32), tvm.cpu())
                      for n in self.names]
        out = []
        for n, x in static_batches(images, self.batch):
            out.append(vm["main"](tvm.runtime.tensor(x, tvm.cpu()), *scales).numpy()[:n])
        return np.concatenate(out).reshape(len(images), -1)


def search(graph: Graph, images: np.ndarray, candidates: dict[str, dict[str, float]],
           progress: bool = True) -> tuple[dict[str, float], dict]:
    """Each point's range chosen among its ``candidates`` (``{point: {method: amax}}``, every
    point having ``START``'s) by the fake-quantized logits' SQNR against float on ``images``.

    Returns:
        ``(amax, report)``: ``{point: amax}``, and ``dict(choices={point: method}, counts=
        {method: points}, sqnr_start_db, sqnr_db, forwards)``: the simulated logits SQNR with every
        point at ``START`` and after the search.
    """
    model = FakeQuantModel(graph)
    reference = model.logits(images)
    current = {p: c[START] for p, c in candidates.items()}
    choices = {p: START for p in candidates}
    best = start = sqnr_db(reference, model.logits(images, current))
    forwards = 2
    for point in tqdm(model.names, desc="search ranges", disable=not progress, unit="tensor"):
        tried = {current[point]}
        for method, amax in candidates[point].items():
            if amax in tried or not np.isfinite(amax) or amax <= 0:
                continue
            tried.add(amax)
            trial = sqnr_db(reference, model.logits(images, {**current, point: amax}))
            forwards += 1
            if trial > best + MIN_GAIN_DB:
                best, current[point], choices[point] = trial, amax, method
    counts = {m: sum(1 for c in choices.values() if c == m) for m in sorted(set(choices.values()))}
    return current, dict(choices=choices, counts=counts, sqnr_start_db=round(float(start), 2),
                         sqnr_db=round(float(best), 2), forwards=forwards)
