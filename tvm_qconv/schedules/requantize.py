"""Fixed-point requantization shared by every int8 kernel's epilogue.

An int32 accumulator ``acc`` at scale ``s_in`` becomes int8 at scale ``s_out`` by the real
multiplier ``M = s_in / s_out``.  ``M`` is stored as ``mult * 2**-shift`` with ``mult`` a 31-bit
integer (gemmlowp / TFLite style) so that the epilogue is integer-only: the CPU build, the CUDA
build and the NumPy reference below agree bit for bit (a float epilogue would not, because nvcc
contracts ``acc * M + 0.5`` into an FMA and LLVM does not).
"""
from __future__ import annotations

import numpy as np
from tvm import tirx

MULT_BITS = 31  # mult lies in [2**30, 2**31): 31 significant bits of M
# Symmetric int8: activations and weights use [-127, 127] and -128 never occurs, as the
# observers' scales (amax / 127) and the QAT fake-quantizers (``tvm_qconv.nn.functional``) assume,
# so a QAT model compiles to the same integers wherever values clip at the negative end too.
# (An unsigned activation, below, is the exception: there -128 is its real zero.)
QMIN, QMAX = -127, 127
# An unsigned tensor (never negative: after a ReLU / ReLU6) is 0..255 at scale amax / 255, stored
# in int8 as value - 128: zero point -128, the whole int8 range (QuantConfig.unsigned_activations).
UNSIGNED_ZERO = -128


def quantize_multiplier(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split positive real multipliers into (mult int32, shift int32) with M ~= mult * 2**-shift.

    Args:
        m: positive float array (any shape).
    Returns:
        (mult, shift), int32 arrays of m's shape; shift is clipped to [1, 62] so the int64
        product ``acc * mult`` (|acc| < 2**31, mult < 2**31) never overflows.
    """
    m = np.asarray(m, dtype=np.float64)
    if not np.all(np.isfinite(m)) or np.any(m <= 0):
        raise ValueError(f"requantize multipliers must be finite and > 0, got min {m.min()} max {m.max()}")
    frac, exp = np.frexp(m)  # m = frac * 2**exp, frac in [0.5, 1)
    mult = np.round(frac * (1 << MULT_BITS)).astype(np.int64)
    exp = np.where(mult == (1 << MULT_BITS), exp + 1, exp)  # frac rounded up to 1.0
    mult = np.where(mult == (1 << MULT_BITS), 1 << (MULT_BITS - 1), mult)
    shift = MULT_BITS - exp
    if np.any(shift < 1):
        raise ValueError(f"requantize multiplier too large ({m.max():.3g} >= 2**30): scales are inconsistent")
    too_small = shift > 62  # M < 2**-32: every output rounds to 0 anyway
    mult = np.where(too_small, 0, mult)
    shift = np.where(too_small, 62, shift)
    return mult.astype(np.int32), shift.astype(np.int32)


def requantize_tir(acc, mult, shift, lo: int, hi: int = 127, offset=None, zero: int = 0):
    """TIR expression: clip(round_half_up((acc * mult + offset) * 2**-shift) + zero, lo, hi) as int8.

    ``acc`` is an int8, int32 or int64 expression; ``mult`` and ``shift`` int32 expressions;
    ``offset`` (None: 0) an int64 expression added to the product, at its scale ``2**shift``;
    ``zero``: the output's zero point (0, or -128
    for an unsigned output), added after the rounding.
    """
    v = acc.astype("int64") * mult.astype("int64")
    if offset is not None:
        v = v + offset
    s = shift.astype("int64")
    v = tirx.shift_right(v + tirx.shift_left(tirx.const(1, "int64"), s - 1), s)
    if zero:
        v = v + tirx.const(zero, "int64")
    return tirx.max(tirx.min(v, tirx.const(hi, "int64")), tirx.const(lo, "int64")).astype("int8")


def requantize_ref(acc: np.ndarray, mult: np.ndarray, shift: np.ndarray, lo: int, hi: int = 127,
                   offset: np.ndarray | None = None, zero: int = 0) -> np.ndarray:
    """NumPy twin of :func:`requantize_tir` (broadcasting mult/shift/offset against acc)."""
    v = acc.astype(np.int64) * mult.astype(np.int64)
    if offset is not None:
        v = v + offset.astype(np.int64)
    s = shift.astype(np.int64)
    v = ((v + (np.int64(1) << (s - 1))) >> s) + np.int64(zero)
    return np.clip(v, lo, hi).astype(np.int8)


def add_multipliers(s_a: float, s_b: float, s_out: float) -> tuple[int, int, int]:
    """Fixed-point rescale of a residual add ``a * s_a + b * s_b`` to ``s_out``:
    (mult_a, mult_b, shift), both multipliers on the shift of the larger one."""
    m_a, m_b = s_a / s_out, s_b / s_out
    _, shift = quantize_multiplier(np.array([max(m_a, m_b)]))
    shift = int(min(shift[0], 62 - 8))  # |a| <= 255 (an unsigned input less its zero point): a*mult < 2**41
    mult_a, mult_b = (int(round(m * 2.0 ** shift)) for m in (m_a, m_b))
    if max(mult_a, mult_b) >= 2 ** (MULT_BITS + 1):
        raise ValueError(f"add rescale factors {m_a:.3g}, {m_b:.3g} too large: scales are inconsistent")
    return mult_a, mult_b, shift


# The affine kernel's fixed point, all in 32-bit integers: |q_x| <= 128 (an int8 less its zero point folded
# into the bias), |mult| < 2**AFFINE_MULT_BITS, shift <= AFFINE_MAX_SHIFT, |bias| <= AFFINE_MAX_BIAS, so
# q_x * mult + bias + 2**(shift - 1) < 2**22 + 2**30 + 2**21 < 2**31.  A bias clamped to AFFINE_MAX_BIAS
# saturates the output as the true one would: (2**30 - 2**22) / 2**22 > 255 steps.  A 15-bit multiplier
# (in [2**14, 2**15) unless the shift is capped) is off by at most 2**-15 of itself: the product by
# 128 * r * 2**-15 steps for a channel's r = |a| * s_x / s_y (0.008 steps at r = 2), the bias by
# 2**-(shift + 1) -- nothing an 8-bit output can see but a near-tie rounded the other way.
AFFINE_MULT_BITS = 15
AFFINE_MAX_SHIFT = 22
AFFINE_MAX_BIAS = 2 ** 30


def affine_params(a: np.ndarray, b: np.ndarray, s_x: float, s_y: float, z_x: int = 0) -> tuple[np.ndarray, ...]:
    """Fixed-point form of a per-channel affine ``y = a * x + b`` from scale ``s_x`` to ``s_y``:
    (mult, shift, bias), each int32 [C], with ``q_y = (q_x * mult + bias) >> shift`` rounded half up
    (``mult`` signed: a BatchNorm's gamma may be negative; a zero ``a`` gives mult 0).  ``z_x``: the
    input's zero point (``x = s_x * (q_x - z_x)``), ``-z_x * mult`` in the bias: exact.

    Raises:
        ValueError: a multiplier of 2**14 or more (a_c * s_x / s_y): the scales are inconsistent.
    """
    m = np.asarray(a, np.float64) * s_x / s_y
    mag = np.abs(m)
    if (mag >= 2.0 ** (AFFINE_MULT_BITS - 1)).any():
        raise ValueError(f"affine rescale factor {mag.max():.3g} too large: scales are inconsistent")
    # the largest shift that keeps |mult| below 2**15 (mult in [2**14, 2**15)), at most 22
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0))).astype(np.int64)
    shift = np.clip(AFFINE_MULT_BITS - 1 - exp, 1, AFFINE_MAX_SHIFT).astype(np.int64)
    mult = np.rint(m * 2.0 ** shift).astype(np.int64)
    mult = np.clip(mult, -(2 ** AFFINE_MULT_BITS - 1), 2 ** AFFINE_MULT_BITS - 1)
    bias = np.rint(np.asarray(b, np.float64) / s_y * 2.0 ** shift) - np.float64(z_x) * mult
    bias = np.clip(bias, -AFFINE_MAX_BIAS, AFFINE_MAX_BIAS).astype(np.int64)
    return mult.astype(np.int32), shift.astype(np.int32), bias.astype(np.int32)


# ---------------------------------------------------------------- the 32-bit form (CUDA epilogues)
#
# For shift >= 33, the rounding shift of the 64-bit product equals one of its high word:
#     floor((a*m + 2**(s-1)) / 2**s) = floor((floor(a*m / 2**32) + 2**(s-33)) / 2**(s-32))
# because 2**(s-1) is then a multiple of 2**32 and floor(floor(x / p) / q) = floor(x / (p*q)).
# floor(a*m / 2**32) of int32 a and m is CUDA's ``__mulhi`` (one IMAD.HI), so the epilogue runs
# on three 32-bit instructions instead of a 64-bit multiply, add and shift (~3x the issue slots),
# bit-identical.  It holds for |a| < 2**31 and 33 <= s <= 62 (``high + 2**(s-33)`` < 2**31 and a
# 32-bit shift count); shift >= 33 means a multiplier below 1/4, which requantization's
# s_in * s_w / s_out is in practice (VGG16's: ~1e-3) -- a kernel checks it per channel at run
# time (:func:`requantize_i32_ok`) and keeps the 64-bit form where it fails.

I32_MIN_SHIFT = 33
I32_MAX_BIAS = 1 << 30   # |acc| < 2**30 (the kernels assert it of their K) + |bias| <= 2**30 < 2**31


def requantize_i32_ok(bias, shift):
    """TIR bool: a channel of this ``bias`` and ``shift`` may take :func:`requantize_tir_i32`."""
    return tirx.all(I32_MIN_SHIFT <= shift, shift <= 62, -I32_MAX_BIAS <= bias, bias <= I32_MAX_BIAS)


def requantize_tir_i32(acc, bias, mult, shift, lo: int, hi: int = 127):
    """CUDA TIR, int32: ``requantize_tir(acc + bias, mult, shift, lo, hi)`` for an int32 ``acc``
    with ``|acc| < 2**30``, on a channel where :func:`requantize_i32_ok` holds (the derivation
    above)."""
    high = tirx.call_pure_extern("int32", "__mulhi", acc + bias, mult)
    v = tirx.shift_right(high + tirx.shift_left(tirx.const(1, "int32"), shift - I32_MIN_SHIFT), shift - 32)
    # the clamp as CUDA's min / max: TVM 0.27's simplifier, bounding the variable shift above
    # wrongly, deletes a TIR ``min(v, 127)`` here
    return tirx.call_pure_extern("int32", "max", tirx.call_pure_extern("int32", "min", v, tirx.const(hi, "int32")),
                                 tirx.const(lo, "int32"))


def requantize_ref_i32(acc: np.ndarray, mult: np.ndarray, shift: np.ndarray, lo: int, hi: int = 127) -> np.ndarray:
    """NumPy twin of :func:`requantize_tir_i32` (``acc`` = accumulator + bias), int32 arithmetic
    emulated exactly: the tests check it against :func:`requantize_ref`."""
    high = (acc.astype(np.int64) * mult.astype(np.int64)) >> 32                 # __mulhi
    s = shift.astype(np.int64)
    v = ((high + (np.int64(1) << (s - I32_MIN_SHIFT))) >> (s - 32)).astype(np.int32)
    return np.clip(v, lo, hi).astype(np.int8)
