"""int8 dense (linear) layer: int8 [N, K4] x int8 [O, K4] -> int32 -> float out.

The epilogue dequantizes (``acc * s_x * s_w[o] + bias[o]``, optional ReLU) to float: a classifier
ends in float logits, and its next layer, if any, re-quantizes its input per tensor (a few
thousand values, negligible next to the weight read).  K is zero-padded to a multiple of 4 so
the reduction can be tensorized by 4 like the conv.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx

from .conversion_kernels import QuantizeRows
from .kernel import KernelImpl
from .quantize import quantize_clamp, quantize_tir
from .sched_utils import round_up
from .workload import QuantizeRowsWorkload

KERNEL_NAME = "dense_int8"
K_ALIGN = 4     # K is padded to 4, as the NCHW4c channels are, so the reduction tensorizes by 4


def quantize_rows_compute(shape: tuple[int, int], scale: float, k_padded: int | None = None,
                          zero: int = 0) -> tirx.PrimFunc:
    """Kernel: float [N, K] -> int8 [N, k_padded] (zero-padded; default K rounded up to
    :data:`K_ALIGN`), the input of an int8 dense layer (``k_padded``: the dense implementation's,
    ``in_features_padded``; ``zero``: the zero point, -128 for an unsigned input:
    ``quantize.quantize_clamp``)."""
    n, k = shape
    x = te.placeholder(shape, "float32", name="X")
    out = te.compute(
        (n, k_padded or round_up(k, K_ALIGN)),
        lambda b, i: tirx.if_then_else(i < k, quantize_tir(x[b, tirx.min(i, k - 1)], scale, *quantize_clamp(zero)),
                                        tirx.const(0, "int8")),
        name="quantize_rows")
    return te.create_prim_func([x, out]).with_attr({"tvm_qconv.kernel": "quantize_rows"})


# the registry's ``quantize_rows`` implementation (``conversion_kernels.py``), made with its compute
QUANTIZE_ROWS = QuantizeRows(quantize_rows_compute)


def quantize_rows(shape: tuple[int, int], scale: float, k_padded: int | None = None, zero: int = 0) -> tirx.PrimFunc:
    """The registry's ``quantize_rows`` kernel (:func:`quantize_rows_compute`, tagged with its
    implementation); kept for callers that do not ask the registry yet::

        registry.select("quantize_rows", QuantizeRowsWorkload(shape, scale, k_padded, zero), target).compute(wl)
    """
    return QUANTIZE_ROWS.compute(QuantizeRowsWorkload(shape, scale, k_padded or round_up(shape[1], K_ALIGN), zero))


def dense_int8(n: int, k4: int, o: int, clip: tuple[float, float] | None = None) -> tirx.PrimFunc:
    """int8 linear layer, float out; ``clip``: the activation's (lo, hi), ReLU (0, inf), or None."""
    x = te.placeholder((n, k4), "int8", name="X")
    w = te.placeholder((o, k4), "int8", name="W")
    scale = te.placeholder((o,), "float32", name="Scale")  # s_x * s_w[o]
    bias = te.placeholder((o,), "float32", name="Bias")
    rk = te.reduce_axis((0, k4), name="rk")
    acc = te.compute((n, o), lambda i, j: te.sum(x[i, rk].astype("int32") * w[j, rk].astype("int32"), axis=rk),
                     name="dense")

    def epi(i, j):
        v = acc[i, j].astype("float32") * scale[j] + bias[j]
        if clip is None:
            return v
        lo, hi = clip
        v = tirx.min(v, tirx.const(hi, "float32")) if np.isfinite(hi) else v
        return tirx.max(v, tirx.const(lo, "float32")) if np.isfinite(lo) else v

    out = te.compute((n, o), epi, name="dequant")
    # On CUDA this kernel is left to dlight.  Its int8 tensor-core rule (wmma, taken when every
    # GEMM dimension exceeds 64: ConvNeXt's token-wise Linear layers, a classifier past batch 64)
    # fails in TVM 0.27's InjectSoftwarePipeline ("fragment_info_" check); dlight's SIMT matmul
    # rule is what it gets instead.
    return te.create_prim_func([x, w, scale, bias, out]).with_attr(
        {"tvm_qconv.kernel": KERNEL_NAME, "dlight.do_not_tensorize": True})


def dense_int8_ref(x, w, scale, bias, clip=None) -> np.ndarray:
    acc = x.astype(np.int64) @ w.astype(np.int64).T
    v = acc.astype(np.float32) * scale.astype(np.float32) + bias.astype(np.float32)
    return v if clip is None else np.clip(v, *clip)


@dataclass(frozen=True)
class DenseWorkload:
    """int8 [batch, in_features] x int8 [out_features, in_features] -> float [batch, out_features];
    each implementation pads K (and O) as its kernel needs (``in_features_padded``, ``pack_params``)."""

    batch: int
    in_features: int
    out_features: int
    clip: tuple[float, float] | None = None  # the activation's (lo, hi); ReLU is (0, inf)

    def to_dict(self) -> dict:
        return self.__dict__.copy()


class Dense(KernelImpl):
    """Any target: K padded to 4; on CUDA scheduled by dlight (its SIMT matmul / GEMV rules)."""

    name = "dense.rows.generic"
    op = "dense"
    layout = "rows"
    family = "generic"

    def applies(self, wl, target) -> bool:
        return True

    def in_features_padded(self, wl: DenseWorkload) -> int:
        """The K of the quantized input rows this kernel reads."""
        return round_up(wl.in_features, K_ALIGN)

    def pack_params(self, wl: DenseWorkload, weight, scale, bias) -> list[np.ndarray]:
        """int8 [O, K] weight, float [O] scale (s_x * s_w) and bias -> the kernel's constants."""
        w = np.zeros((wl.out_features, round_up(wl.in_features, K_ALIGN)), np.int8)
        w[:, :wl.in_features] = weight
        return [w, np.asarray(scale, np.float32), np.asarray(bias, np.float32)]

    def out_shape(self, wl: DenseWorkload) -> tuple[int, ...]:
        return (wl.batch, wl.out_features)

    def compute(self, wl: DenseWorkload):
        return self.tag(dense_int8(wl.batch, round_up(wl.in_features, K_ALIGN), wl.out_features, wl.clip), wl)

    def reference(self, wl: DenseWorkload, x, w, scale, bias):
        return dense_int8_ref(x, w, scale, bias, wl.clip)


DENSE = Dense()
