"""Mixed precision under an accuracy target (``deploy.py build --accuracy-target``): the fewest
conv / linear layers kept out of int8, chosen by measured sensitivity, until the library's check
on images held out from calibration reaches the target.

    the all-int8 build (pipeline.py)  -- held-out score >= target: done, nothing kept
      | LayerSim: the float graph at batch 1 with each conv / linear layer's weights int8 or
      |   float and each activation rounded to its int8 grid or not, as the plan of a given set
      |   of kept layers would round them (conv and matmul in torch, as in calibration)
      | choose(): lazy greedy on the calibration images -- keep the layer, or the layers a tensor
      |   needs float to stay unrounded, that gain the most logits SQNR per layer, until the
      |   simulation reaches the goal
      | rebuild with those layers in the skip list (the same ranges: GivenRanges), score it held out
      v short of the target: the goal rises by the shortfall, the greedy goes on (ROUNDS builds at most)

Why a simulation picks and a build judges: ranking ~50 layers by real builds would take ~50
builds per layer kept; the simulation takes one forward of a few images per candidate, and the
build it chose is then measured as it will run.  Why greedy with neighbours re-measured: a layer
kept float still reads and writes int8 where its neighbours are int8 (its input is its producer's
int8 output; an int8 reader quantizes its output), so keeping one layer buys its weights' error
only; keeping two adjacent ones also removes the tensor between them, and a residual stream is
int8 until every layer writing into it is float.  So the greedy's moves are single layers and the
sets of layers each tensor needs float, valued per layer added (:func:`choose`).

Kept layers run in float32 (``lowering/relax.py``'s float ops: on llvm; on CUDA, the float ops'
dlight schedules).  fp16 tensor-core kernels for them are issue 58's item 2, not done.
"""
from __future__ import annotations

import math
import time

import numpy as np
import tvm
from tvm import relax

from . import verify as verify_mod
from .config import AccuracyTarget
from .errors import InputError
from .evaluate import sqnr_db
from .data import static_batches
from .graph import Graph
from .labelled_images import labelled_images, read_batch
from .ranges.calibrate import offload_to_torch
from .ranges.search import _fake_quant, _int8_weight
from .relax_utils import bindings_of, substitute

SIM_IMAGES = 8      # calibration images the simulation scores on (one forward each per candidate tried)
MARGIN_DB = 0.5     # the simulation's goal above the target at first: it is scored on other images
ROUNDS = 4          # builds after the all-int8 one, at most
FINE = 1e7          # levels of an activation left unrounded: steps of amax * 1e-4, clipped at 1000 amax


class Judge:
    """Scores a library on the images it is judged on: logits SQNR against the float model and
    top-1 agreement with it (``score``); the float logits computed once.

    Raises:
        InputError: fewer than two images, or float logits that do not depend on the input
            (nothing to measure: ``verify.input_blind``).
    """

    def __init__(self, frontend, images: np.ndarray, where: str):
        if images is None or len(images) < 2:
            raise InputError(f"--accuracy-target needs images held out from calibration to measure on; {where} "
                             f"left {0 if images is None else len(images)}: give more calibration images, or "
                             "--data DIR "
                             "(images calibration does not see)")
        self.images, self.where = images, where
        self.reference = frontend.reference(images)
        if verify_mod.input_blind(self.reference):
            raise InputError(f"--accuracy-target: the float model gives the same logits for all {len(images)} images "
                             f"of {where} (its output does not depend on the input, as in a random init): no target "
                             "can be measured against it; build trained weights (--weights), or drop the target")

    def score(self, s) -> dict:
        outs = verify_mod.run_batches(s.executable, s.params, s.target, s.batch, self.images)
        got = np.concatenate([o[0] for o in outs]).reshape(len(self.images), -1)
        ref = self.reference.reshape(len(self.images), -1)
        return dict(sqnr_db=round(float(sqnr_db(ref, got)), 2),
                    top1_agreement=round(100.0 * float(np.mean(got.argmax(1) == ref.argmax(1))), 1))


class LayerSim:
    """The float graph with, per call, a set of conv / linear layers kept float: their weights
    float, the others' int8 per output channel; each activation rounded to its int8 grid where an
    int8 layer writes or reads it (:meth:`rounded`), else left as it is.  ``sqnr(kept)``: the logits
    SQNR against float on ``images``."""

    def __init__(self, graph: Graph, amax: dict, unsigned, candidates: list[str], images: np.ndarray):
        self.graph, self.amax, self.unsigned = graph, amax, frozenset(unsigned)
        self.candidates = list(candidates)
        self.images = np.ascontiguousarray(images, np.float32)
        self.batch = int(graph.func.params[0].ty.shape.values[0])
        self.names = list(graph.points.values())
        self._producer = {ly.output: ly for ly in graph.layers}
        mod = self._module()
        self.vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())
        self.reference = self._run([], float_logits=True)
        self.forwards = 0

    def _module(self) -> tvm.IRModule:
        g, func = self.graph, self.graph.func
        index = {var: i for i, var in enumerate(g.points)}
        scales = [relax.Var(f"s{i}", relax.TensorType((), "float32")) for i in range(len(index))]
        levels = [relax.Var(f"l{i}", relax.TensorType((), "float32")) for i in range(len(index))]
        switch = {name: relax.Var(f"k{i}", relax.TensorType((), "float32")) for i, name in enumerate(self.candidates)}
        weighted = {ly.vars[0]: ly for ly in g.layers if ly.name in switch}
        bb = relax.BlockBuilder()
        params = [*func.params, *[v for pair in zip(scales, levels) for v in pair], *switch.values()]
        with bb.function("main", params):
            with bb.dataflow():
                vmap = {p: _fake_quant(bb, p, scales[index[p]], levels[index[p]], p.name)
                        for p in func.params if p in index}
                for b in bindings_of(func):
                    value = substitute(b.value, vmap)
                    ly = weighted.get(b.var)
                    if ly is not None:      # weight = float + k * (int8 - float): k = 1 int8, 0 float
                        w = value.args[1].value.numpy()
                        axis = 0 if ly.kind == "conv2d" else w.ndim - 1
                        dw = relax.const((_int8_weight(w, axis) - w).astype(w.dtype))
                        wk = bb.emit(relax.op.add(value.args[1], relax.op.multiply(switch[ly.name], dw)))
                        value = relax.Call(value.op, [value.args[0], wk, *value.args[2:]], value.attrs, value.ty_args)
                    v = bb.emit(offload_to_torch(value, b.var.ty), name_hint=b.var.name)
                    vmap[b.var] = _fake_quant(bb, v, scales[index[b.var]], levels[index[b.var]], b.var.name) \
                        if b.var in index else v
                out = substitute(func.body.body, vmap)
                if isinstance(out.ty, relax.TupleType):
                    out = bb.emit(relax.TupleGetItem(out, 0))
                out = bb.emit_output(out)
            bb.emit_func_output(out)
        mod = bb.get()
        for gv, f in g.kernels.items():
            mod[gv] = f
        return mod

    def rounded(self, kept) -> set:
        """The points a build with ``kept`` in float rounds: those an int8 layer writes or reads.  A
        candidate is int8 unless kept; a conv / linear layer the plan keeps float anyway is float; any
        other layer (pool, add, concat...) is int8 where it reads an int8 layer's output."""
        int8_layers, int8_out = set(), set()
        for ly in self.graph.layers:
            if ly.kind in ("conv2d", "dense"):
                is_int8 = ly.name in self.candidates and ly.name not in kept
            else:
                is_int8 = any(v in int8_out for v in ly.inputs)
            if is_int8:
                int8_layers.add(ly.name)
                int8_out.add(ly.output)
        readers = self.graph.layer_readers
        return {p for p in self.graph.points
                if p in int8_out or any(r.name in int8_layers for r in readers.get(p, []))}

    def _run(self, kept, float_logits: bool = False) -> np.ndarray:
        rounded = set() if float_logits else self.rounded(kept)
        args = []
        for var, name in self.graph.points.items():
            amax = max(float(self.amax[name]), 1e-30)
            if var in rounded:
                grid = 255.0 if name in self.unsigned else 127.0
                scale = amax / grid
            else:
                grid, scale = FINE, amax * 1e-4
            args += [np.array(scale, np.float32), np.array(grid, np.float32)]
        args += [np.array(0.0 if float_logits or n in kept else 1.0, np.float32) for n in self.candidates]
        args = [tvm.runtime.tensor(a, tvm.cpu()) for a in args]
        out = [self.vm["main"](tvm.runtime.tensor(x, tvm.cpu()), *args).numpy()[:n]
               for n, x in static_batches(self.images, self.batch)]
        return np.concatenate(out).reshape(len(self.images), -1)

    def sqnr(self, kept) -> float:
        self.forwards += 1
        return float(sqnr_db(self.reference, self._run(frozenset(kept))))

    def needed_for(self, point) -> frozenset:
        """The candidates that must be float for the activation ``point`` to be left unrounded: its
        writer and its readers, and for one that is no conv / linear layer (a pool, a residual add:
        int8 where any input is an int8 layer's output) the same for each of its inputs."""
        need: set = set()
        seen: set = set()

        def float_layer(ly):
            if ly.name in seen:
                return
            seen.add(ly.name)
            if ly.kind in ("conv2d", "dense"):
                if ly.name in self.candidates:
                    need.add(ly.name)
                return
            for v in ly.inputs:
                if v in self._producer:
                    float_layer(self._producer[v])
        if point in self._producer:
            float_layer(self._producer[point])
        for reader in self.graph.layer_readers.get(point, []):
            float_layer(reader)
        return frozenset(need)

    def moves(self) -> set:
        """Every candidate alone, and every point's :meth:`needed_for`."""
        out = {frozenset({n}) for n in self.candidates}
        out |= {m for m in (self.needed_for(p) for p in self.graph.points) if m}
        return out

    def neighbours(self, name: str) -> set[str]:
        """The candidates that share a tensor with ``name``: its inputs' producers, its output's readers."""
        ly = next(layer for layer in self.graph.layers if layer.name == name)
        near = {self._producer[v].name for v in ly.inputs if v in self._producer}
        near |= {r.name for r in self.graph.layer_readers.get(ly.output, [])}
        return near & set(self.candidates)


def choose(sim: LayerSim, goal_db: float, kept: list | None = None, progress=None) -> list[tuple[tuple, float]]:
    """Steps of layers to keep float, in the order chosen, each ``(layers, simulated SQNR it
    bought)``, until ``sim.sqnr`` reaches ``goal_db`` or every candidate is kept.

    A step is one of the *moves*: a layer alone (its weights float), or the layers a tensor needs
    float to be left unrounded (:meth:`LayerSim.needed_for`: its writer and readers, and behind a
    pool or a residual add every layer whose output reaches it).  Greedy on the gain per layer
    added, lazily: a move's last measured value stands until it reaches the top again, except for
    the moves near the layers just kept (measured again).  ``kept``: steps already chosen."""
    chosen = list(kept or [])
    names = {n for layers, _ in chosen for n in layers}
    current = sim.sqnr(names)
    moves = sim.moves()
    value = {m: math.inf for m in moves if not m <= names}
    gains: dict = {}
    fresh: set = set()
    while current < goal_db and value:
        while True:
            best = max(value, key=value.get)
            if best in fresh:
                break
            gains[best] = sim.sqnr(names | best) - current
            value[best] = gains[best] / len(best - names)
            fresh.add(best)
        added = best - names
        chosen.append((tuple(sorted(added)), round(gains[best], 2)))
        names |= added
        current += gains[best]
        near = set(added).union(*(sim.neighbours(n) for n in added))
        value = {m: (math.inf if m & near else v) for m, v in value.items() if not m <= names}
        fresh = {m for m in fresh if m in value and not m & near}
        if progress:
            progress(f"kept {', '.join(sorted(added))} in float: simulated {current:.1f} dB")
    return chosen


def reach(s, target: AccuracyTarget, judge: Judge, rebuild, progress=print) -> tuple[object, dict]:
    """From the all-int8 build ``s`` (a finished ``pipeline.BuildState``), the build that reaches
    ``target`` on ``judge``'s images with the fewest layers kept float (``rebuild(skip, reasons)``
    runs the pipeline again with those layers skipped), and the report's ``mixed_precision`` entry.
    Where even every candidate kept float does not reach it, the closest build, ``reached`` False."""
    t0 = time.time()
    first = judge.score(s)
    report = dict(target=target.describe(), metric=target.metric, value=target.value, images=len(judge.images),
                  images_from=judge.where, all_int8=first, kept=[], builds=[])
    if target.reached(first):
        return s, dict(report, reached=True, final=first, seconds=round(time.time() - t0, 1))
    candidates = [lp.layer.name for lp in s.plan.layers if lp.int8 and lp.layer.kind in ("conv2d", "dense")]
    g1 = s.exported.at(1).graph
    images = s.context.images[:SIM_IMAGES]
    sim = LayerSim(g1, s.amax, s.plan.unsigned, candidates, images)
    start = sim.sqnr(frozenset())
    # the simulation's goal: for SQNR the target (held out) plus a margin; for top-1, a step above
    # where it is, raised until the library agrees
    goal = target.value + MARGIN_DB if target.metric == "sqnr_db" else start + 3.0
    chosen: list = []
    best_state, best_score = s, first
    for _ in range(ROUNDS):
        chosen = choose(sim, goal, chosen)
        names = [n for layers, _ in chosen for n in layers]
        if not names:
            break
        reasons = {n: f"kept in float for the accuracy target (step {k + 1}: +{gain:.1f} dB simulated)"
                   for k, (layers, gain) in enumerate(chosen) for n in layers}
        progress(f"accuracy target: rebuild with {len(names)} of {len(candidates)} layers kept in float "
                 f"(simulated {sim.sqnr(frozenset(names)):.1f} dB)")
        state = rebuild(names, reasons)
        score = judge.score(state)
        report["builds"].append(dict(kept=len(names), **score))
        progress(f"accuracy target: {len(names)} kept -> {target.describe()}? " + (
            f"{score[target.metric]:g}" + (" dB" if target.metric == "sqnr_db" else " %")))
        if score[target.metric] > best_score[target.metric] or (target.reached(score) and not
                                                                 target.reached(best_score)):
            best_state, best_score = state, score
            report["kept"] = [dict(layers=list(layers), simulated_gain_db=gain) for layers, gain in chosen]
        if target.reached(score) or len(names) == len(candidates):
            break
        short = target.value - score[target.metric] if target.metric == "sqnr_db" else 3.0
        goal = max(goal, sim.sqnr(frozenset(names))) + short + MARGIN_DB
    report.update(reached=target.reached(best_score), final=best_score, candidates=len(candidates),
                  simulated_start_db=round(start, 2), simulation_forwards=sim.forwards,
                  seconds=round(time.time() - t0, 1))
    return best_state, report


def judge_images(s, data: str | None, labels: str | None):
    """The images the target is measured on: ``data`` (a folder, read as ``eval --data`` reads it,
    at the build's size), else the calibration's held-out images."""
    if data is not None:
        found = labelled_images(data, labels)
        x, _ = read_batch(found, 0, len(found.paths), int(s.input_shape[2]))
        return x, data
    held = s.context.held_out if s.context is not None else None
    return held, "the calibration source's held-out images"
