"""Per-tensor choice among the observers' ranges, by the logits they give (``calibration="search"``).

Each observer (``observers.py``) picks a tensor's clipping threshold from that tensor's own
values; none sees what its rounding does to the layers after it.  ``search`` calibrates once
with all four observers, so every int8 tensor (every *point*) has up to four candidate ranges,
then walks the points in graph order and keeps, for each, the candidate whose fake-quantized
model gives logits closest to the float model's on the calibration images (greedy coordinate
descent, one pass, starting from every point at the MSE observer's range).

The fake-quantized model is the float graph with every point rounded to its int8 grid,
``clip(round(x / s), -127, 127) * s`` with ``s = amax / 127`` (0..255 at ``amax / 255`` for the
points the build stores unsigned, ``QuantConfig.unsigned_activations``), conv and matmul in
float (torch, as in calibration).  Weights stay float there: their per-channel rounding does not
depend on the activation ranges this chooses (``FakeQuantModel(int8_weights=True)`` rounds them too, for
``benchmarks/unsigned_activations.py``).  Cost: two compiles and, per point, one forward of the
calibration images per distinct candidate (VGG16: 63 forwards; MobileNet-V2: 64
points, 192 forwards, ~20 min for 8 photos at 224 px on 2 CPU cores).

The build report records each point's choice (``ranges.search.choices``) and the simulated logits
SQNR before and after the search.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .calibrate import offload_to_torch
from ..data import static_batches
from ..evaluate import sqnr_db
from ..graph import Graph
from ..progress import bar
from ..relax_utils import bindings_of, substitute

START = "mse"      # the ranges the search starts from (the least-error observer per tensor)
MIN_GAIN_DB = 1e-3  # a candidate replaces the current range only if the logits improve by more


def _fake_quant(bb: relax.BlockBuilder, x, scale: relax.Var, levels: relax.Var, name: str):
    """``clip(round(x / scale), -levels, levels) * scale``: ``levels`` 127 is the int8 grid; 255
    the unsigned grid of a tensor that is never negative (0..255 at the same range)."""
    q = relax.op.round(relax.op.divide(x, scale))
    q = relax.op.minimum(relax.op.maximum(q, relax.op.negative(levels)), levels)
    return bb.emit(relax.op.multiply(q, scale), name_hint=f"{name}_fq")


def _int8_weight(value: np.ndarray, axis: int) -> np.ndarray:
    """``value`` rounded to int8 per slice along ``axis`` (the output channel), as the build does."""
    others = tuple(i for i in range(value.ndim) if i != axis)
    amax = np.maximum(np.abs(value).max(axis=others, keepdims=True), 1e-30)
    return (np.clip(np.round(value / (amax / 127)), -127, 127) * (amax / 127)).astype(value.dtype)


def _weights_rounded(call):
    """A conv2d (OIHW constant) or matmul (constant [K, O]) call with its weight rounded to int8
    per output channel; any other call as it is."""
    op = getattr(call.op, "name", None) if isinstance(call, relax.Call) else None
    if op not in ("relax.nn.conv2d", "relax.matmul") or not isinstance(call.args[1], tvm.ir.expr.GenericConst):
        return call
    w = call.args[1].value.numpy()
    axis = 0 if op == "relax.nn.conv2d" else w.ndim - 1
    args = [call.args[0], relax.const(_int8_weight(w, axis)), *call.args[2:]]
    return relax.Call(call.op, args, call.attrs, call.ty_args)


def _logits_module(graph: Graph, fake_quant: bool, int8_weights: bool = False) -> tuple[tvm.IRModule, int]:
    """``main(x, s0, l0, s1, l1, ...)`` -> logits with every point fake-quantized at its scale
    ``s_i`` and grid ``l_i`` (float32 scalars per point, in ``graph.points`` order), or ``main(x)``
    -> float logits; ``int8_weights``: every conv / matmul weight rounded per output channel."""
    func = graph.func
    index = {var: i for i, var in enumerate(graph.points)} if fake_quant else {}
    scales = [relax.Var(f"s{i}", relax.TensorType((), "float32")) for i in range(len(index))]
    levels = [relax.Var(f"l{i}", relax.TensorType((), "float32")) for i in range(len(index))]

    def fq(var, value):
        return _fake_quant(bb, value, scales[index[var]], levels[index[var]], var.name)

    bb = relax.BlockBuilder()
    with bb.function("main", [*func.params, *[v for pair in zip(scales, levels) for v in pair]]):
        with bb.dataflow():
            vmap = {p: fq(p, p) for p in func.params if p in index}
            for b in bindings_of(func):
                value = substitute(b.value, vmap)
                if int8_weights:
                    value = _weights_rounded(value)
                v = bb.emit(offload_to_torch(value, b.var.ty), name_hint=b.var.name)
                vmap[b.var] = fq(b.var, v) if b.var in index else v
            out = substitute(func.body.body, vmap)
            if isinstance(out.ty, relax.TupleType):   # a model returning a tuple: its first item
                out = bb.emit(relax.TupleGetItem(out, 0))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    mod = bb.get()
    for gv, f in graph.kernels.items():     # the call_tir kernels main calls (an ONNX import's)
        mod[gv] = f
    return mod, len(scales)


class FakeQuantModel:
    """The float model's logits, and the same with every point rounded to its int8 grid:
    ``logits(images)`` (float) and ``logits(images, amax)`` (``amax``: ``{point: amax}``;
    ``unsigned``: points rounded to 0..255 instead of -127..127, for a tensor never negative).
    ``int8_weights``: the rounded model's weights are int8 per output channel too."""

    def __init__(self, graph: Graph, int8_weights: bool = False):
        self.batch = int(graph.func.params[0].ty.shape.values[0])
        self.names = list(graph.points.values())
        target = tvm.target.Target("llvm")
        self._float = relax.VirtualMachine(tvm.compile(_logits_module(graph, False)[0], target=target), tvm.cpu())
        self._quant = relax.VirtualMachine(tvm.compile(_logits_module(graph, True, int8_weights)[0], target=target),
                                           tvm.cpu())

    def logits(self, images: np.ndarray, amax: dict | None = None, unsigned=frozenset(),
               levels: float | None = None) -> np.ndarray:
        """``levels``: every point's grid instead (``amax / levels`` steps of ``+-levels``; with a
        huge one, a point that is not rounded)."""
        if amax is None:
            vm, scalars = self._float, []
        else:
            vm, scalars = self._quant, []
            for n in self.names:
                grid = levels if levels is not None else 255.0 if n in unsigned else 127.0
                scalars += [tvm.runtime.tensor(np.array(max(amax[n], 1e-30) / grid, np.float32), tvm.cpu()),
                            tvm.runtime.tensor(np.array(grid, np.float32), tvm.cpu())]
        out = []
        for n, x in static_batches(images, self.batch):
            out.append(vm["main"](tvm.runtime.tensor(x, tvm.cpu()), *scalars).numpy()[:n])
        return np.concatenate(out).reshape(len(images), -1)


def search(graph: Graph, images: np.ndarray, candidates: dict[str, dict[str, float]],
           progress: bool = True, unsigned=frozenset()) -> tuple[dict[str, float], dict]:
    """Each point's range chosen among its ``candidates`` (``{point: {method: amax}}``, every
    point having ``START``'s) by the fake-quantized logits' SQNR against float on ``images``;
    ``unsigned``: the points the build stores unsigned (rounded to 0..255 there).

    Returns:
        ``(amax, report)``: ``{point: amax}``, and ``dict(choices={point: method}, counts=
        {method: points}, sqnr_start_db, sqnr_db, forwards)``: the simulated logits SQNR with every
        point at ``START`` and after the search.
    """
    model = FakeQuantModel(graph)
    reference = model.logits(images)
    current = {p: c[START] for p, c in candidates.items()}
    choices = {p: START for p in candidates}
    best = start = sqnr_db(reference, model.logits(images, current, unsigned))
    forwards = 2
    for point in bar(model.names, enabled=progress, desc="search ranges", unit="tensor"):
        tried = {current[point]}
        for method, amax in candidates[point].items():
            if amax in tried or not np.isfinite(amax) or amax <= 0:
                continue
            tried.add(amax)
            trial = sqnr_db(reference, model.logits(images, {**current, point: amax}, unsigned))
            forwards += 1
            if trial > best + MIN_GAIN_DB:
                best, current[point], choices[point] = trial, amax, method
    counts = {m: sum(1 for c in choices.values() if c == m) for m in sorted(set(choices.values()))}
    return current, dict(choices=choices, counts=counts, sqnr_start_db=round(float(start), 2),
                         sqnr_db=round(float(best), 2), forwards=forwards)
