"""Float32 decisions of the training kernels taken on the values' bits, not float compares: TVM
compiles CUDA with --use_fast_math, under which a float compare or max flushes subnormals to zero
(``max.ftz.f32``) and a max drops NaN.  Shared by ``elementwise``'s computes and the written
kernels (``dequantize_amax``, ``relu_bits_amax``), so the two agree bit for bit.
"""
from __future__ import annotations

from tvm import tirx

ABS_BITS = 0x7FFFFFFF   # a float32's bits without the sign: |v|'s, ordered as |v| is, NaN above inf


def abs_bits(v):
    """``|v|``'s bits as an int32: the ranges' maxima are taken over these (``amax``), exactly, where
    a float max under --use_fast_math would flush subnormals (``max.ftz.f32``) and drop NaN."""
    return tirx.reinterpret("int32", v) & tirx.const(ABS_BITS, "int32")


def relu_passes(v):
    """ReLU's backward passes the gradient at ``v`` (``threshold_backward``: not ``v <= 0``, so NaN
    passes): from ``v``'s bits, exact for subnormals, which a float compare under --use_fast_math
    flushes to zero."""
    return tirx.any(tirx.isnan(v), tirx.reinterpret("int32", v) > 0)


def relu_value(x):
    """torch's ``relu(x)``: NaN kept, ``x`` where it is positive (subnormals too), else +0."""
    return tirx.if_then_else(relu_passes(x), x, tirx.const(0.0, "float32"))
