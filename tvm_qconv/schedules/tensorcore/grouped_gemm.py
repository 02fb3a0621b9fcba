"""Grouped convs on the int8 tensor cores (``mma.sync``): each *super-group* of ``S`` output channels a
GEMM of its own ``S`` input channels -- ``32 / g`` groups of ``g`` channels where ``g`` divides 32
(ResNeXt's 4, 8, 16, 32; RegNet-X-400MF's 16), or one group of 64 or 128 -- with a block-diagonal
weight: the template of ``mma.py`` with the block tile's columns fixed at one super-group, so each
block's A tile is the im2col of that super-group's channels only.

Why: on ``__dp4a`` (``grouped.py``) RegNet-X's grouped convs ran at 16 % of the dp4a peak at batch 64
on an H200 (0.57 of 1.33 ms of kernels, ``docs/performance.md``); the int8 tensor cores have ~10x the
dp4a peak, so even the block-diagonal zeros (``32 / g - 1`` of every ``32 / g`` products: 1 of 2 for
RegNet-X) leave them far ahead.

GEMM view (``conv2d.py``'s, per super-group ``s``)::

    A_s[m, k]  the im2col of input channels S s .. S s + S - 1: k = (ky * kw + kx) * S + c
    C[m, o]    sum_k A_{o // S}[m, k] * W[o, k]           K = kh * kw * S for every super-group
    Out        + bias, fixed-point requantize, clamp (the same epilogue as every conv)

``A`` is one buffer ``[M_p, O_p / S * K]`` (super-group-major) and the conv reads ``A[m, (o // S) * K + k]``:
with ``S``-column blocks the template's A tile lies in one super-group, and its copy, ``ldmatrix`` and
``mma`` are the dense conv's.  Weight ``[O_p, K]``: row ``o`` holds its group's ``g`` channels at their
place among the super-group's ``S``, zeros elsewhere (:func:`pack_weight`).

Takes: ``g`` input and output channels per group, ``g`` a multiple of 4 dividing 32, or 64 or 128
(:func:`super_width`), int8 out.  Untuned: the default tile's rows, ``S`` columns
(``default_decisions``).  Not the registry's default yet: not measured on a GPU
(``docs/performance.md``).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

from ..requantize import requantize_ref
from ..workload import ConvWorkload
from . import conv2d, mma

KERNEL_NAME = "conv2d_grouped_nhwc_int8_mma"
BLOCK_COLUMNS = (32, 64, 128)   # the template's block tile widths: a super-group is one of them


def super_width(wl: ConvWorkload) -> int | None:
    """``S``, the channels of a super-group (one block tile's columns): 32 for groups whose width
    divides 32, the group itself for groups of 64 or 128; None for any other grouped conv."""
    if wl.groups == 1 or wl.is_depthwise:
        return None
    gi, go = wl.in_channels // wl.groups, wl.out_channels // wl.groups
    if gi != go or go % 4:
        return None
    return 32 if 32 % go == 0 else go if go in BLOCK_COLUMNS else None


def takes(wl: ConvWorkload) -> bool:
    """Whether ``wl`` is a grouped conv this GEMM form takes (module docstring)."""
    return (super_width(wl) is not None and wl.out_dtype == "int8" and not wl.table
            and conv2d.gemm_shape(wl)[0] != 16)


def grouped_gemm_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Unscheduled PrimFunc ``(data, weight, bias, mult, shift, out)``: ``conv2d.conv2d_nhwc_int8``'s
    blocks ``im2col``, ``conv``, ``requant`` (the template schedules them by name) per super-group."""
    assert takes(wl), wl
    return conv2d.conv2d_nhwc_int8(wl, super_width=super_width(wl)).with_attr("tvm_qconv.kernel", KERNEL_NAME)


def pack_weight(wl: ConvWorkload, w: np.ndarray) -> np.ndarray:
    """OIHW ``[O, g, KH, KW]`` -> int8 ``[O_p, KH * KW * S]``: output channel ``o``'s ``g`` inputs at
    their place among its super-group's ``S`` channels, zeros elsewhere (and on padded rows)."""
    o, g, kh, kw = w.shape
    s = super_width(wl)
    dense = np.zeros((o, s, kh, kw), w.dtype)
    for oc in range(o):
        start = oc // g * g - oc // s * s      # the group's first channel within the super-group
        dense[oc, start:start + g] = w[oc]
    return conv2d.pack_weight(dense)           # its padded rows (output channels) 0


def grouped_gemm_int8_ref(wl: ConvWorkload, data, weight, bias, mult, shift) -> np.ndarray:
    """NumPy reference on the packed layouts: each super-group a dense conv of its 32 channels
    (``conv2d.conv2d_nhwc_int8_ref``'s float64 accumulation), int8 ``[N, OH, OW, O_p]``."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    op, width = weight.shape[0], super_width(wl)
    dp = np.pad(data, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=wl.in_zero).astype(np.float64)
    wk = weight.reshape(op, kh, kw, width).astype(np.float64)
    acc = np.zeros((data.shape[0], oh, ow, op), np.float64)
    for s in range(op // width):
        cols = slice(s * width, (s + 1) * width)
        for y in range(kh):
            for x in range(kw):
                win = dp[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, x * dw: x * dw + (ow - 1) * sw + 1: sw, cols]
                acc[..., cols] += win @ wk[cols, y, x, :].T
    return requantize_ref(acc.astype(np.int64) + bias.astype(np.int64), mult, shift, wl.act_min, wl.act_max)


def default_decisions(func: tirx.PrimFunc, num_sm: int) -> tuple[dict, int]:
    """The template's untuned tiles, ``S`` columns wide (``mma.default_decisions``)."""
    s = super_width(ConvWorkload.of(func))
    mp, op, k = mma.gemm_extents(tvm.s_tir.Schedule(func))
    return mma.default_decisions(mp, op, k, num_sm, columns=s)


def schedule(func: tirx.PrimFunc, num_sm: int) -> tirx.PrimFunc:
    """``func`` on the mma.sync template with :func:`default_decisions` (32-column blocks)."""
    decisions, stages = default_decisions(func, num_sm)
    sch = tvm.s_tir.Schedule(func)
    mma.apply_mma_schedule(sch, decisions, stages)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
