"""int8 dense (linear) layer: int8 [N, K4] x int8 [O, K4] -> int32 -> float out.

The epilogue dequantizes (``acc * s_x * s_w[o] + bias[o]``, optional ReLU) to float: a classifier
ends in float logits, and its next layer, if any, re-quantizes its input per tensor (a few
thousand values, negligible next to the weight read).  K is zero-padded to a multiple of 4 so
the reduction can be tensorized by 4 like the conv.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx


def dense_int8(n: int, k4: int, o: int, relu: bool) -> tirx.PrimFunc:
    x = te.placeholder((n, k4), "int8", name="X")
    w = te.placeholder((o, k4), "int8", name="W")
    scale = te.placeholder((o,), "float32", name="Scale")  # s_x * s_w[o]
    bias = te.placeholder((o,), "float32", name="Bias")
    rk = te.reduce_axis((0, k4), name="rk")
    acc = te.compute((n, o), lambda i, j: te.sum(x[i, rk].astype("int32") * w[j, rk].astype("int32"), axis=rk),
                     name="dense")

    def epi(i, j):
        v = acc[i, j].astype("float32") * scale[j] + bias[j]
        return tirx.max(v, tirx.const(0, "float32")) if relu else v

    out = te.compute((n, o), epi, name="dequant")
    return te.create_prim_func([x, w, scale, bias, out]).with_attr({"tvm_qconv.kernel": "dense_int8"})


def dense_int8_ref(x, w, scale, bias, relu) -> np.ndarray:
    acc = x.astype(np.int64) @ w.astype(np.int64).T
    v = acc.astype(np.float32) * scale.astype(np.float32) + bias.astype(np.float32)
    return np.maximum(v, 0) if relu else v
