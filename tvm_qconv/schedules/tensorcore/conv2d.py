"""The fused int8 conv as an implicit GEMM, in NHWC32: the tensor-core family's compute definition.

GEMM view of one conv layer::

    M = N*OH*OW  (rows = output pixels, padded logically to M_p, a multiple of M_ALIGN)
    N_gemm = O_p (output channels padded to 32)
    K = KH*KW*C_p (taps x padded input channels, k = (ky*KW + kx)*C_p + c)

Blocks of :func:`conv2d_nhwc_int8`::

    im2col   A[m, k]  int8 [M_p, K]: the gathered input (padding and rows m >= M read the input's
             zero point ``wl.in_zero``: 0, or -128 for an unsigned input, a real zero)
    conv     C[m, o]  int32 [M_p, O_p]: sum_k A[m, k] * W[o, k]
    requant  Out[n, y, x, o] int8 for m = (n*OH + y)*OW + x < M: + bias, fixed-point multiply,
             clamp to [act_min, act_max] (``schedules/requantize.py``, as every family)

The training path's forward (``wl.out_dtype == "int32"``, :func:`conv2d_nhwc_int32`) is the same
GEMM with the accumulator itself stored, ``Out[n, y, x, o] = C[m, o]``: its ``requant`` block only
stores, so ``mma.py`` schedules both forms alike.

The schedule (``mma.py``) never materializes ``im2col``: it is gathered into shared memory by the
copy that feeds the tensor cores.  Layouts: data ``[N, H, W, C_p]`` (``layout.py``), weight
``[O_p, KH*KW*C_p]`` (packed at build time: exactly the "col" operand of ``mma.row.col``), bias /
mult / shift ``[O_p]``.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .. import border_bias, epilogue_residual, epilogue_table
from ..requantize import requantize_ref, requantize_tir
from ..workload import ConvWorkload
from .layout import ceil32

KERNEL_NAME = "conv2d_nhwc_int8"
M_ALIGN = 128  # M_p: a multiple of every block tile's rows (32, 64, 128)


def gemm_shape(wl: ConvWorkload) -> tuple[int, int, int, int]:
    """(M, M_p, O_p, K) of the implicit GEMM."""
    m = wl.batch * wl.out_height * wl.out_width
    return m, (m + M_ALIGN - 1) // M_ALIGN * M_ALIGN, ceil32(wl.out_channels), \
        wl.kernel[0] * wl.kernel[1] * ceil32(wl.in_channels)


def conv2d_nhwc_int8(wl: ConvWorkload, border: bool = False, super_width: int | None = None) -> tirx.PrimFunc:
    """Unscheduled PrimFunc ``(data, weight, bias, mult, shift, out)`` (module docstring).

    ``border``: the form of a kernel that can only pad with 0 (wgmma's TMA), for a ``wl`` whose
    padding must read its zero point: the gather pads with 0 and ``bias`` is the
    ``[rows, O_p]`` table of ``schedules/border_bias.py``, read at the output pixel's border class.

    ``super_width`` ``S``: a grouped conv as one GEMM per ``S`` output channels over their own ``S``
    input channels (``grouped_gemm.py``): ``K = kh * kw * S``, the gather ``A`` holds every
    super-group's columns one after the other, and the conv reads ``A[m, (o // S) * K + k]``."""
    assert (wl.groups == 1) == (super_width is None) and wl.out_dtype == "int8", wl
    table = border and wl.pads_with_zero_point
    N, H, W = wl.batch, wl.height, wl.width
    Cp = ceil32(wl.in_channels)
    M, MP, Op, K = gemm_shape(wl)
    S = super_width
    if S is not None:           # per super-group: its S channels at every tap
        K = wl.kernel[0] * wl.kernel[1] * S
    OH, OW = wl.out_height, wl.out_width
    KW = wl.kernel[1]
    SH, SW = wl.stride
    DH, DW = wl.dilation
    PT, PL = wl.padding[0], wl.padding[1]
    OHW = OH * OW
    C16 = (Cp if S is None else S) // 16      # 16-byte vectors of the channels one tap gathers
    KWC16 = KW * C16
    COLS = K if S is None else Op // S * K     # the gather's columns

    def column(vk):             # the column within its super-group (the dense conv: vk itself)
        return vk if S is None else vk % K

    def first_channel(vk, c):   # c plus the first channel of vk's super-group
        return c if S is None else vk // K * S + c

    def a_column(vo, vk):       # the column of A that output channel vo multiplies by weight[vo, vk]
        return vk if S is None else vo // S * K + vk
    LO, HI = wl.act_min, wl.act_max
    ZERO = 0 if table else wl.in_zero
    BIAS = (border_bias.table_rows(wl), Op) if table else (Op,)
    LUT = epilogue_table.script_table(wl)    # wl.table: the function after the conv (epilogue_table.py)
    # wl.residual: the add after the conv, its other addend read where the conv stores (epilogue_residual.py)
    RES, ADD = epilogue_residual.script_buffers(wl, (N, OH, OW, Op))

    # the table's and the residual's buffers become parameters after parsing (with_table_param,
    # epilogue_residual.with_params): not well-formed before
    @T.prim_func(s_tir=True, check_well_formed=LUT is None and RES is None)
    def main(data: T.Buffer((N, H, W, Cp), "int8"), weight: T.Buffer((Op, K), "int8"),
             bias: T.Buffer(BIAS, "int32"), mult: T.Buffer((Op,), "int32"),
             shift: T.Buffer((Op,), "int32"), out: T.Buffer((N, OH, OW, Op), "int8")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        with T.sblock("root"):
            A = T.sblock_alloc_buffer((MP, COLS), "int8")
            C = T.sblock_alloc_buffer((MP, Op), "int32")
            for m, k in T.grid(MP, COLS):
                with T.sblock("im2col"):
                    vm, vk = T.axis.remap("SS", [m, k])
                    # k = 16*k16 + lane: the tap (ky, kx) and the padding test depend on k16 only,
                    # so a 16-wide vector (lane) of the gather is one contiguous, uniformly
                    # predicated int8x16 load (the vectorizer only has to fold
                    # floordiv(16*a + lane, 16) = a, not prove a ramp does not cross a tap).
                    k16 = T.meta_var(column(vk) // 16)
                    lane = T.meta_var(vk % 16)
                    ky = T.meta_var(k16 // KWC16)
                    kx = T.meta_var(k16 // C16 % KW)
                    c = T.meta_var(first_channel(vk, k16 % C16 * 16 + lane))
                    h = T.meta_var((vm // OW) % OH * SH + ky * DH - PT)
                    w = T.meta_var(vm % OW * SW + kx * DW - PL)
                    T.reads(data[vm // OHW, h, w, c])
                    T.writes(A[vm, vk])
                    A[vm, vk] = T.if_then_else(vm < M and 0 <= h and h < H and 0 <= w and w < W,
                                               data[vm // OHW, h, w, c], T.int8(ZERO))
            for m, o, k in T.grid(MP, Op, K):
                with T.sblock("conv"):
                    vm, vo, vk = T.axis.remap("SSR", [m, o, k])
                    T.reads(A[vm, a_column(vo, vk)], weight[vo, vk])
                    T.writes(C[vm, vo])
                    with T.init():
                        C[vm, vo] = 0
                    C[vm, vo] = C[vm, vo] + T.Cast("int32", A[vm, a_column(vo, vk)]) * T.Cast("int32", weight[vo, vk])
            for m, o in T.grid(MP, Op):
                with T.sblock("requant"):
                    vm, vo = T.axis.remap("SS", [m, o])
                    b = T.meta_var(bias_at(wl, bias, vm, vo, table))
                    if RES is not None:
                        T.reads(C[vm, vo], b, mult[vo], shift[vo],
                                RES[vm // OHW, (vm // OW) % OH, vm % OW, vo], ADD[0:3])
                    elif LUT is None:
                        T.reads(C[vm, vo], b, mult[vo], shift[vo])
                    else:
                        T.reads(C[vm, vo], b, mult[vo], shift[vo], LUT[0:256])
                    T.writes(out[vm // OHW, (vm // OW) % OH, vm % OW, vo])
                    if vm < M:
                        out[vm // OHW, (vm // OW) % OH, vm % OW, vo] = epilogue_residual.finish(
                            epilogue_table.finish(requantize_tir(
                                T.Cast("int64", C[vm, vo]) + T.Cast("int64", b), mult[vo], shift[vo], LO, HI),
                                vo, LUT, wl.out_channels),
                            None if RES is None else RES[vm // OHW, (vm // OW) % OH, vm % OW, vo], ADD, wl)

    main = epilogue_residual.with_params(epilogue_table.with_table_param(main, LUT), RES, ADD)
    return main.with_attr({"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict())})


def _gather_at(wl: ConvWorkload, vm, vk):
    """The im2col gather of the int32 forms: ``(n, h, w, c)`` that GEMM element ``A[vm, vk]`` reads
    and whether it lies inside the image (as :func:`conv2d_nhwc_int8`'s gather; its comments)."""
    M, _, _, _ = gemm_shape(wl)
    OH, OW, KW = wl.out_height, wl.out_width, wl.kernel[1]
    C16 = ceil32(wl.in_channels) // 16
    k16 = vk // 16
    ky, kx, c = k16 // (KW * C16), k16 // C16 % KW, k16 % C16 * 16 + vk % 16
    h = (vm // OW) % OH * wl.stride[0] + ky * wl.dilation[0] - wl.padding[0]
    w = vm % OW * wl.stride[1] + kx * wl.dilation[1] - wl.padding[1]
    zero = tirx.const(0, "int32")     # 0 <= h, not h >= 0: the TIR the script form wrote
    return (vm // (OH * OW), h, w, c), tirx.all(vm < M, zero <= h, h < wl.height, zero <= w, w < wl.width)


def conv2d_nhwc_int32(wl: ConvWorkload) -> tirx.PrimFunc:
    """Unscheduled PrimFunc ``(data, weight, out)``: the implicit GEMM of :func:`conv2d_nhwc_int8`
    with the int32 accumulators stored, ``out`` int32 ``[N, OH, OW, O_p]`` (the training path's
    forward; no bias, no requantization, one group).

    With ``wl.splits = S > 1`` the reduction is split into S slices of ``K / S`` (split-K: the
    training path's weight gradient, ``schedules/training/grad_weight_mma.py``): ``out`` is
    ``[S, N, OH, OW, O_p]``, slice ``s`` holding ``sum_{k in [s K/S, (s+1) K/S)} A[m, k] W[o, k]``,
    and ``mma.py`` binds ``s`` to ``blockIdx.y``.  Each slice must be whole 32-wide mma steps."""
    assert (wl.groups == 1 and wl.out_dtype == "int32" and wl.in_zero == 0 and not wl.table and not wl.residual
            and not wl.norm), wl
    N, H, W = wl.batch, wl.height, wl.width
    Cp = ceil32(wl.in_channels)
    M, MP, Op, K = gemm_shape(wl)
    OH, OW = wl.out_height, wl.out_width
    OHW = OH * OW
    S = wl.splits
    if K % (32 * S):
        raise ValueError(f"{wl.describe()}: K = {K} does not split into {S} slices of whole 32-wide mma steps")
    KS = K // S
    if S == 1:
        @T.prim_func(s_tir=True)
        def main(data: T.Buffer((N, H, W, Cp), "int8"), weight: T.Buffer((Op, K), "int8"),
                 out: T.Buffer((N, OH, OW, Op), "int32")):
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            with T.sblock("root"):
                A = T.sblock_alloc_buffer((MP, K), "int8")
                C = T.sblock_alloc_buffer((MP, Op), "int32")
                for m, k in T.grid(MP, K):
                    with T.sblock("im2col"):
                        vm, vk = T.axis.remap("SS", [m, k])
                        at, inside = T.meta_var(_gather_at(wl, vm, vk))
                        T.reads(data[at])
                        T.writes(A[vm, vk])
                        A[vm, vk] = T.if_then_else(inside, data[at], T.int8(0))
                for m, o, k in T.grid(MP, Op, K):
                    with T.sblock("conv"):
                        vm, vo, vk = T.axis.remap("SSR", [m, o, k])
                        with T.init():
                            C[vm, vo] = 0
                        C[vm, vo] = C[vm, vo] + T.Cast("int32", A[vm, vk]) * T.Cast("int32", weight[vo, vk])
                for m, o in T.grid(MP, Op):
                    with T.sblock("requant"):   # the epilogue block mma.py schedules: here a store
                        vm, vo = T.axis.remap("SS", [m, o])
                        T.reads(C[vm, vo])
                        T.writes(out[vm // OHW, (vm // OW) % OH, vm % OW, vo])
                        if vm < M:
                            out[vm // OHW, (vm // OW) % OH, vm % OW, vo] = C[vm, vo]
    else:
        @T.prim_func(s_tir=True)
        def main(data: T.Buffer((N, H, W, Cp), "int8"), weight: T.Buffer((Op, K), "int8"),
                 out: T.Buffer((S, N, OH, OW, Op), "int32")):
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            with T.sblock("root"):
                A = T.sblock_alloc_buffer((MP, K), "int8")
                C = T.sblock_alloc_buffer((S, MP, Op), "int32")
                for m, k in T.grid(MP, K):
                    with T.sblock("im2col"):
                        vm, vk = T.axis.remap("SS", [m, k])
                        at, inside = T.meta_var(_gather_at(wl, vm, vk))
                        T.reads(data[at])
                        T.writes(A[vm, vk])
                        A[vm, vk] = T.if_then_else(inside, data[at], T.int8(0))
                for s, m, o, k in T.grid(S, MP, Op, KS):
                    with T.sblock("conv"):
                        vs, vm, vo, vk = T.axis.remap("SSSR", [s, m, o, k])
                        with T.init():
                            C[vs, vm, vo] = 0
                        C[vs, vm, vo] = C[vs, vm, vo] + (T.Cast("int32", A[vm, vs * KS + vk])
                                                         * T.Cast("int32", weight[vo, vs * KS + vk]))
                for s, m, o in T.grid(S, MP, Op):
                    with T.sblock("requant"):
                        vs, vm, vo = T.axis.remap("SSS", [s, m, o])
                        T.reads(C[vs, vm, vo])
                        T.writes(out[vs, vm // OHW, (vm // OW) % OH, vm % OW, vo])
                        if vm < M:
                            out[vs, vm // OHW, (vm // OW) % OH, vm % OW, vo] = C[vs, vm, vo]

    return main.with_attr({"tvm_qconv.kernel": "conv2d_nhwc_int32", "tvm_qconv.workload": str(wl.to_dict())})


def conv2d_nhwc_int32_ref(wl: ConvWorkload, data, weight) -> np.ndarray:
    """NumPy reference of :func:`conv2d_nhwc_int32`: int32 ``[N, OH, OW, O_p]`` accumulators, or
    ``[S, N, OH, OW, O_p]``, each slice's, for ``wl.splits = S > 1``."""
    if wl.splits == 1:
        return _accumulate(wl, data, weight, 0).astype(np.int32)
    K = weight.shape[1]
    ks = K // wl.splits
    slices = []
    for s in range(wl.splits):    # slice s: only its columns of the weight, the others 0
        w_s = np.zeros_like(weight)
        w_s[:, s * ks:(s + 1) * ks] = weight[:, s * ks:(s + 1) * ks]
        slices.append(_accumulate(wl, data, w_s, 0).astype(np.int32))
    return np.stack(slices)


def _accumulate(wl: ConvWorkload, data, weight, pad_value: int) -> np.ndarray:
    """float64 ``[N, OH, OW, O_p]`` sums of the packed operands, the input padded with ``pad_value``.

    Through BLAS in float64: every partial sum of int8 x int8 products over K <= 2**20 is an integer
    below 2**35 < 2**53, so float64 is exact (and far faster than an int64 matmul on big layers)."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    n, _, _, cp = data.shape
    op = weight.shape[0]
    wk = weight.reshape(op, kh, kw, cp).astype(np.float64)
    dp = np.pad(data, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=pad_value)
    acc = np.zeros((n, oh, ow, op), np.float64)
    for y in range(kh):
        for x in range(kw):
            win = dp[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, x * dw: x * dw + (ow - 1) * sw + 1: sw, :]
            acc += win.astype(np.float64) @ wk[:, y, x, :].T
    return acc


def bias_at(wl: ConvWorkload, bias, m, o, table: bool):
    """``bias[o]``, or for the ``border`` form the table's entry of GEMM row ``m``'s border class."""
    return bias[border_bias.table_row(wl, m), o] if table else bias[o]


def conv2d_nhwc_int8_ref(wl: ConvWorkload, data, weight, bias, mult, shift) -> np.ndarray:
    """NumPy reference on the packed layouts; returns int8 [N, OH, OW, O_p]: the exact sums
    (:func:`_accumulate`), then the int64 fixed-point requantization."""
    oh, ow = wl.out_height, wl.out_width
    table = bias.ndim == 2      # the ``border`` form: pads with 0, a bias per border class
    acc = _accumulate(wl, data, weight, 0 if table else wl.in_zero)
    if table:   # [OH, OW, O_p]: each pixel's row
        bias = bias[border_bias.table_row(wl, np.arange(oh * ow), np.minimum, np.maximum)].reshape(oh, ow, -1)
    return requantize_ref(acc.astype(np.int64) + bias.astype(np.int64), mult, shift, wl.act_min, wl.act_max)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """OIHW [O, C, KH, KW] -> int8 [O_p, KH*KW*C_p], padded input and output channels 0."""
    o, c, kh, kw = w.shape
    out = np.zeros((ceil32(o), kh, kw, ceil32(c)), np.int8)
    out[:o, :, :, :c] = w.transpose(0, 2, 3, 1)
    return out.reshape(out.shape[0], -1)


def pack_channels(v: np.ndarray, fill=0) -> np.ndarray:
    """Per-output-channel vector [O] -> [O_p]; padded entries ``fill`` (0 for bias and mult, 1
    for shift: the smallest legal shift), so padded output channels are exactly 0."""
    out = np.full(ceil32(v.shape[0]), fill, v.dtype)
    out[: v.shape[0]] = v
    return out
