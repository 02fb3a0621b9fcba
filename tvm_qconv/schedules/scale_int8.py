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
conv, the kernel reads that conv's int8 output ``Q`` (same layout as ``X``) and a 256-entry table ``T``
of the values ``Q`` holds -- the sigmoid as a lookup table, and no float gate, dequantize or sigmoid
kernel between the conv and the scaling (16 of each in EfficientNet-B0: ~35 us of its 0.61 ms at
batch 1 on an H200).  The table holds each gate value already multiplied by the rescale, in fixed
point: ``T[i] = nearbyint(g_i * s_x / s_y * 2**S)``, an int32 below ``2**22`` in magnitude, with one
shift ``S`` (``gate_shift``, 1..30) per kernel, so the scaling is integer arithmetic end to end::

    out = clamp(((X - z_x) * T[Q + 128] + 2**(S - 1)) >> S + z_y)       (|product| < 2**30: int32)

Why not float64 as the float gate: the CUDA kernel was bound by float64 conversions (three per byte
at 16 a clock per SM), not by memory -- EfficientNet-B0's 16 scales took 220 us at batch 64 on an
H200, ~1.35 TB/s (``docs/performance.md``).  ``S`` is the largest that keeps every entry below
``2**22``: the entry's rounding moves an output by at most ``255 / 2**(S + 1)`` of a step.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout


def rescale_parts(k: float) -> tuple[int, int]:
    """``float32(k)`` as ``m * 2**e`` with ``m`` an integer below ``2**24``."""
    frac, exp = np.frexp(np.float32(k))
    return int(frac * (1 << 24)), int(exp) - 24


MULT_BITS = 22     # |T[i]| < 2**22: (X - z_x) * T[i] + 2**(S - 1) stays below 2**31
MAX_SHIFT = 30


def gate_shift(values: np.ndarray, rescale: float) -> int | None:
    """``S`` of the fixed-point gate table of float gate ``values`` (module docstring): the largest
    shift up to 30 that keeps every ``nearbyint(v * rescale * 2**S)`` below ``2**22`` in magnitude;
    None where even ``S = 1`` does not (a gate past ``2**21 / rescale``: keep the float gate)."""
    top = float(np.max(np.abs(np.asarray(values, np.float32).astype(np.float64)))) * rescale
    for s in range(MAX_SHIFT, 0, -1):
        if np.rint(top * 2.0 ** s) < 2 ** MULT_BITS:
            return s
    return None


def gate_multipliers(values: np.ndarray, rescale: float, shift: int) -> np.ndarray:
    """The int32 table ``nearbyint(v * rescale * 2**shift)`` of float gate ``values`` (256 of them)."""
    t = np.rint(np.asarray(values, np.float32).astype(np.float64) * rescale * 2.0 ** shift)
    if t.shape != (256,) or np.abs(t).max(initial=0) >= 2 ** MULT_BITS:
        raise ValueError(f"a gate table is 256 values below 2**{MULT_BITS} after the shift {shift}: got shape "
                         f"{t.shape}, largest {np.abs(t).max(initial=0):.0f}; choose the shift with gate_shift()")
    return t.astype(np.int32)


def scale_int8(layout: Layout, shape: tuple[int, ...], channels: int, rescale: float, in_zero: int = 0,
               out_zero: int = 0, gate_table: bool = False, gate_shift: int = 0) -> tirx.PrimFunc:
    """Kernel: int8 X of packed ``shape`` in ``layout`` (``channels`` real channels) and float32 G
    [N, channels, 1, 1] -> int8 in ``layout``, ``rescale`` = s_x / s_y (module docstring).  With
    ``gate_table``: int8 Q [N, channels, 1, 1] packed in ``layout`` and the int32 fixed-point table T
    [256] (:func:`gate_multipliers` at ``gate_shift``) instead of G."""
    n = layout.logical_shape(shape)[0]
    x = te.placeholder(shape, "int8", name="X")
    lo = -127 if out_zero == 0 else -128
    if gate_table:
        assert 1 <= gate_shift <= MAX_SHIFT, gate_shift
        q = te.placeholder(layout.packed_shape((n, channels, 1, 1)), "int8", name="Q")
        table = te.placeholder((256,), "int32", name="T")

        def fixed_point(*index):
            b, c = layout.to_logical(index)[:2]
            cc = tirx.min(c, channels - 1)   # padded channels read a real one, and write 0
            v = (x[index].astype("int32") - tirx.const(in_zero, "int32")) \
                * table[q[layout.to_packed(b, cc, 0, 0)].astype("int32") + 128]
            v = tirx.shift_right(v + tirx.const(1 << (gate_shift - 1), "int32"), tirx.const(gate_shift, "int32"))
            v = tirx.max(tirx.min(v + tirx.const(out_zero, "int32"), 127), lo).astype("int8")
            return tirx.if_then_else(c < channels, v, tirx.const(0, "int8"))

        out = te.compute(shape, fixed_point, name="scale")
        return te.create_prim_func([x, q, table, out]).with_attr(
            {"tvm_qconv.kernel": f"scale_{layout.name.lower()}_int8"})
    g = te.placeholder((n, channels, 1, 1), "float32", name="G")
    m, e = rescale_parts(rescale)

    def body(*index):
        b, c = layout.to_logical(index)[:2]
        cc = tirx.min(c, channels - 1)   # padded channels read a real one, and write 0
        v = (x[index].astype("float64") - tirx.const(in_zero, "float64")) * g[b, cc, 0, 0].astype("float64")
        v = v * tirx.const(m, "float64")
        v = v * tirx.const(2.0 ** e, "float64") if e >= 0 else v / tirx.const(2.0 ** -e, "float64")
        q = tirx.nearbyint(v) + tirx.const(out_zero, "float64")
        q = tirx.max(tirx.min(q, tirx.const(127, "float64")), tirx.const(lo, "float64")).astype("int8")
        return tirx.if_then_else(c < channels, q, tirx.const(0, "int8"))

    out = te.compute(shape, body, name="scale")
    return te.create_prim_func([x, g, out]).with_attr({"tvm_qconv.kernel": f"scale_{layout.name.lower()}_int8"})


def scale_int8_ref(layout: Layout, x: np.ndarray, gate: np.ndarray, channels: int, rescale: float,
                   in_zero: int = 0, out_zero: int = 0, table: np.ndarray | None = None,
                   gate_shift: int = 0) -> np.ndarray:
    """NumPy twin of :func:`scale_int8`; with ``table`` (the int32 fixed-point table at ``gate_shift``),
    ``gate`` is the packed int8 Q."""
    lo = -127 if out_zero == 0 else -128
    xs = layout.unpack(x, channels).astype(np.int64) - in_zero
    if table is not None:
        mult = np.asarray(table, np.int64)[layout.unpack(gate, channels).astype(np.int64) + 128]
        q = ((xs * mult + (1 << (gate_shift - 1))) >> gate_shift) + out_zero
        return layout.pack(np.clip(q, lo, 127).astype(np.int8))
    m, e = rescale_parts(rescale)
    v = xs.astype(np.float64) * np.asarray(gate, np.float32).astype(np.float64)
    v = (v * m) * 2.0 ** e
    q = np.clip(np.rint(v) + out_zero, lo, 127)
    return layout.pack(q.astype(np.int8))
