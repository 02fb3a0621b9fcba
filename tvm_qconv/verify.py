"""The build's own check: does the compiled int8 model agree with the float model?

A compiler that returns wrong numbers without an error is the worst outcome for a user, so
``compile_model`` runs the library it just compiled on a few calibration images, compares its
logits with the float PyTorch model's (SQNR), and records the result in the build report.  Under
``FLOOR_DB`` it builds a debugging twin that returns every int8 activation and names the first
layer whose activations diverge from the float graph's, which ``deploy.py build`` prints loudly;
under an accuracy target (``BuildOptions.accuracy_target_db``) the same twin ranks the layers by
the SQNR each loses (:func:`losses`).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from . import registry
from .ranges.calibrate import FloatPoints
from .data import static_batches
from .evaluate import sqnr_db
from .graph import Graph
from .runtime.compiled_model import flatten
from .target import arch_runs_on, device_arch

# int8 per-tensor activations through a deep network lose 20-40 dB against float (random-init
# torchvision models: 21-39 dB at 64 px); every fault seen so far gave 0-3 dB.  Under 15 dB the
# logits are mostly quantization noise.
FLOOR_DB = 15.0
IMAGES = 4  # calibration images the check runs


def cannot_run(target: tvm.target.Target) -> str | None:
    """Why this machine cannot run a library built for ``target`` (None: it can)."""
    if target.kind.name != "cuda":
        return None
    have = device_arch()
    if have is None:
        return "this machine cannot run a CUDA library (no GPU)"
    want = str(target.attrs.get("arch", ""))
    if not arch_runs_on(want, have):
        return f"the library is built for {want}, this machine's GPU is {have}"
    return None


def run_batches(ex, params: list, target: tvm.target.Target, batch: int, images: np.ndarray) -> list[list]:
    """Every output of ``ex``'s main, per batch of ``batch`` images (the last padded with repeats,
    outputs cut back to the real images)."""
    dev = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(a, dev) for _, a in params]
    results = []
    for n, x in static_batches(images, batch):
        outs = flatten(vm["main"](tvm.runtime.tensor(x, dev), *args))
        results.append([o[:n] if o.ndim and o.shape[0] == batch else o for o in outs])
    return results


def logits_sqnr(ex, params: list, target, batch: int, model, images: np.ndarray) -> tuple[float, np.ndarray]:
    """SQNR (dB) of the compiled logits against the float model's (``model``: a
    ``frontend.Frontend``) on ``images``, and the float model's logits (for :func:`input_blind`)."""
    got = np.concatenate([outs[0] for outs in run_batches(ex, params, target, batch, images)])
    ref = model.reference(images)
    return sqnr_db(ref, got), ref


# Float logits that vary across images by less than this, relative to their size, do not depend on
# the input (a random-init GoogLeNet at 64 px gives every photo the same logits): agreeing with
# them proves nothing.  Real differences between photos are of the order of the logits themselves;
# float32 rounding of one computation run twice is ~1e-7.
INPUT_BLIND_REL = 1e-4


def input_blind(ref: np.ndarray) -> bool:
    """Whether the float model's logits ``ref`` ([images, classes]) are the same for every image
    (or all zero): then a logits SQNR against them cannot judge the int8 library."""
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    size = np.sqrt(np.mean(ref ** 2))
    if size == 0:
        return True
    return len(ref) > 1 and float(np.max(np.abs(ref - ref[:1]))) <= INPUT_BLIND_REL * size


def layer_sqnr(ex, params: list, target, exposed: list[dict], graph: Graph, images: np.ndarray) -> list[dict]:
    """Per int8 layer, in graph order: the SQNR (dB) of its dequantized int8 output against the
    float graph's tensor at the same point, over ``images``.

    Args:
        ex, params: a build with ``expose_activations`` at batch ``graph``'s.
        exposed: its report's ``exposed`` (layer, layout, channels, scale, zero point per activation).
        graph: the float graph's analysis at that batch.
    """
    batch = int(graph.func.params[0].ty.shape.values[0])
    runs = run_batches(ex, params, target, batch, images)
    signal = np.zeros(len(exposed))
    noise = np.zeros(len(exposed))
    for outs, (_, floats) in zip(runs, FloatPoints(graph)(images)):
        for i, (e, q) in enumerate(zip(exposed, outs[1:])):
            if e["point"] is None:  # a max-pool's output: no tensor of its own in the float graph
                continue
            ref = floats[e["point"]].astype(np.float64)
            got = (registry.layout(e["layout"]).unpack(q, e["channels"]).astype(np.float64) - e.get("zero", 0)) \
                * e["scale"]
            signal[i] += (ref ** 2).sum()
            noise[i] += ((got - ref) ** 2).sum()
    return [dict(layer=e["layer"], sqnr_db=_db(s, n), signal=float(s), noise=float(n))
            for e, s, n in zip(exposed, signal, noise) if e["point"] is not None]


def _db(signal: float, noise: float) -> float:
    return float("inf") if noise == 0 else float("-inf") if signal == 0 else float(10 * np.log10(signal / noise))


def losses(layers: list[dict], exposed: list[dict]) -> list[dict]:
    """What each int8 layer loses: the SQNR of its int8 inputs minus its output's, in dB.

    A layer of several inputs (a concat, a residual add) is counted from their SQNR together,
    ``10 log10(sum of signals / sum of noises)``: a concat of a 30 dB and a 20 dB input of equal
    power starts at ~22.6 dB, and only what it adds beyond that is its loss (exact for a concat,
    near it for an add of uncorrelated noises).

    Args:
        layers: :func:`layer_sqnr`'s rows (``signal`` and ``noise``: sums of squares).
        exposed: the report's ``exposed``, whose ``inputs`` name each layer's producers; a
            producer with no float tensor of its own passes its inputs' on.
    Returns:
        One row per layer of ``layers``: ``layer``, ``sqnr_db``, ``input_db`` and ``loss_db``,
        the largest loss first.  A layer that reads no measured int8 layer (the first conv reads
        the image; others read float ops) has ``input_db`` and ``loss_db`` None, last; so has a
        layer where either figure is not finite (an exact or an all-zero tensor).
    """
    energy = {ly["layer"]: (ly["signal"], ly["noise"]) for ly in layers}
    inputs = {e["layer"]: e.get("inputs", []) for e in exposed}

    def input_energy(name: str, depth: int = 0) -> tuple[float, float] | None:
        found = []
        for i in inputs.get(name, []):
            e = energy.get(i)
            if e is None and depth < 32:  # e.g. a max-pool without a consumer's point
                e = input_energy(i, depth + 1)
            if e is not None:
                found.append(e)
        return (sum(s for s, _ in found), sum(n for _, n in found)) if found else None

    rows = []
    for ly in layers:
        inp = input_energy(ly["layer"])
        inp_db = None if inp is None else _db(*inp)
        finite = inp_db is not None and np.isfinite(inp_db) and np.isfinite(ly["sqnr_db"])
        rows.append(dict(layer=ly["layer"], sqnr_db=ly["sqnr_db"] if not np.isfinite(ly["sqnr_db"]) else round(ly["sqnr_db"], 2),
                         input_db=round(inp_db, 2) if finite else None,
                         loss_db=round(max(inp_db - ly["sqnr_db"], 0.0), 2) if finite else None))
    return sorted(rows, key=lambda r: (r["loss_db"] is None, -(r["loss_db"] or 0.0)))
