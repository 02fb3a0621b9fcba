"""The NCHW4c layout: int8 activations ``[n, c // 4, h, w, c % 4]``, channels zero-padded to 4,
and its two boundary kernels between float NCHW and int8 NCHW4c.

``quantize_pack``: float [N, C, H, W] -> int8 [N, ceil(C/4), H, W, 4] (channels zero-padded).
``dequantize_unpack``: int8 [N, C/4, H, W, 4] -> float [N, C, H, W].

A compiled model calls them where int8 meets float (the model input, before the classifier,
around an op with no int8 kernel); rounding as in ``schedules/quantize.py``.  They are the
compute definitions of the registry's ``quantize.nchw4c.generic`` / ``dequantize.nchw4c.generic``
(:data:`QUANTIZE`, :data:`DEQUANTIZE`: ``schedules/conversion_kernels.py``), made here with the
layout, whose :meth:`NCHW4c.quantize` computes them.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..conversion_kernels import Dequantize, Quantize
from ..elementwise_int8 import schedule_elementwise
from ..kernel import Layout
from ..quantize import dequantize_tir, quantize_clamp, quantize_tir
from ..workload import DequantizeWorkload, QuantizeWorkload


def ceil4(c: int) -> int:
    return (c + 3) // 4 * 4


def pack_nchw4c(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, ceil(C/4), H, W, 4], zero-padding the channels."""
    n, c, h, w = x.shape
    xp = np.zeros((n, ceil4(c), h, w), x.dtype)
    xp[:, :c] = x
    return np.ascontiguousarray(xp.reshape(n, -1, 4, h, w).transpose(0, 1, 3, 4, 2))


def unpack_nchw4c(x: np.ndarray, channels: int) -> np.ndarray:
    """[N, C/4, H, W, 4] -> [N, C, H, W] keeping the first ``channels`` channels."""
    n, cc, h, w, _ = x.shape
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3).reshape(n, cc * 4, h, w)[:, :channels])


def quantize_pack(shape: tuple[int, int, int, int], scale: float, zero: int = 0) -> tirx.PrimFunc:
    n, c, h, w = shape
    x = te.placeholder(shape, "float32", name="X")
    out = te.compute(
        (n, ceil4(c) // 4, h, w, 4),
        lambda b, cc, y, xx, ci: tirx.if_then_else(
            cc * 4 + ci < c, quantize_tir(x[b, tirx.min(cc * 4 + ci, c - 1), y, xx], scale, *quantize_clamp(zero)),
            tirx.const(0, "int8")),
        name="quantize_pack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "quantize_pack"})


def dequantize_unpack(shape: tuple[int, int, int, int, int], channels: int, scale: float, zero: int = 0) -> tirx.PrimFunc:
    n, cc, h, w, _ = shape
    x = te.placeholder(shape, "int8", name="X")
    out = te.compute(
        (n, channels, h, w),
        lambda b, c, y, xx: dequantize_tir(x[b, c // 4, y, xx, c % 4], scale, zero),
        name="dequantize_unpack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "dequantize_unpack"})


class NCHW4c(Layout):
    name = "NCHW4c"

    def packed_shape(self, shape):
        n, c, h, w = shape
        return (n, ceil4(c) // 4, h, w, 4)

    def logical_shape(self, packed):
        n, cb, h, w, _ = packed
        return (n, cb * 4, h, w)

    def quantize(self, shape, scale, zero=0):
        return QUANTIZE.compute(QuantizeWorkload(shape, scale, zero))

    def dequantize(self, packed, channels, scale, zero=0):
        return DEQUANTIZE.compute(DequantizeWorkload(packed, channels, scale, zero))

    def pack(self, x):
        return pack_nchw4c(x)

    def unpack(self, x, channels):
        return unpack_nchw4c(x, channels)

    def to_logical(self, index):
        n, cb, h, w, ci = index
        return n, cb * 4 + ci, h, w

    def to_packed(self, n, c, h, w):
        return n, c // 4, h, w, c % 4


LAYOUT = NCHW4c()


def schedule_quantize(func, target):
    """The model input's quantize to NCHW4c (the stem's input) on CUDA: one thread per pixel, its 4
    channels stored as one 32-bit word (dlight's took 65 us of ResNet-50's forward at batch 64 on
    an H200, ~5x its 51 MB of traffic).  None elsewhere."""
    return schedule_elementwise(func, target, "quantize_pack", operands=())


# float <-> int8 NCHW4c; the dequantize is left to dlight
QUANTIZE = Quantize(LAYOUT, "quantize_pack", quantize_pack, schedule_quantize)
DEQUANTIZE = Dequantize(LAYOUT, "dequantize_unpack", dequantize_unpack)
