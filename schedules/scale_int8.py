"""int8 -> int8 channel scaling in any activation layout: ``y = x * g[n, c]`` with a float factor per
(image, channel) computed at run time -- squeeze-excite's gated multiply (EfficientNet, MobileNet-V3,
RegNet-Y), fused into one pass over the feature map.

    out = clamp(nearbyint((X - z_x) * G[n, c] * s_x / s_y) + z_y)       (padded channels: 0)

What it replaces: the int8 feature map dequantized to float NCHW, a float multiply, and a quantize
back (three passes over the map and a float copy of it: EfficientNet-B0 at batch 64 on an H100
spent ~2 ms in these, ``docs/history.md``).  The gate ``G`` [N, C, 1, 1] stays float: it is computed
from a global mean by two small linear layers, a few KB per image.

Exact on every target: ``(X - z_x) * G`` is a float64 product of a 9-bit integer and a float32 (exact),
the rescale ``s_x / s_y`` is applied as ``m * 2**e`` (``m`` a 24-bit integer, so TVM's CUDA codegen
prints it exactly), rounded once in float64 (IEEE on CUDA under fast math too), and rounded to an
integer half to even: the CPU and CUDA kernels agree bit for bit, and the NumPy twin with them.

The gate in int8 (``gate_table``): where the gate is a sigmoid or hard-sigmoid of the block's second
conv, the kernel reads that conv's int8 output ``Q`` (same layout as ``X``) and a 256-entry float32
table ``T`` of the gate function on the values ``Q`` holds, ``G[n, c] = T[Q[n, c] + 128]`` -- the
sigmoid as a lookup table, and no float gate, dequantize or sigmoid kernel between the conv and the
scaling (16 of each in EfficientNet-B0: ~35 us of its 0.61 ms at batch 1 on an H200).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout


def rescale_parts(k: float) -> tuple[int, int]:
    """``float32(k)`` as ``m * 2**e`` with ``m`` an integer below ``2**24``."""
    frac, exp = np.frexp(np.float32(k))
    return int(frac * (1 << 24)), int(exp) - 24


def scale_int8(layout: Layout, shape: tuple[int, ...], channels: int, rescale: float, in_zero: int = 0,
               out_zero: int = 0, gate_table: bool = False) -> tirx.PrimFunc:
    """Kernel: int8 X of packed ``shape`` in ``layout`` (``channels`` real channels) and float32 G
    [N, channels, 1, 1] -> int8 in ``layout``, ``rescale`` = s_x / s_y (module docstring).  With
    ``gate_table``: int8 Q [N, channels, 1, 1] packed in ``layout`` and float32 T [256] instead of G."""
    n = layout.logical_shape(shape)[0]
    x = te.placeholder(shape, "int8", name="X")
    if gate_table:
        q = te.placeholder(layout.packed_shape((n, channels, 1, 1)), "int8", name="Q")
        table = te.placeholder((256,), "float32", name="T")

        def gate(b, c):
            return table[q[layout.to_packed(b, c, 0, 0)].astype("int32") + 128]
        inputs = [x, q, table]
    else:
        g = te.placeholder((n, channels, 1, 1), "float32", name="G")

        def gate(b, c):
            return g[b, c, 0, 0]
        inputs = [x, g]
    m, e = rescale_parts(rescale)
    lo = -127 if out_zero == 0 else -128

    def body(*index):
        b, c = layout.to_logical(index)[:2]
        cc = tirx.min(c, channels - 1)   # padded channels read a real one, and write 0
        v = (x[index].astype("float64") - tirx.const(in_zero, "float64")) * gate(b, cc).astype("float64")
        v = v * tirx.const(m, "float64")
        v = v * tirx.const(2.0 ** e, "float64") if e >= 0 else v / tirx.const(2.0 ** -e, "float64")
        q = tirx.nearbyint(v) + tirx.const(out_zero, "float64")
        q = tirx.max(tirx.min(q, tirx.const(127, "float64")), tirx.const(lo, "float64")).astype("int8")
        return tirx.if_then_else(c < channels, q, tirx.const(0, "int8"))

    out = te.compute(shape, body, name="scale")
    return te.create_prim_func([*inputs, out]).with_attr({"tvm_qconv.kernel": f"scale_{layout.name.lower()}_int8"})


def scale_int8_ref(layout: Layout, x: np.ndarray, gate: np.ndarray, channels: int, rescale: float,
                   in_zero: int = 0, out_zero: int = 0, table: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`scale_int8`; with ``table``, ``gate`` is the packed int8 Q."""
    m, e = rescale_parts(rescale)
    if table is not None:
        gate = np.asarray(table, np.float32)[layout.unpack(gate, channels).astype(np.int64) + 128]
    v = (layout.unpack(x, channels).astype(np.float64) - in_zero) * np.asarray(gate, np.float32).astype(np.float64)
    v = (v * m) * 2.0 ** e
    q = np.clip(np.rint(v) + out_zero, -127 if out_zero == 0 else -128, 127)
    return layout.pack(q.astype(np.int8))
