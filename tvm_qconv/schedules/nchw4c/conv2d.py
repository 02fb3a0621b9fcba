"""The fused int8 conv kernel: NCHW4c x OIHW4o4i -> int32 accumulate -> +bias -> requantize(+clamp) -> int8 NCHW4c.

Read top to bottom: the compute definition (:func:`conv2d_nchw4c_int8`), the NumPy reference
(:func:`conv2d_nchw4c_int8_ref`) and the packing of weights and per-channel vectors.  The
schedules live beside this file, one per family (``dp4a.py`` for CUDA, ``cpu.py`` for llvm).

Layouts (seed 001): data ``[n, c // 4, h, w, c % 4]``; weight ``[o // 4, i // 4, kh, kw, o % 4, i % 4]``,
so one dp4a multiplies 4 consecutive input channels of the data with 4 consecutive input channels
of one output channel's filter, both contiguous int8x4 words.

Groups: each group's channels are padded to a multiple of 4 on their own (``group_blocks``), so
a 4-channel block never mixes two groups: output block ``ob`` of group ``ob // ogb`` reads input
blocks ``g * cgb + rc``.  Where every group has a multiple of 4 channels (ResNeXt, RegNet) that is
plain NCHW4c; the training path packs any grouping this way.  With ``groups == 1`` the compute
is written exactly as before groups existed, so tuning records made for it still match.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .. import epilogue_residual, epilogue_table
from ..requantize import requantize_ref, requantize_tir
from ..workload import ConvWorkload
from .layout import ceil4

KERNEL_NAME = "conv2d_nchw4c_int8"


def group_blocks(wl: ConvWorkload) -> tuple[int, int]:
    """(input blocks per group, output blocks per group) of 4 channels, each group padded to 4."""
    return ceil4(wl.group_in) // 4, ceil4(wl.group_out) // 4


def zero_pad(A: te.Tensor, wl: ConvWorkload) -> te.Tensor:
    """Stage ``pad``: the NCHW4c input ``A`` padded by ``wl.padding`` with its zero point
    ``wl.in_zero`` (a real zero: 0, or -128 for an unsigned input)."""
    pt, pl, pb, pr = wl.padding
    n, cc, h, w, _ = A.shape
    return te.compute(
        (n, cc, h + pt + pb, w + pl + pr, 4),
        lambda b, c, y, x, ci: tirx.if_then_else(
            tirx.all(y >= pt, y < pt + wl.height, x >= pl, x < pl + wl.width),
            A[b, c, y - pt, x - pl, ci], tirx.const(wl.in_zero, "int8")),
        name="pad")


def conv2d_nchw4c_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Compute definition (unscheduled PrimFunc) of the conv for one workload.

    ``out_dtype == "int8"``: params A int8 (N, G*cgb, H, W, 4); W int8 (G*ogb, cgb, KH, KW, 4, 4);
    Bias, Mult, Shift int32 (G*ogb, 4); returns Out int8 (N, G*ogb, OH, OW, 4).  Blocks: ``pad``,
    ``conv`` (int32 reduction over rc, ry, rx, rci with rci innermost, 4 wide: the dp4a axis)
    and ``requant`` (the epilogue: + bias, fixed-point multiply, clamp to [act_min, act_max];
    a schedule inlines it into the write-back).

    ``out_dtype == "int32"``: params A, W only, Out is the int32 accumulator, and ``requant``
    is a plain copy (same block names, so the same schedules apply): the training path's
    forward and the unfused side of the fused-vs-unfused benchmark.
    """
    cgb, ogb = group_blocks(wl)
    icc, occ = wl.groups * cgb, wl.groups * ogb
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    oh, ow = wl.out_height, wl.out_width
    A = te.placeholder((wl.batch, icc, wl.height, wl.width, 4), "int8", name="A")
    W = te.placeholder((occ, cgb, kh, kw, 4, 4), "int8", name="W")
    pad = zero_pad(A, wl)
    rc = te.reduce_axis((0, cgb), name="rc")
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    rci = te.reduce_axis((0, 4), name="rci")

    def in_block(oc):
        return rc if wl.groups == 1 else oc // ogb * cgb + rc

    conv = te.compute(
        (wl.batch, occ, oh, ow, 4),
        lambda n, oc, y, x, oci: te.sum(
            pad[n, in_block(oc), y * sh + ry * dh, x * sw + rx * dw, rci].astype("int32")
            * W[oc, rc, ry, rx, oci, rci].astype("int32"),
            axis=[rc, ry, rx, rci]),
        name="conv")
    attrs = {"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict())}
    if wl.out_dtype == "int32":
        out = te.compute(conv.shape, lambda *i: conv(*i), name="requant")
        return te.create_prim_func([A, W, out]).with_attr(attrs)
    bias = te.placeholder((occ, 4), "int32", name="Bias")
    mult = te.placeholder((occ, 4), "int32", name="Mult")
    shift = te.placeholder((occ, 4), "int32", name="Shift")
    table = epilogue_table.te_table(wl)
    residual, add = epilogue_residual.te_buffers(wl, (wl.batch, occ, oh, ow, 4))
    out = te.compute(
        (wl.batch, occ, oh, ow, 4),
        lambda n, oc, y, x, oci: epilogue_residual.finish(epilogue_table.finish(requantize_tir(
            conv[n, oc, y, x, oci].astype("int64") + bias[oc, oci].astype("int64"),
            mult[oc, oci], shift[oc, oci], wl.act_min, wl.act_max), oc * 4 + oci, table, wl.out_channels),
            None if residual is None else residual[n, oc, y, x, oci], add, wl),
        name="requant")
    rest = [W, bias, mult, shift] + ([table] if table is not None else [])
    return te.create_prim_func(epilogue_residual.te_args(A, rest, out, residual, add)).with_attr(attrs)


def conv2d_nchw4c_int8_ref(wl: ConvWorkload, a, w, bias=None, mult=None, shift=None) -> np.ndarray:
    """NumPy reference of :func:`conv2d_nchw4c_int8` (same layouts, same epilogue).

    The accumulation runs in float64 through BLAS, as the tensor-core reference's does
    (``tensorcore/conv2d.py``), and is exact: every int8 x int8 product has magnitude <= 2**14,
    so every partial sum over K = KH * KW * C_in products is an integer below K * 2**14, which
    float64 holds exactly while it stays below 2**53 (K < 2**39), in any summation order.  An
    int64 matmul gives the same integers without BLAS (NumPy's own loops): 0.47 s against 0.28 s
    for 64->64 3x3 at 56x56, batch 8, on a 2-core machine.  The epilogue is the int64
    fixed-point requantization.

    Returns the int8 output, or the accumulator (as int32 values) for ``out_dtype == "int32"``.
    """
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    cgb, ogb = group_blocks(wl)
    ap = np.pad(a.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=wl.in_zero)
    n = a.shape[0]
    accs = []
    for g in range(wl.groups):
        ag = ap[:, g * cgb:(g + 1) * cgb]
        wg = w[g * ogb:(g + 1) * ogb]
        # [n, cgb, h, w, ci] -> [n, h, w, cgb*ci]; weight [ogb, cgb, kh, kw, oci, ici] -> [kh, kw, cgb*ici, ogb*oci]
        ag = ag.transpose(0, 2, 3, 1, 4).reshape(n, ap.shape[2], ap.shape[3], cgb * 4)
        wk = wg.astype(np.float64).transpose(2, 3, 1, 5, 0, 4).reshape(kh, kw, cgb * 4, ogb * 4)
        acc = np.zeros((n, oh, ow, ogb * 4), np.float64)
        for y in range(kh):
            for x in range(kw):
                win = ag[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, x * dw: x * dw + (ow - 1) * sw + 1: sw, :]
                acc += win @ wk[y, x]
        accs.append(acc.reshape(n, oh, ow, ogb, 4).transpose(0, 3, 1, 2, 4))
    acc = np.concatenate(accs, axis=1).astype(np.int64)  # whole numbers: the conversion is exact
    if wl.out_dtype == "int32":
        return acc.astype(np.int32)
    return requantize_ref(acc + bias.astype(np.int64)[None, :, None, None, :],
                          mult[None, :, None, None, :], shift[None, :, None, None, :], wl.act_min, wl.act_max)


def pack_input_groups(x: np.ndarray, groups: int) -> np.ndarray:
    """[N, C, H, W] -> [N, G*cgb, H, W, 4], each group's channels zero-padded to 4 on their own
    (``pack_nchw4c`` when ``groups == 1`` or the groups are multiples of 4)."""
    n, c, h, w = x.shape
    cg = c // groups
    xp = np.zeros((n, groups, ceil4(cg), h, w), x.dtype)
    xp[:, :, :cg] = x.reshape(n, groups, cg, h, w)
    return np.ascontiguousarray(xp.reshape(n, -1, 4, h, w).transpose(0, 1, 3, 4, 2))


def unpack_output_groups(y: np.ndarray, channels: int, groups: int) -> np.ndarray:
    """Inverse of :func:`pack_input_groups` for an output of ``channels`` channels."""
    n, cb, h, w, _ = y.shape
    y = y.transpose(0, 1, 4, 2, 3).reshape(n, groups, cb * 4 // groups, h, w)
    return np.ascontiguousarray(y[:, :, :channels // groups].reshape(n, channels, h, w))


def pack_oihw4o4i(w: np.ndarray, groups: int = 1) -> np.ndarray:
    """[O, I/G, KH, KW] -> [G*ogb, cgb, KH, KW, 4o, 4i], each group's channels zero-padded to 4."""
    o, i, kh, kw = w.shape
    og = o // groups
    o4, i4 = ceil4(og), ceil4(i)
    wp = np.zeros((groups, o4, i4, kh, kw), w.dtype)
    wp[:, :og, :i] = w.reshape(groups, og, i, kh, kw)
    wp = wp.reshape(groups * o4 // 4, 4, i4 // 4, 4, kh, kw)
    return np.ascontiguousarray(wp.transpose(0, 2, 4, 5, 1, 3))


def pack_channels(v: np.ndarray, fill=0, groups: int = 1) -> np.ndarray:
    """Per-output-channel vector [O] -> [G*ogb, 4]; padded channels get ``fill`` (0 for bias and
    mult, so padded output channels stay exactly 0; 1 for shift, the smallest legal shift)."""
    og = v.shape[0] // groups
    vp = np.full((groups, ceil4(og)), fill, v.dtype)
    vp[:, :og] = v.reshape(groups, og)
    return vp.reshape(-1, 4)
