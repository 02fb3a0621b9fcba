"""The 256-entry table of a ``lut`` layer (``graph.py``): its elementwise region evaluated on every
value its int8 input can hold, rounded at its output's scale.

    table[q + 128] = quantize(f(dequantize(q, s_x)), s_y)      q in -128..127

``f`` is the region's chain of Relax ops (``elementwise_ops.OPS``) replayed in NumPy on a vector of the 256 dequantized
values (float64, then rounded to float32 as the float path's result would be), with the
project's own dequantize / quantize rounding (``schedules/quantize.py``), so the table is the
float path -- dequantize, the ops, quantize -- tabulated: the two agree on every input except
where ``f`` lands on a rounding tie and float32 on the GPU rounds the other way.
"""
from __future__ import annotations

import numpy as np

from .elementwise_ops import OPS
from .errors import InputError
from .graph import Layer, scalar_value
from .schedules.quantize import quantize_ref
from .schedules.requantize import QMIN

def dequantized_inputs(s_x: float, z_x: int = 0) -> np.ndarray:
    """The 256 float32 values an int8 tensor of scale ``s_x`` and zero point ``z_x`` holds, for
    q = -128..127 (the dequantize kernel's one rounding: the float32 product)."""
    return ((np.arange(-128, 128, dtype=np.float64) - z_x) * float(np.float32(s_x))).astype(np.float32)


def evaluate(layer: Layer, value: dict, x: np.ndarray) -> np.ndarray:
    """The region of ``layer`` applied to ``x`` (its input's values), in float64.

    Args:
        value: ``{var: bound expression}`` of the float graph.
    """
    env = {layer.inputs[0]: x.astype(np.float64)}

    def operand(a):
        number = scalar_value(a)
        return env[a] if number is None else number

    for v in layer.vars:
        call = value[v]
        op = OPS.get(call.op.name)     # the one table of these ops (elementwise_ops.py)
        if op is None:
            raise InputError(f"{layer.name}: no table form for {call.op.name}; add it to tvm_qconv/elementwise_ops.py "
                             "or skip the layer")
        env[v] = op.numpy(*(operand(a) for a in call.args[:op.operands]))
    return env[layer.output]


def lut_table(layer: Layer, value: dict, s_x: float, s_y: float, z_x: int = 0) -> np.ndarray:
    """int8 [256]: entry ``q + 128`` is the output integer for input integer ``q`` (of zero point ``z_x``)."""
    y = evaluate(layer, value, dequantized_inputs(s_x, z_x))
    return quantize_ref(y.astype(np.float32), s_y, QMIN, 127)
