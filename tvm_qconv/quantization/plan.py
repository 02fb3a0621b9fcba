"""The quantization plan: every decision of an int8 build, made once, as data.

A :class:`QuantizationPlan` says, for every layer the analysis found (``graph.py``): int8 or
float and why; the kernel implementation and its workload; the scale, zero point, channel count
and layout of each int8 tensor it reads and writes; and its kernel's arguments after the
activations (packed weights, folded int32 bias, requantize multipliers, lookup table...).  The
backends read it and decide nothing: ``lowering/relax.py`` emits one ``call_tir`` per int8 layer
with the plan's arguments, ``lowering/onnx.py`` writes QuantizeLinear / DequantizeLinear at the
plan's scales.  ``planner.py`` makes it; ``docs/design.md`` says why decisions live here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TensorQuant:
    """An int8 tensor: ``value = (q - zero) * scale``.

    Attributes:
        scale: the step (``scales.activation_scale``: amax / 127, or amax / 255 unsigned).
        zero: 0 (symmetric) or -128 (unsigned: ``zero_points.py``).
        channels: its real channel count (a layout may pad).
        layout: the registry layout its int8 buffer is in (``NCHW4c``, ``NHWC32``); ``rows`` for a
            linear layer's input.
        shape: its int8 buffer's shape (in ``layout``).
    """

    scale: float
    zero: int
    channels: int
    layout: str
    shape: tuple


@dataclass(frozen=True)
class TensorRead:
    """One int8 input of a layer: the float graph's ``var``, read as ``quant``.  The backend makes
    it from whatever exists: the producer's int8 tensor (``quant.layout`` its layout), a relayout
    of it, or a quantize of the float tensor -- at ``quant``'s scale and zero point either way."""

    var: object
    quant: TensorQuant


@dataclass
class LayerPlan:
    """What one layer of the analysis becomes.

    Attributes:
        layer: the analysis's :class:`~tvm_qconv.graph.Layer`.
        why_float: None where the layer runs in int8; else why it stays float (the build
            report's "float (...)").
        impl: the kernel implementation (``registry``), ``workload`` its workload.
        reads: its int8 inputs, in the kernel's argument order (a linear layer's is a float
            tensor quantized into rows: ``TensorRead`` with layout ``rows``).
        float_reads: the float tensors its kernel reads after the int8 ones (a squeeze-excite
            gate), as the float graph's vars.
        output: its int8 output; None where the kernel writes float (a linear layer).
        out_shape, out_dtype: the kernel's output buffer.
        params: the kernel's arguments after the activations, packed as it reads them.
        weight: (conv, linear) the int8 weight ``(qw, s_w)`` per output channel, in the layer's
            own shape (a grouped conv's too, where the kernel runs it block-diagonal), for a
            backend that stores weights unpacked (ONNX).
        bias: (conv, linear) the float bias the layer adds, as the plan decided it (corrected for
            the int8 weights' mean error with ``bias_correction``), before any zero point is folded
            in: what a backend that adds a float bias writes (ONNX); None: the layer adds none.
        gather: (channel gather) the tensor read and the channel index from it, gathers of
            gathers composed.
        writes: the float graph's var its kernel's output stands for where that is not its
            layer's own output: a conv with a table in its epilogue writes the table layer's
            (``epilogues.py``), one with a residual add the add's (``residuals.py``); None:
            ``layer.output``.
        fused_into: the layer whose kernel computes this one (a table or a residual add in a
            conv's epilogue): it has no kernel of its own.
        runs_at: the float graph's var of the layer at whose place its kernel runs, where that is
            not its own: a conv with the residual add in its epilogue runs where the add is
            (``residuals.py``: the other addend may be computed after the conv); None: its own.
        row: the build report's row.
    """

    layer: object
    why_float: str | None = None
    impl: object = None
    workload: object = None
    reads: tuple[TensorRead, ...] = ()
    float_reads: tuple = ()
    output: TensorQuant | None = None
    out_shape: tuple = ()
    out_dtype: str = "int8"
    params: tuple[np.ndarray, ...] = ()
    weight: tuple[np.ndarray, np.ndarray] | None = None
    bias: np.ndarray | None = None
    gather: tuple | None = None
    writes: object = None
    fused_into: str | None = None
    runs_at: object = None
    row: dict = field(default_factory=dict)

    @property
    def int8(self) -> bool:
        return self.why_float is None


@dataclass
class QuantizationPlan:
    """The plan of one build (``planner.plan_quantization``).

    Attributes:
        graph: the float graph's analysis it was made for.
        target: the target it was made for (its kernels', and the conversions' between them).
        layers: one :class:`LayerPlan` per layer, in the analysis's order.
        unsigned: the points stored unsigned (zero point -128), after the fallback.
        unsigned_fallback: points planned unsigned that a conv could not write so (its zero
            point would not fit its bias: ``conv.output_zero_fits``), in the order found.
    """

    graph: object
    target: object
    layers: list[LayerPlan]
    unsigned: list[str]
    unsigned_fallback: list[str]
    _by_output: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_output = {lp.layer.output: lp for lp in self.layers}

    def of(self, layer) -> LayerPlan:
        """The plan of ``layer`` (an analysis ``Layer``)."""
        return self._by_output[layer.output]

    def report(self) -> dict:
        """The plan's part of the build report: one row per layer, the unsigned tensors."""
        return dict(layers=[lp.row for lp in self.layers], unsigned=list(self.unsigned),
                    unsigned_fallback=list(self.unsigned_fallback))
