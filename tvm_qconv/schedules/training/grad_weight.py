"""The training path's weight gradient: ``dw = correlate(dL/dy, x_q) * s_x`` with the int8 input, float32 sums.

Read top to bottom: the split plan (:func:`weight_grad_splits`), the compute definition
(:func:`conv2d_grad_weight_int8`), the NumPy reference (:func:`conv2d_grad_weight_int8_ref`)
and the CUDA schedule (:func:`schedule_grad_weight_cuda`).  The workload is
:class:`schedules.workload.ConvWorkload`.

Math (the STE backward of ``y = conv(x_q * s_x, w) + b``)::

    dw[o, c, r, s] = s_x * sum_{n, y, x} g[n, o, y, x] * x_q[n, g*Cg + c, y*sh + r*dh - top, x*sw + s*dw - left]

A GEMM with M = out channels, N = Cg * KH * KW and a long reduction K = batch * OH * OW
(1.6 M for VGG16's first layers at batch 32) over a small output (37 k weights for 64 -> 64):
one block per output tile would leave the GPU idle, so the reduction is split (split-K) over
``S`` contiguous chunks of the ``N * OH`` gradient rows, and the kernel writes ``S`` partial
sums ``Part[S, G, Og, Cg, KH, KW]``; the caller adds them (``Part.sum(0)``; no sum when S = 1).

Why the partials are a *parameter* and not a TVM-allocated intermediate: TVM allocates a
PrimFunc's global intermediates through its own device API, outside PyTorch's caching
allocator, where neither ``torch.cuda.max_memory_allocated`` nor the allocator's reuse sees
them.  Every byte these kernels use is a torch tensor the caller passed in.

``s_x`` is folded into the gradient while it is staged through shared memory (``grad_scaled``),
so the partial sums are already ``dw``'s: no elementwise pass over a 400 MB classifier gradient.
The input is staged as int8 (1 byte per element in shared memory) and widened at the multiply.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from tvm_qconv.target import TYPICAL_SM_COUNT, TargetInfo

from ..sched_utils import divisor_at_most, loops_under
from ..workload import ConvWorkload
from .grad_input import SimtGradKernel, cooperative_fetch

KERNEL_NAME = "conv2d_grad_weight_int8"

# Split-K plan (see weight_grad_splits).
BLOCKS_PER_SM = 4                # the grid aims at ~4 blocks per SM
MAX_PARTIAL_FLOATS = 16 * 2**20  # 64 MiB of partial sums at most
# The GPU a split is planned for when the caller names none: an sm_90 of the typical SM count
# (H100 SXM / H200), not the local device.  The split count is the shape of the kernel's Part
# argument, which the caller allocates, and the kernel cache (``tvm_qconv/nn/tvm_kernels.py``)
# is keyed by arch: a plan following the local SM count would let two sm_90 GPUs (H100 PCIe:
# 114 SMs, SXM: 132) share a cached kernel of the wrong Part shape.  A caller that keys its
# kernels by the plan passes the device's TargetInfo.
DEFAULT_TARGET = TargetInfo(kind="cuda", arch="sm_90", num_sm=TYPICAL_SM_COUNT["sm_90"])

# Heuristic tile caps (H100/H200-class; not tuned).
MAX_O_REG = 2      # output channels per thread (registers), x KH*KW taps each
MAX_C_REG = 2      # input channels per thread
MAX_OT = 16        # threads along output channels
MAX_CT = 16        # threads along input channels
MAX_XB = 32        # gradient columns staged per shared tile


def weight_grad_splits(wl: ConvWorkload, target: TargetInfo | None = None) -> int:
    """How many chunks ``S`` the reduction over the ``N * OH`` gradient rows is split into.

    The largest divisor of ``N * OH`` (whole rows per chunk: a staged tile never crosses an
    image) that brings the grid to about BLOCKS_PER_SM x ``target.num_sm`` blocks, keeping the
    partial sums below MAX_PARTIAL_FLOATS.  A divisor because a chunk of rows must not run past
    the tensor.

    Args:
        wl: the conv.
        target: the GPU; default :data:`DEFAULT_TARGET` (its comment says why not the local one).
    """
    target_blocks = BLOCKS_PER_SM * (target or DEFAULT_TARGET).num_sm
    rows = wl.batch * wl.out_height
    o_blocks = -(-wl.group_out // (MAX_O_REG * MAX_OT))
    c_blocks = -(-wl.group_in // (MAX_C_REG * MAX_CT))
    blocks = wl.groups * o_blocks * c_blocks
    weights = wl.out_channels * wl.group_in * wl.kernel[0] * wl.kernel[1]
    want = max(1, min(target_blocks // blocks, MAX_PARTIAL_FLOATS // weights))
    return divisor_at_most(rows, want)


# ----------------------------------------------------------------------------- compute

def conv2d_grad_weight_int8(wl: ConvWorkload, splits: int | None = None) -> tirx.PrimFunc:
    """Compute definition (unscheduled PrimFunc) of the split-K weight gradient.

    Params: Grad float32 (N, G, Og, OH, OW); X int8 (N, G, Cg, H, W); XScale float32 (1,);
    returns Part float32 (S, G, Og, Cg, KH, KW), ``S = splits`` (default
    :func:`weight_grad_splits`).  Blocks: ``grad_scaled`` (g * s_x), ``input_pad`` (zero-padded
    int8 input) and ``dw`` (float32 reduction over ``rj`` rows of the chunk and ``rx`` columns).
    """
    s_ = weight_grad_splits(wl) if splits is None else splits
    n_, g_, cg, og = wl.batch, wl.groups, wl.group_in, wl.group_out
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    if (n_ * oh) % s_:
        raise ValueError(f"splits={s_} must divide batch * out_height = {n_ * oh}")
    chunk = n_ * oh // s_
    grad = te.placeholder((n_, g_, og, oh, ow), "float32", name="Grad")
    x = te.placeholder((n_, g_, cg, wl.height, wl.width), "int8", name="X")
    x_scale = te.placeholder((1,), "float32", name="XScale")
    gs = te.compute(grad.shape, lambda *i: grad(*i) * x_scale[0], name="grad_scaled")
    xpad = te.compute(
        (n_, g_, cg, wl.height + pt + pb, wl.width + pl + pr),
        lambda n, g, c, h, w: tirx.if_then_else(
            tirx.all(h >= pt, h < pt + wl.height, w >= pl, w < pl + wl.width),
            x[n, g, c, h - pt, w - pl], tirx.const(0, "int8")),
        name="input_pad")
    rj = te.reduce_axis((0, chunk), name="rj")
    rx = te.reduce_axis((0, ow), name="rx")

    def body(s, g, o, c, r, q):
        row = s * chunk + rj
        n, y = tirx.floordiv(row, oh), tirx.floormod(row, oh)
        return te.sum(gs[n, g, o, y, rx] * xpad[n, g, c, y * sh + r * dh, rx * sw + q * dw].astype("float32"),
                      axis=[rj, rx])

    part = te.compute((s_, g_, og, cg, kh, kw), body, name="dw")
    return te.create_prim_func([grad, x, x_scale, part]).with_attr(
        {"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict()), "tvm_qconv.splits": s_})


def conv2d_grad_weight_int8_ref(grad, x, x_scale: float, wl: ConvWorkload) -> np.ndarray:
    """NumPy float64 reference: NCHW grad, NCHW int8 x -> dw (O, Cg, KH, KW), already summed over splits."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    cg, og = wl.group_in, wl.group_out
    oh, ow = wl.out_height, wl.out_width
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    g64 = grad.astype(np.float64)
    out = np.zeros((wl.out_channels, cg, kh, kw))
    for gi in range(wl.groups):
        for r in range(kh):
            for s in range(kw):
                win = xp[:, gi * cg:(gi + 1) * cg, r * dh:r * dh + (oh - 1) * sh + 1:sh,
                         s * dw:s * dw + (ow - 1) * sw + 1:sw]
                # optimize=True: the contraction goes to BLAS (tensordot), not einsum's C loops
                out[gi * og:(gi + 1) * og, :, r, s] = np.einsum("noyx,ncyx->oc", g64[:, gi * og:(gi + 1) * og], win,
                                                                optimize=True)
    return out * float(x_scale)


# ----------------------------------------------------------------------------- CUDA schedule

def schedule_grad_weight_cuda(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """Schedule :func:`conv2d_grad_weight_int8` for CUDA: shared-memory tiles, register accumulators.

    Tiling, outermost first::

        blockIdx.y  S * G                 one reduction chunk of one group
        blockIdx.x  (Og / OB) * (Cg / CB) one output tile
        threadIdx.x (OT, CT)              input channels fastest
          rj                              one gradient row per step (its image and row are
                                          fixed, so the staged tiles are exact)
            rx / XB                       shared tiles: g * s_x [OB, XB] and the int8 input
                                          [CB, (KH-1)*dh + 1, (XB-1)*sw + (KW-1)*dw + 1]
              rx % XB
                OR, CR, KH, KW (unrolled) OR x CR x KH x KW float32 accumulators per thread

        OB = OT*OR, CB = CT*CR.  Tile sizes divide their extents (no predicates).

    Args:
        func: the unscheduled PrimFunc.
        target: CUDA target (``max_threads_per_block`` read).

    Returns:
        The scheduled PrimFunc with ``tir.is_scheduled``.
    """
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    max_threads = int(target.attrs.get("max_threads_per_block", 1024))
    sch = tvm.s_tir.Schedule(func)
    dw_blk = sch.get_sblock("dw")
    s, g, o, c, r, q, rj, rx = sch.get_loops(dw_blk)
    og, cg, ow = (int(sch.get(l).extent) for l in (o, c, rx))
    orr, crr = divisor_at_most(og, MAX_O_REG), divisor_at_most(cg, MAX_C_REG)
    ct = divisor_at_most(cg // crr, MAX_CT)
    ot = divisor_at_most(og // orr, min(MAX_OT, max(1, max_threads // ct)))
    xb = divisor_at_most(ow, MAX_XB)

    o_b, o_t, o_r = sch.split(o, [None, ot, orr])
    c_b, c_t, c_r = sch.split(c, [None, ct, crr])
    rx_o, rx_i = sch.split(rx, [None, xb])
    sch.reorder(s, g, o_b, c_b, o_t, c_t, rj, rx_o, rx_i, o_r, c_r, r, q)
    sch.bind(sch.fuse(s, g), "blockIdx.y")
    sch.bind(sch.fuse(o_b, c_b), "blockIdx.x")
    tx = sch.fuse(o_t, c_t)
    sch.bind(tx, "threadIdx.x")

    acc = sch.cache_write(dw_blk, 0, "local")
    sch.reverse_compute_at(acc, tx)
    gs, xpad = sch.get_sblock("grad_scaled"), sch.get_sblock("input_pad")
    for stage in (gs, xpad):
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, rx_o)
        cooperative_fetch(sch, stage, rx_o, ot * ct)

    init = sch.decompose_reduction(dw_blk, rj)
    for loop in [o_r, c_r, r, q] + loops_under(sch, init, tx) + loops_under(sch, acc, tx):
        sch.unroll(loop)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


class GradWeight(SimtGradKernel):
    """``dw`` (split-K partial sums) of the training path's int8 conv."""

    name = "conv2d_grad_weight.nchw.simt"
    op = "conv2d_grad_weight"
    SCHEDULES = {"cuda": schedule_grad_weight_cuda}
    compute_fn = conv2d_grad_weight_int8
    reference_fn = conv2d_grad_weight_int8_ref


GRAD_WEIGHT = GradWeight()
