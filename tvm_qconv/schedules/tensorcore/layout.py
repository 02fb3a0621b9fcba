"""The NHWC32 layout of the tensor-core family: int8 activations ``[n, h, w, c]`` with the channels
zero-padded to a multiple of 32.

Why NHWC: the conv is an implicit GEMM whose reduction runs over (tap, channel); with the
channels innermost, one tap's 32 channels are one contiguous 32-byte run, so the im2col gather
is 16-byte vector copies (cp.async) and every ``mma.sync.m16n8k32`` K step stays inside one tap.
NC/32HW32c would give the same runs but strided pixel rows; NHWC keeps each image contiguous,
which is what TensorRT and cuDNN use for int8 too.  Why 32: one m16n8k32 K step; the output
channels are padded to 32 as well, so a layer's output is the next layer's input as it is.

Its two boundary kernels with float NCHW are the registry's ``quantize.nhwc32.generic`` /
``dequantize.nhwc32.generic`` (:data:`QUANTIZE`, :data:`DEQUANTIZE`:
``schedules/conversion_kernels.py``), made here with the layout, whose :meth:`NHWC32.quantize`
computes them.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from ..channels_last_conversions import schedule_dequantize_nhwc32, schedule_quantize_nhwc32
from ..conversion_kernels import Dequantize, Quantize
from ..kernel import Layout
from ..quantize import dequantize_tir, quantize_clamp, quantize_tir
from ..workload import DequantizeWorkload, QuantizeWorkload

ALIGN = 32


def ceil32(c: int) -> int:
    return (c + ALIGN - 1) // ALIGN * ALIGN


def pack_nhwc32(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, H, W, ceil32(C)], zero-padding the channels."""
    n, c, h, w = x.shape
    out = np.zeros((n, h, w, ceil32(c)), x.dtype)
    out[..., :c] = x.transpose(0, 2, 3, 1)
    return out


def unpack_nhwc32(x: np.ndarray, channels: int) -> np.ndarray:
    """[N, H, W, C_p] -> [N, channels, H, W]."""
    return np.ascontiguousarray(x[..., :channels].transpose(0, 3, 1, 2))


def quantize_pack_nhwc32(shape: tuple[int, int, int, int], scale: float, zero: int = 0) -> tirx.PrimFunc:
    """Kernel: float [N, C, H, W] -> int8 [N, H, W, ceil32(C)] (channels zero-padded; rounding as
    in ``schedules/quantize.py``): the registry's ``quantize.nhwc32.generic``."""
    n, c, h, w = shape
    x = te.placeholder(shape, "float32", name="X")
    out = te.compute(
        (n, h, w, ceil32(c)),
        lambda b, y, xx, cc: tirx.if_then_else(cc < c, quantize_tir(x[b, tirx.min(cc, c - 1), y, xx], scale, *quantize_clamp(zero)),
                                               tirx.const(0, "int8")),
        name="quantize_pack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "quantize_pack_nhwc32"})


def dequantize_unpack_nhwc32(packed: tuple[int, int, int, int], channels: int, scale: float,
                             zero: int = 0) -> tirx.PrimFunc:
    """Kernel: int8 [N, H, W, C_p] -> float [N, channels, H, W], ``(q - zero) * scale``: the
    registry's ``dequantize.nhwc32.generic``."""
    n, h, w, _ = packed
    x = te.placeholder(packed, "int8", name="X")
    out = te.compute((n, channels, h, w), lambda b, c, y, xx: dequantize_tir(x[b, y, xx, c], scale, zero),
                     name="dequantize_unpack")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "dequantize_unpack_nhwc32"})


class NHWC32(Layout):
    name = "NHWC32"

    def packed_shape(self, shape):
        n, c, h, w = shape
        return (n, h, w, ceil32(c))

    def logical_shape(self, packed):
        n, h, w, c = packed
        return (n, c, h, w)

    def quantize(self, shape, scale, zero=0):
        return QUANTIZE.compute(QuantizeWorkload(shape, scale, zero))

    def dequantize(self, packed, channels, scale, zero=0):
        return DEQUANTIZE.compute(DequantizeWorkload(packed, channels, scale, zero))

    def pack(self, x):
        return pack_nhwc32(x)

    def unpack(self, x, channels):
        return unpack_nhwc32(x, channels)

    def to_logical(self, index):
        n, h, w, c = index
        return n, c, h, w

    def to_packed(self, n, c, h, w):
        return n, h, w, c


LAYOUT = NHWC32()
# float <-> int8 NHWC32, threads on pixels on CUDA (dlight's read the float side a feature map
# apart per thread: ``channels_last_conversions.py``)
QUANTIZE = Quantize(LAYOUT, "quantize_pack_nhwc32", quantize_pack_nhwc32, schedule_quantize_nhwc32)
DEQUANTIZE = Dequantize(LAYOUT, "dequantize_unpack_nhwc32", dequantize_unpack_nhwc32, schedule_dequantize_nhwc32)


def zero_word(zero: int) -> int:
    """The int32 whose four bytes are the int8 ``zero`` (a padded tap's word in the dp4a kernels)."""
    return int(np.array([zero] * 4, np.int8).view(np.int32)[0])
