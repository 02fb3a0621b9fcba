"""Calibration: run the float model over real images and record the range of every tensor that
will be int8 (the analysis's *points*).

The float graph runs on the Relax VM (llvm) with its conv2d and matmul calls offloaded to torch
(``call_pure_packed`` into functions registered below): unscheduled llvm convs take ~20 s per
224x224 VGG16 image, torch's take well under one, and every other op still runs as Relax
compiled it, so what is measured is the graph that gets quantized.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import tvm
import tvm_ffi
from tvm import relax

from .. import interrupts
from ..config import QuantConfig
from ..data import static_batches
from ..quantization.zero_points import planned_unsigned_names
from ..errors import InputError
from ..graph import Graph
from .observers import make_observer
from ..progress import bar
from ..relax_utils import bindings_of, substitute


@tvm_ffi.register_global_func("tvm_qconv.torch_conv2d", override=True)
def _torch_conv2d(x, w, attrs):
    sh, sw, pt, pl, pb, pr, dh, dw, groups = (int(v) for v in attrs)
    xt = F.pad(torch.from_dlpack(x), (pl, pr, pt, pb))
    y = F.conv2d(xt, torch.from_dlpack(w), stride=(sh, sw), dilation=(dh, dw), groups=groups)
    return tvm.runtime.from_dlpack(y.contiguous())


@tvm_ffi.register_global_func("tvm_qconv.torch_matmul", override=True)
def _torch_matmul(a, b):
    return tvm.runtime.from_dlpack(torch.matmul(torch.from_dlpack(a), torch.from_dlpack(b)).contiguous())


def offload_to_torch(call: relax.Call, ty):
    """``call`` as a call into torch when it is an NCHW conv2d or a matmul (the slow ops of the
    unscheduled llvm float graph), else ``call`` itself."""
    op = getattr(call.op, "name", None) if isinstance(call, relax.Call) else None
    if op == "relax.nn.conv2d" and call.attrs.data_layout == "NCHW" and call.attrs.kernel_layout == "OIHW":
        a = call.attrs
        attrs = relax.ShapeExpr([*map(int, a.strides), *map(int, a.padding), *map(int, a.dilation), int(a.groups)])
        return relax.call_pure_packed("tvm_qconv.torch_conv2d", call.args[0], call.args[1], attrs, ty_args=ty)
    if op == "relax.matmul":
        return relax.call_pure_packed("tvm_qconv.torch_matmul", call.args[0], call.args[1], ty_args=ty)
    return call


def instrument(graph: Graph) -> tuple[tvm.IRModule, list[str]]:
    """A module whose ``main`` returns the calibration points (and nothing else)."""
    func = graph.func
    bb = relax.BlockBuilder()
    points = list(graph.points.items())
    with bb.function("main", list(func.params)):
        with bb.dataflow():
            vmap = {}
            for b in bindings_of(func):
                vmap[b.var] = bb.emit(offload_to_torch(substitute(b.value, vmap), b.var.ty), name_hint=b.var.name)
            out = bb.emit_output(relax.Tuple([vmap.get(v, v) for v, _ in points]))
        bb.emit_func_output(out)
    mod = bb.get()
    for gv, f in graph.kernels.items():     # the call_tir kernels main calls (an ONNX import's)
        mod[gv] = f
    return mod, [name for _, name in points]


class FloatPoints:
    """The float graph, run on llvm (conv / matmul in torch), returning its calibration points.

    ``runner(x)`` takes float32 images (any count) and yields ``(images, {point: float array})``
    per batch of the graph's static batch (the last one padded with repeats, then cut).
    """

    def __init__(self, graph: Graph):
        self.batch = int(graph.func.params[0].ty.shape.values[0])
        mod, self.names = instrument(graph)
        self.vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())

    def __call__(self, images: np.ndarray, progress: bool = False, desc: str = ""):
        total = -(-len(images) // self.batch)
        for n, x in bar(static_batches(images, self.batch), enabled=progress, total=total, desc=desc,
                        unit="batch"):
            interrupts.check()  # the VM call below runs in C++ (a Ctrl-C there is taken here)
            outs = self.vm["main"](tvm.runtime.tensor(x, tvm.cpu()))
            yield n, {name: t.numpy()[:n] for name, t in zip(self.names, outs)}


def calibrate_candidates(graph: Graph, images: np.ndarray, config: QuantConfig, methods: tuple[str, ...],
                         progress: bool = True) -> tuple[dict[str, dict[str, float]], dict[str, np.ndarray],
                                                         dict[str, np.ndarray]]:
    """Every point's range (amax of |x|; the int8 scale is amax / 127, or amax / 255 where the
    build stores the point unsigned, whose grid the observers then weigh) by each observer of
    ``methods``, and every point's mean per channel (axis 1; what bias correction needs), from one
    pass over ``images`` (float32 [N, C, H, W], preprocessed, the model's H and W), and every
    point's max |x| per channel (what equalization needs): ``({point name: {method: amax}}, {point
    name: float64 [channels]}, {point name: float32 [channels]})``."""
    in_shape = tuple(int(d) for d in graph.func.params[0].ty.shape.values)
    if images.ndim != 4 or images.shape[1:] != in_shape[1:]:
        raise InputError(f"calibration images have shape {images.shape[1:]}, the model takes {in_shape[1:]}: "
                         "give images of the model's input size")
    points = FloatPoints(graph)
    unsigned = planned_unsigned_names(graph, config)   # their grid: 255 steps
    observers = {n: {m: make_observer(m, config.percentile, 255 if n in unsigned else 127) for m in methods}
                 for n in points.names}
    sums: dict = {}
    counts: dict = {}
    maxes: dict = {}
    for _, values in points(images[: config.num_calib_images], progress, f"calibrate ({', '.join(methods)})"):
        for name, value in values.items():
            try:
                for observer in observers[name].values():
                    observer.update(value)
            except ValueError as err:
                raise InputError(f"calibration at {name}: {err}; check the images' normalization and the "
                                 "weights (a NaN weight or an image with NaN pixels)") from err
            if value.ndim >= 2:
                axes = tuple(i for i in range(value.ndim) if i != 1)
                sums[name] = sums.get(name, 0.0) + value.sum(axis=axes, dtype=np.float64)
                counts[name] = counts.get(name, 0) + value.size // value.shape[1]
                top = np.abs(value).max(axis=axes)
                maxes[name] = np.maximum(maxes[name], top) if name in maxes else top
    means = {n: sums[n] / counts[n] for n in sums}
    return {n: {m: float(o.amax()) for m, o in obs.items()} for n, obs in observers.items()}, means, maxes
