"""int8 -> int8 lookup table in any activation layout: an elementwise function of one int8
tensor (SiLU, hardswish, GELU, sigmoid, or any chain of such ops) as a 256-entry table.

The quantize pass evaluates the float function on the 256 values the input can take,
``f(s_x * q)`` for ``q`` in -128..127, and rounds each result at the output's scale
(``quantization/elementwise.py``, ``lut_table``); the kernel reads one byte and writes one:

    out[i] = table[X[i] + 128]        (padded channels: 0, whatever f(0) is)

What it replaces: a dequantize to float NCHW, the float ops, a quantize back (EfficientNet-B0
at batch 64 on an H100: 2.3 ms of float SiLU / sigmoid-multiply and ~2.3 ms of conversions
around them, docs/history.md).  Bit-exact with that float path wherever the float function
rounds to the same integer, which it does except on a rounding tie.  Memory-bound; on CUDA the
vectorized elementwise schedule (``elementwise_int8.py``), the table read through the cache.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout


def lut_int8(layout: Layout, shape: tuple[int, ...], channels: int) -> tirx.PrimFunc:
    """Kernel: int8 X of packed ``shape`` in ``layout`` with ``channels`` real channels and the
    int8 ``Table`` [256] -> int8 in ``layout`` (padded channels 0)."""
    x = te.placeholder(shape, "int8", name="X")
    table = te.placeholder((256,), "int8", name="Table")

    def body(*index):
        c = layout.to_logical(index)[1]
        return tirx.if_then_else(c < channels, table[x[index].astype("int32") + 128], tirx.const(0, "int8"))

    out = te.compute(shape, body, name="lut")
    return te.create_prim_func([x, table, out]).with_attr({"tvm_qconv.kernel": f"lut_{layout.name.lower()}_int8"})


def lut_int8_ref(layout: Layout, x: np.ndarray, channels: int, table: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`lut_int8`: padded channels come out 0."""
    return layout.pack(np.asarray(table, np.int8)[layout.unpack(x, channels).astype(np.int32) + 128])
