"""float -> int8 rounding shared by every quantizing kernel (the layout boundary kernels, the
dense layer's input): ``clamp(nearbyint(x / s), lo, hi)``.

Rounding is ``nearbyint(x / s)``: to nearest, ties to even, as the training path's
``torch.round`` (``tvm_qconv.nn.functional.quantize_per_tensor``) and ``np.rint`` round, so a
tie such as digits' pixel level 4/16 (``x / s = -63.5``) gives the QAT model's integer (-64).
TVM lowers ``nearbyint`` to ``llvm.nearbyint`` (x86 ``vroundps``/``vrndscaleps $12`` with an
mcpu, libm ``nearbyintf`` without: the MXCSR mode, half to even unless a program changes it)
and to CUDA's ``nearbyintf`` (``cvt.rni``: always half to even); ``tirx.round``
lowers the same way in TVM 0.27, but its docstring still promises ``llvm.round`` (ties away from
zero), so the kernel names the rounding it means.

``x / s`` must be the IEEE float32 quotient PyTorch computes, on every target: a value that lands
on a tie goes to the other integer if the quotient is one ulp off.  So it is a true division, not
``x * (1 / s)`` (rounded twice), and not a float32 ``/`` either: TVM compiles CUDA with
``--use_fast_math``, which makes that ``div.approx.ftz.f32`` (up to 2 ulp off).  The kernels
divide in float64 (always IEEE on CUDA: ``div.rn.f64``) and round to float32, which is exactly
the float32 quotient (53 >= 2 * 24 + 2 bits: no double-rounding error for a quotient).  The
divisor is written ``M * 2**e`` with ``M`` a 24-bit integer, ``x / s = (x / M) * 2**-e``
(power-of-two scaling is exact), because TVM's CUDA codegen prints a float64 constant with 15
decimals (``float32(1 / 127)`` becomes ``0.007874015718699``, ``2**-100`` becomes 0) and
integers print exactly.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx

from .requantize import QMIN, UNSIGNED_ZERO


def _div_exact(x, scale: float):
    """float32 ``x / scale`` (``scale`` rounded to float32), IEEE on llvm and on CUDA under fast math."""
    frac, exp = np.frexp(np.float32(scale))  # scale = frac * 2**exp, frac in [0.5, 1)
    m, e = int(frac * (1 << 24)), int(exp) - 24  # scale = m * 2**e, m < 2**24: both print exactly
    q = x.astype("float64") / tirx.const(m, "float64")
    q = q * tirx.const(2.0 ** -e, "float64") if e <= 0 else q / tirx.const(2.0 ** e, "float64")
    return q.astype("float32")


def dequantize_tir(q, scale: float, zero: int = 0):
    """TIR: int8 ``q`` -> float32 ``(q - zero) * float32(scale)``, rounded once, on llvm and CUDA alike
    (``zero``: the tensor's zero point, -128 for an unsigned one; ``q - zero`` is an exact integer).

    The scale is written ``m * 2**e`` (``m`` a 24-bit integer) and applied in float64, where
    ``q * m`` (at most 32 bits) and the division by ``2**-e`` are exact, so the one rounding is
    the cast to float32: the float32 product, bit for bit.  A float32 constant would be printed
    by TVM's CUDA codegen with 15 decimals, which keeps few digits of a scale of 1e-9 and none
    of 1e-16 (the activations of deep random-init networks get such scales).
    """
    frac, exp = np.frexp(np.float32(scale))
    m, e = int(frac * (1 << 24)), int(exp) - 24
    v = (q.astype("float64") if zero == 0 else q.astype("float64") - tirx.const(zero, "float64")) * tirx.const(m, "float64")
    v = v / tirx.const(2.0 ** -e, "float64") if e < 0 else v * tirx.const(2.0 ** e, "float64")
    return v.astype("float32")


def quantize_clamp(zero: int) -> tuple[int, int, int]:
    """``(lo, hi, zero)`` of a tensor of zero point ``zero``: symmetric int8 ``(-127, 127, 0)``, or
    unsigned ``(-128, 127, -128)`` (0..255 at the same scale, stored minus 128)."""
    if zero not in (0, UNSIGNED_ZERO):
        raise ValueError(f"zero point must be 0 (symmetric) or {UNSIGNED_ZERO} (unsigned), got {zero}")
    return (QMIN, 127, 0) if zero == 0 else (-128, 127, zero)


def quantize_tir(x, scale: float, lo: int = QMIN, hi: int = 127, zero: int = 0):
    """TIR expression: float ``x`` -> int8 ``clamp(nearbyint(x / scale) + zero, lo, hi)``."""
    v = tirx.nearbyint(_div_exact(x, scale))  # ties to even (module docstring)
    if zero:
        v = v + tirx.const(zero, "float32")
    return tirx.max(tirx.min(v, tirx.const(hi, "float32")), tirx.const(lo, "float32")).astype("int8")


def quantize_ref(x: np.ndarray, scale: float, lo: int = QMIN, hi: int = 127, zero: int = 0) -> np.ndarray:
    """NumPy twin of :func:`quantize_tir`: float32 division, round half to even."""
    v = np.rint(x.astype(np.float32) / np.float32(scale)) + np.float32(zero)
    return np.clip(v, lo, hi).astype(np.int8)
