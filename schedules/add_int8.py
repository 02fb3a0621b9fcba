"""int8 residual add with rescaling, elementwise, so in any layout (both inputs in the same one): ``out = requant(a * s_a + b * s_b) / s_out`` (+ReLU / clip),
computed as ``(a * mult_a + b * mult_b) >> shift`` with one shared shift, integer-only like the
conv epilogue (``requantize.py``)."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .requantize import QMIN, requantize_ref, requantize_tir


def add_int8(shape, mult_a: int, mult_b: int, shift: int, act_min: int = QMIN, act_max: int = 127,
             name: str = "add_int8") -> tirx.PrimFunc:
    """``clamp((a * mult_a + b * mult_b) >> shift, act_min, act_max)`` (ReLU: ``act_min = 0``)."""
    a = te.placeholder(shape, "int8", name="A")
    b = te.placeholder(shape, "int8", name="B")
    one = tirx.const(1, "int32")

    def body(*i):
        v = a(*i).astype("int64") * tirx.const(mult_a, "int64") + b(*i).astype("int64") * tirx.const(mult_b, "int64")
        return requantize_tir(v, one, tirx.const(shift, "int32"), act_min, act_max)

    out = te.compute(shape, body, name="add_requant")
    return te.create_prim_func([a, b, out]).with_attr({"tvm_qconv.kernel": name})


def add_int8_ref(a, b, mult_a, mult_b, shift, act_min=QMIN, act_max=127) -> np.ndarray:
    v = a.astype(np.int64) * mult_a + b.astype(np.int64) * mult_b
    return requantize_ref(v, np.int64(1), np.int64(shift), act_min, act_max)
