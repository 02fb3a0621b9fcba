"""Boundary kernels between float NCHW and int8 NCHW4c: the only layout transforms of a compiled
model (one at the input, one before the classifier).

``quantize_pack``: float [N, C, H, W] -> int8 [N, ceil(C/4), H, W, 4] (channels zero-padded).
``dequantize_unpack``: int8 [N, C/4, H, W, 4] -> float [N, C, H, W].
``quantize_rows``: float [N, K] -> int8 [N, ceil(K/4)*4], the input of an int8 dense layer.

Rounding is ``floor(x / s + 0.5)`` with a true division: no multiply-add for nvcc to contract
into an FMA, so CPU and CUDA builds round identically.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .conv2d_nchw4c_int8 import ceil4


def _q(x, scale: float, lo: int = -128, hi: int = 127):
    v = tirx.floor(x / tirx.const(scale, "float32") + tirx.const(0.5, "float32"))
    return tirx.max(tirx.min(v, tirx.const(hi, "float32")), tirx.const(lo, "float32")).astype("int8")


def quantize_ref(x: np.ndarray, scale: float, lo: int = -128, hi: int = 127) -> np.ndarray:
    """NumPy twin of the kernels' float -> int8 rounding (float32 arithmetic throughout)."""
    v = np.floor(x.astype(np.float32) / np.float32(scale) + np.float32(0.5))
    return np.clip(v, lo, hi).astype(np.int8)


def quantize_pack(shape: tuple[int, int, int, int], scale: float) -> tirx.PrimFunc:
    n, c, h, w = shape
    x = te.placeholder(shape, "float32", name="X")
    out = te.compute(
        (n, ceil4(c) // 4, h, w, 4),
        lambda b, cc, y, xx, ci: tirx.if_then_else(
            cc * 4 + ci < c, _q(x[b, tirx.min(cc * 4 + ci, c - 1), y, xx], scale), tirx.const(0, "int8")),
        name="quantize_pack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "quantize_pack"})


def dequantize_unpack(shape: tuple[int, int, int, int], channels: int, scale: float) -> tirx.PrimFunc:
    n, cc, h, w, _ = shape
    x = te.placeholder(shape, "int8", name="X")
    out = te.compute(
        (n, channels, h, w),
        lambda b, c, y, xx: x[b, c // 4, y, xx, c % 4].astype("float32") * tirx.const(scale, "float32"),
        name="dequantize_unpack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "dequantize_unpack"})


def quantize_rows(shape: tuple[int, int], scale: float) -> tirx.PrimFunc:
    n, k = shape
    x = te.placeholder(shape, "float32", name="X")
    out = te.compute(
        (n, ceil4(k)),
        lambda b, i: tirx.if_then_else(i < k, _q(x[b, tirx.min(i, k - 1)], scale), tirx.const(0, "int8")),
        name="quantize_rows")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "quantize_rows"})
