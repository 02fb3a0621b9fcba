"""int8 -> int8 LayerNorm over the channels of every pixel, in any activation layout (ConvNeXt's
LayerNorm, which ``transform/channels_first.py`` turns into a LayerNorm over NCHW's axis 1).

    y[n, c, h, w] = (x - mean_c x) / sqrt(var_c x + eps) * gamma[c] + beta[c]

What it replaces: the int8 map dequantized, permuted to NHWC, normalized in float, quantized
and permuted back -- five passes and two float copies of the map (ConvNeXt-T at batch 64 on an
H100 spent 2.0 ms in its 23 LayerNorms and 2.5 ms in the permutes around them, ``docs/history.md``).

The input's scale and zero point cancel: with ``q`` the int8 values of one pixel's ``C`` channels,
``S1 = sum q`` and ``S2 = sum q^2`` (exact int32),

    (x - mean) / sqrt(var + eps) = d / sqrt(V + C^2 eps / s_x^2),   d = C q - S1,  V = C S2 - S1^2

(``d`` int32, ``V`` int64, both exact).  Per pixel the factor ``r = 1 / sqrt(V + E0)`` is one
float64 square root and one division (IEEE-rounded on the CPU, in NumPy and on CUDA, fast math or
not), taken as the fixed-point ``M = nearbyint(min(r, 1) * 2**40)`` (``r <= 1 / sqrt(C - 1)``
wherever some ``d != 0``, since ``V >= C - 1`` then).  The rest is integer:

    t = (d * M) >> 20                          the normalized value, 20 fraction bits (|t| < 2**25)
    y = (t * G[c] + B[c]) >> 36,               G = nearbyint(gamma / s_y * 2**16),
                                               B = nearbyint((beta / s_y + z_y) * 2**36) + 2**35

then clamped to int8 (round half up).  Every step is exact or IEEE-rounded, so the CPU and CUDA
kernels and the NumPy twin agree bit for bit; against float LayerNorm the output is off by at most
``|gamma / s_y| * 2**-20`` plus the final rounding.  ``E0`` and ``2**40`` travel in a float64
argument ``E``: TVM prints float constants into CUDA source with limited digits.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from .kernel import Layout

ROW_BITS, NORM_BITS, GAMMA_BITS = 40, 20, 16
OUT_SHIFT = NORM_BITS + GAMMA_BITS
# |gamma / s_y| above this could overflow t * G in int64: such a LayerNorm stays float
MAX_GAIN = float(1 << 20)


def layer_norm_params(gamma: np.ndarray, beta: np.ndarray, eps: float, in_scale: float, out_scale: float,
                      out_zero: int, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G int64 [C], B int64 [C], E float64 [2]): the kernel's arguments after X (module docstring)."""
    g = np.asarray(gamma, np.float64) / out_scale
    b = np.asarray(beta, np.float64) / out_scale + out_zero
    G = np.rint(g * 2.0 ** GAMMA_BITS).astype(np.int64)
    B = (np.rint(b * 2.0 ** OUT_SHIFT) + 2.0 ** (OUT_SHIFT - 1)).astype(np.int64)
    E = np.array([channels * channels * float(eps) / (in_scale * in_scale), 2.0 ** ROW_BITS], np.float64)
    return G, B, E


def layer_norm_int8(layout: Layout, shape: tuple[int, ...], channels: int, out_zero: int = 0) -> tirx.PrimFunc:
    """Kernel: int8 X of packed ``shape`` in ``layout`` (``channels`` real ones), G, B int64 [channels],
    E float64 [2] (:func:`layer_norm_params`) -> int8 in ``layout`` (padded channels 0)."""
    x = te.placeholder(shape, "int8", name="X")
    out, params = layer_norm_stages(x, layout, channels, out_zero)
    return te.create_prim_func([x, *params, out]).with_attr(
        {"tvm_qconv.kernel": f"layer_norm_{layout.name.lower()}_int8"})


def layer_norm_stages(x: te.Tensor, layout: Layout, channels: int, out_zero: int = 0):
    """``(out, (G, B, E))``: the LayerNorm of the int8 tensor ``x`` (packed in ``layout``) as TE
    stages ``sum``, ``sum_sq``, ``row_mult``, ``layer_norm`` and their parameters; the kernel of
    :func:`layer_norm_int8`, and the epilogue of a depthwise conv that feeds a LayerNorm alone
    (``tensorcore/depthwise_layer_norm.py``)."""
    shape = tuple(int(d) for d in x.shape)
    n, _, h, w = layout.logical_shape(shape)
    gain = te.placeholder((channels,), "int64", name="G")
    offset = te.placeholder((channels,), "int64", name="B")
    consts = te.placeholder((2,), "float64", name="E")
    k1 = te.reduce_axis((0, channels), name="k1")
    k2 = te.reduce_axis((0, channels), name="k2")
    s1 = te.compute((n, h, w), lambda b, y, z: te.sum(x[layout.to_packed(b, k1, y, z)].astype("int32"), axis=k1),
                    name="sum")
    s2 = te.compute((n, h, w), lambda b, y, z: te.sum(x[layout.to_packed(b, k2, y, z)].astype("int32")
                                                      * x[layout.to_packed(b, k2, y, z)].astype("int32"), axis=k2),
                    name="sum_sq")

    def row(b, y, z):
        a = s1[b, y, z].astype("int64")
        v = tirx.const(channels, "int64") * s2[b, y, z].astype("int64") - a * a
        r = tirx.const(1.0, "float64") / tirx.sqrt(v.astype("float64") + consts[0])
        return tirx.nearbyint(tirx.min(r, tirx.const(1.0, "float64")) * consts[1]).astype("int64")

    mult = te.compute((n, h, w), row, name="row_mult")
    lo = -127 if out_zero == 0 else -128

    def body(*index):
        b, c, y, z = layout.to_logical(index)
        cc = tirx.min(c, channels - 1)   # padded channels read a real one, and write 0
        d = (tirx.const(channels, "int32") * x[index].astype("int32") - s1[b, y, z]).astype("int64")
        t = tirx.shift_right(d * mult[b, y, z], tirx.const(ROW_BITS - NORM_BITS, "int64"))
        q = tirx.shift_right(t * gain[cc] + offset[cc], tirx.const(OUT_SHIFT, "int64"))
        q = tirx.max(tirx.min(q, tirx.const(127, "int64")), tirx.const(lo, "int64")).astype("int8")
        return tirx.if_then_else(c < channels, q, tirx.const(0, "int8"))

    return te.compute(shape, body, name="layer_norm"), (gain, offset, consts)


def layer_norm_int8_ref(layout: Layout, x: np.ndarray, gain: np.ndarray, offset: np.ndarray, consts: np.ndarray,
                        channels: int, out_zero: int = 0) -> np.ndarray:
    """NumPy twin of :func:`layer_norm_int8`."""
    q = layout.unpack(x, channels).astype(np.int64)                      # N C H W
    s1 = q.sum(axis=1, keepdims=True)
    v = channels * (q * q).sum(axis=1, keepdims=True) - s1 * s1
    r = np.minimum(1.0 / np.sqrt(v.astype(np.float64) + consts[0]), 1.0)
    mult = np.rint(r * consts[1]).astype(np.int64)
    t = ((channels * q - s1) * mult) >> (ROW_BITS - NORM_BITS)
    y = (t * gain.reshape(1, -1, 1, 1) + offset.reshape(1, -1, 1, 1)) >> OUT_SHIFT
    return layout.pack(np.clip(y, -127 if out_zero == 0 else -128, 127).astype(np.int8))


def layer_norm_float_ref(x: np.ndarray, gamma, beta, eps: float) -> np.ndarray:
    """Float LayerNorm over axis 1 of an NCHW array (what the kernel approximates)."""
    x = x.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.reshape(gamma, (1, -1, 1, 1)) + np.reshape(beta, (1, -1, 1, 1))


WARPS = 4  # pixels per thread block: one warp each


def schedule_layer_norm(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """CUDA, channels-last layouts (the channel axis the buffer's last, NHWC32): one warp per pixel,
    lane ``l`` takes channels ``l, l + 32, ...``; both sums are warp reductions (shuffles), the
    row factor computed by every lane, the output written by the same lanes (consecutive bytes
    per warp: coalesced).  None elsewhere: llvm runs the compute definition, and another layout's
    CUDA kernel is left to dlight."""
    if target.kind.name != "cuda":
        return None
    sch = tvm.s_tir.Schedule(func)
    out = sch.get_sblock("layer_norm")
    loops = sch.get_loops(out)
    if len(loops) != 4:
        return None
    n, h, w, c = loops
    extent = int(sch.get(c).extent)
    if extent % 32:
        return None
    # the pixels of a block: a divisor of the row width (a warp per pixel), so that the block's pixels
    # are one row's -- a split that crosses rows left bindings TVM's reduction check rejects (seen at
    # 64 x 14 x 14 with 4 warps: "neither a local complete block nor a local reduction block")
    width = int(sch.get(w).extent)
    warps = max(d for d in range(1, WARPS + 1) if width % d == 0)
    w_outer, ty = sch.split(w, [None, warps])
    bx = sch.fuse(n, h, w_outer)
    co, lane = sch.split(c, [None, 32])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    mult = sch.get_sblock("row_mult")
    sch.compute_at(mult, ty)
    sch.set_scope(mult, 0, "local")
    for name in ("sum_sq", "sum"):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, ty)
        sch.set_scope(blk, 0, "local")   # the warp reduction leaves the sum in every lane's registers
        k = sch.get_loops(blk)[-1]
        _, kl = sch.split(k, [None, 32])
        sch.bind(kl, "threadIdx.x")
    sch.unroll(co)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
