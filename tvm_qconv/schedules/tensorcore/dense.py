"""The int8 dense (linear) layer as a GEMM on int8 tensor cores: the conv's template, a float epilogue.

A linear layer is the conv's implicit GEMM with nothing to gather::

    im2col   A[m, k]  int8 [M_p, K_p]: the quantized input rows (rows m >= N are 0)
    conv     C[m, o]  int32 [M_p, O_p]: sum_k A[m, k] * W[o, k]
    requant  Out[m, o] float32 for m < N, o < O: C * scale[o] + bias[o], clipped to the
             activation's (lo, hi) where it has one (``dense_int8.py``'s epilogue)

so ``mma.apply_mma_schedule`` schedules it unchanged (its blocks carry the conv's names).  The
output is float, as every dense layer's (``schedules/dense_int8.py``: a classifier ends in float
logits; ConvNeXt's token-wise layers feed LayerNorm / GELU).  Packed at build time: W
``[O_p, K_p]`` (K padded to 32 for the mma K step, O to 32), scale and bias ``[O_p]``; the input
rows come from ``quantize_rows`` padded to K_p.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..dense_int8 import DenseWorkload, dense_int8_ref
from .conv2d import M_ALIGN
from .layout import ceil32

KERNEL_NAME = "dense_rows_int8_mma"


def gemm_shape(wl: DenseWorkload) -> tuple[int, int, int, int]:
    """(M_p, O_p, K_p, M) of the GEMM."""
    return -(-wl.batch // M_ALIGN) * M_ALIGN, ceil32(wl.out_features), ceil32(wl.in_features), wl.batch


def dense_mma_int8(wl: DenseWorkload) -> tirx.PrimFunc:
    """Unscheduled PrimFunc ``(x, weight, scale, bias, out)`` (module docstring)."""
    MP, OP, KP, N = gemm_shape(wl)
    O = wl.out_features
    LO, HI = wl.clip if wl.clip is not None else (-np.inf, np.inf)
    has_lo, has_hi = bool(np.isfinite(LO)), bool(np.isfinite(HI))
    lo, hi = (float(LO) if has_lo else 0.0), (float(HI) if has_hi else 0.0)

    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((N, KP), "int8"), weight: T.Buffer((OP, KP), "int8"), scale: T.Buffer((OP,), "float32"),
             bias: T.Buffer((OP,), "float32"), out: T.Buffer((N, O), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        with T.sblock("root"):
            A = T.sblock_alloc_buffer((MP, KP), "int8")
            C = T.sblock_alloc_buffer((MP, OP), "int32")
            for m, k in T.grid(MP, KP):
                with T.sblock("im2col"):
                    vm, vk = T.axis.remap("SS", [m, k])
                    T.reads(x[T.min(vm, N - 1), vk])
                    T.writes(A[vm, vk])
                    A[vm, vk] = T.if_then_else(vm < N, x[T.min(vm, N - 1), vk], T.int8(0))
            for m, o, k in T.grid(MP, OP, KP):  # the conv's GEMM block, under its name
                with T.sblock("conv"):
                    vm, vo, vk = T.axis.remap("SSR", [m, o, k])
                    T.reads(A[vm, vk], weight[vo, vk])
                    T.writes(C[vm, vo])
                    with T.init():
                        C[vm, vo] = 0
                    C[vm, vo] = C[vm, vo] + T.Cast("int32", A[vm, vk]) * T.Cast("int32", weight[vo, vk])
            for m, o in T.grid(MP, OP):
                with T.sblock("requant"):
                    vm, vo = T.axis.remap("SS", [m, o])
                    T.reads(C[vm, vo], scale[vo], bias[vo])
                    T.writes(out[T.min(vm, N - 1), T.min(vo, O - 1)])
                    # likely(): without it, at exactly 16 rows (one mma fragment row) TVM's
                    # reverse_compute_at of this block fails its region check (VGG16 at batch 16)
                    if T.likely(vm < N) and vo < O:
                        v = T.meta_var(T.Cast("float32", C[vm, vo]) * scale[vo] + bias[vo])
                        if has_lo and has_hi:
                            out[vm, vo] = T.max(T.min(v, T.float32(hi)), T.float32(lo))
                        elif has_lo:
                            out[vm, vo] = T.max(v, T.float32(lo))
                        elif has_hi:
                            out[vm, vo] = T.min(v, T.float32(hi))
                        else:
                            out[vm, vo] = v

    return main.with_attr({"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict())})


def pack_params(wl: DenseWorkload, weight: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> list[np.ndarray]:
    """int8 [O, K] weight, float [O] scale and bias -> [O_p, K_p], [O_p], [O_p] (zero padded)."""
    _, op, kp, _ = gemm_shape(wl)
    o, k = weight.shape
    w = np.zeros((op, kp), np.int8)
    w[:o, :k] = weight
    s, b = np.zeros(op, np.float32), np.zeros(op, np.float32)
    s[:o], b[:o] = scale, bias
    return [w, s, b]


def dense_mma_int8_ref(wl: DenseWorkload, x, weight, scale, bias) -> np.ndarray:
    """NumPy reference on the packed arguments: float [N, O]."""
    o = wl.out_features
    return dense_int8_ref(x, weight[:o], scale[:o], bias[:o], wl.clip)
