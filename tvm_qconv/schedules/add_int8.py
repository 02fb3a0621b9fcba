"""int8 residual add with rescaling, elementwise, so in any layout (both inputs in the same one): ``out = requant(a * s_a + b * s_b) / s_out`` (+ReLU / clip),
computed as ``(a * mult_a + b * mult_b) >> shift`` with one shared shift, integer-only like the
conv epilogue (``requantize.py``).  An unsigned input (zero point -128) enters as ``q + 128``
(up to 255), an unsigned output leaves as the rounded value ``- 128``.

In 32 bits where that is exact (:func:`split_multipliers`): with ``mult = hi * 2**k + lo``,

    floor((a*mult_a + b*mult_b + 2**(shift-1)) / 2**shift)
      = floor((a*hi_a + b*hi_b + 2**(shift-1-k) + floor((a*lo_a + b*lo_b) / 2**k)) / 2**(shift-k))

(``X = H * 2**k + L`` and ``floor(floor(X / p) / q) = floor(X / (p*q))``), every term an int32 when
``k`` is chosen so: about half the instructions of the int64 form (the CUDA add ran at 2.2 TB/s
with it, issue-bound), and the same integers on every target."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .requantize import QMIN, requantize_ref, requantize_tir


def add_int8(shape, mult_a: int, mult_b: int, shift: int, act_min: int = QMIN, act_max: int = 127,
             name: str = "add_int8", zeros: tuple[int, int, int] = (0, 0, 0)) -> tirx.PrimFunc:
    """``clamp(((a - z_a) * mult_a + (b - z_b) * mult_b) >> shift + z_out, act_min, act_max)``
    (ReLU: ``act_min = 0``, or -128 at an unsigned output); ``zeros = (z_a, z_b, z_out)``: the
    zero points, 0 or -128 (``zero_points.py``)."""
    a = te.placeholder(shape, "int8", name="A")
    b = te.placeholder(shape, "int8", name="B")
    z_a, z_b, z_out = zeros
    split = split_multipliers(mult_a, mult_b, shift, span=256 if z_a or z_b else 128)

    def centred(t, dtype, z):   # q - z: the integer of the real value (-127..255)
        return t.astype(dtype) if z == 0 else t.astype(dtype) - tirx.const(z, dtype)

    def body(*i):
        if split is not None:
            k, hi_a, lo_a, hi_b, lo_b = (tirx.const(v, "int32") for v in split)
            x, y = centred(a(*i), "int32", z_a), centred(b(*i), "int32", z_b)
            high = x * hi_a + y * hi_b + tirx.const(1 << (shift - 1 - split[0]), "int32")
            v = tirx.shift_right(high + tirx.shift_right(x * lo_a + y * lo_b, k), tirx.const(shift - split[0], "int32"))
            if z_out:
                v = v + tirx.const(z_out, "int32")
            return tirx.max(tirx.min(v, tirx.const(act_max, "int32")), tirx.const(act_min, "int32")).astype("int8")
        return add_tir(a(*i), b(*i), tirx.const(mult_a, "int64"), tirx.const(mult_b, "int64"),
                       tirx.const(shift, "int32"), act_min, act_max, zeros)

    out = te.compute(shape, body, name="add_requant")
    return te.create_prim_func([a, b, out]).with_attr({"tvm_qconv.kernel": name})


def add_tir(a, b, mult_a, mult_b, shift, act_min: int = QMIN, act_max: int = 127, zeros=(0, 0, 0)):
    """The int64 form of the add on two int8 expressions (integer expressions ``mult_a``, ``mult_b``
    (below 2**32), ``shift``): ``add_int8``'s body where no 32-bit form is exact, and a conv's
    residual epilogue (``epilogue_residual.py``: its multipliers are an argument, not constants)."""
    z_a, z_b, z_out = zeros

    def centred(t, z):   # q - z: the integer of the real value (-127..255)
        return t.astype("int64") if z == 0 else t.astype("int64") - tirx.const(z, "int64")

    v = centred(a, z_a) * mult_a.astype("int64") + centred(b, z_b) * mult_b.astype("int64")
    return requantize_tir(v, tirx.const(1, "int32"), shift, act_min, act_max, zero=z_out)


I32 = 2 ** 31


def split_multipliers(mult_a: int, mult_b: int, shift: int, span: int = 128) -> tuple[int, int, int, int, int] | None:
    """``(k, hi_a, lo_a, hi_b, lo_b)``, ``mult = hi * 2**k + lo``, for which the 32-bit form of the
    module docstring holds for every pair of inputs of magnitude at most ``span`` (128: int8; 256:
    an unsigned input less its zero point, up to 255), or None (the int64 form): ``k`` as large as
    the low products allow (``|a*lo_a + b*lo_b| < 2 * span * 2**k``), so the high terms stay small."""
    k = min(22, shift - 1)
    if k < 1 or min(mult_a, mult_b) < 0:
        return None
    hi_a, lo_a, hi_b, lo_b = mult_a >> k, mult_a & ((1 << k) - 1), mult_b >> k, mult_b & ((1 << k) - 1)
    # the largest magnitude each int32 term reaches over |a|, |b| <= span (an output zero point
    # adds 128 at most: the + 128)
    low = span * (lo_a + lo_b)
    high = span * (hi_a + hi_b) + (1 << (shift - 1 - k)) + (low >> k) + 1 + 128
    return (k, hi_a, lo_a, hi_b, lo_b) if low < I32 and high < I32 else None


def add_int8_ref(a, b, mult_a, mult_b, shift, act_min=QMIN, act_max=127, zeros=(0, 0, 0)) -> np.ndarray:
    v = (a.astype(np.int64) - zeros[0]) * mult_a + (b.astype(np.int64) - zeros[1]) * mult_b
    return requantize_ref(v, np.int64(1), np.int64(shift), act_min, act_max, zero=zeros[2])
