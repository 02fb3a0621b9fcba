"""The training path's input gradient: ``dx = conv_transpose(dL/dy * s_w, w_q)`` with int8 weights, float32 sums.

Read top to bottom: the compute definition (:func:`conv2d_grad_input_int8`), the
NumPy reference (:func:`conv2d_grad_input_int8_ref`) and the CUDA schedule
(:func:`schedule_grad_input_cuda`).

Math (the STE backward of ``y = conv(x_q, w_q) * s_x * s_w[o] + b``, before the input
quantizer's ``s_x`` cancels against its straight-through ``1/s_x``)::

    dx[n, c, h, w] = sum_{o in c's group, r, s}  g[n, o, y, x] * s_w[o] * w_q[o, c % Cg, r, s]
                     where h + pad_top  = y * stride_h + r * dil_h
                           w + pad_left = x * stride_w + s * dil_w

computed as a *direct convolution* of the gradient, dilated by the stride (zeros between rows
and columns) and padded by ``(k - 1) * dil - pad``, with the spatially flipped weights.  Three
choices, each for a reason:

* The per-output-channel weight scale is folded into the gradient (``grad_pad`` stage), not into
  the weights: the gradient is staged through shared memory anyway, so the scale costs one
  multiply per staged element and the int8 weights stay int8 (1 byte each in shared memory).
* Groups are an explicit axis: ``x`` is viewed ``(N, G, Cg, H, W)``, ``g`` ``(N, G, Og, OH, OW)``
  and ``w`` ``(G, Og, Cg, KH, KW)`` (all free views of contiguous NCHW / OIHW), so a block's
  shared tiles never span two groups (a depthwise layer would otherwise stage every channel).
* Stride > 1 runs the zero-inserted gradient through the same direct convolution (stride^2
  wasted multiply-adds by zeros).  No VGG layer strides; a phase-decomposed kernel is the
  upgrade if a strided model ever needs it.

Sums are float32 like cuDNN's; the tests compare against a float64 reference.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from ..kernel import KernelImpl
from ..sched_utils import divisor_at_most, loops_under
from ..workload import ConvWorkload

KERNEL_NAME = "conv2d_grad_input_int8"


# ----------------------------------------------------------------------------- compute

def conv2d_grad_input_int8(wl: ConvWorkload) -> tirx.PrimFunc:
    """Compute definition (unscheduled PrimFunc) of ``dx`` for one workload.

    Params: Grad float32 (N, G, Og, OH, OW); W int8 (G, Og, Cg, KH, KW); WScale float32 (G, Og);
    returns DX float32 (N, G, Cg, H, W).  Blocks: ``grad_pad`` (the scaled, stride-dilated and
    padded gradient; a schedule stages it through shared memory) and ``dx`` (float32 reduction
    over ``ro, rr, rs``).
    """
    n_, g_, cg, og = wl.batch, wl.groups, wl.group_in, wl.group_out
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, _, _ = wl.padding
    oh, ow = wl.out_height, wl.out_width
    grad = te.placeholder((n_, g_, og, oh, ow), "float32", name="Grad")
    w = te.placeholder((g_, og, cg, kh, kw), "int8", name="W")
    w_scale = te.placeholder((g_, og), "float32", name="WScale")
    # Row u of the padded, dilated gradient is gradient row (u - top) / sh when that is whole.
    top, left = (kh - 1) * dh - pt, (kw - 1) * dw - pl

    def staged(n, g, o, u, v):
        uu, vv = u - top, v - left
        inside = tirx.all(uu >= 0, vv >= 0, tirx.floormod(uu, sh) == 0, tirx.floormod(vv, sw) == 0,
                          tirx.floordiv(uu, sh) < oh, tirx.floordiv(vv, sw) < ow)
        return tirx.if_then_else(inside, grad[n, g, o, tirx.floordiv(uu, sh), tirx.floordiv(vv, sw)] * w_scale[g, o],
                                 tirx.const(0.0, "float32"))

    gpad = te.compute((n_, g_, og, wl.height + (kh - 1) * dh, wl.width + (kw - 1) * dw), staged, name="grad_pad")
    ro = te.reduce_axis((0, og), name="ro")
    rr = te.reduce_axis((0, kh), name="rr")
    rs = te.reduce_axis((0, kw), name="rs")
    dx = te.compute(
        (n_, g_, cg, wl.height, wl.width),
        lambda n, g, c, h, x: te.sum(
            gpad[n, g, ro, h + rr * dh, x + rs * dw] * w[g, ro, c, kh - 1 - rr, kw - 1 - rs].astype("float32"),
            axis=[ro, rr, rs]),
        name="dx")
    return te.create_prim_func([grad, w, w_scale, dx]).with_attr(
        {"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.workload": str(wl.to_dict())})


def conv2d_grad_input_int8_ref(grad, w, w_scale, wl: ConvWorkload) -> np.ndarray:
    """NumPy float64 reference of :func:`conv2d_grad_input_int8` (NCHW grad, OIHW int8 w, (O,) scale).

    A scatter, written independently of the gather above: every output-gradient element adds
    ``g * s_w * w`` to the input positions its window read.  Returns float64 (N, C, H, W).
    """
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    n_, cg, og = wl.batch, wl.group_in, wl.group_out
    oh, ow = wl.out_height, wl.out_width
    gs = grad.astype(np.float64) * w_scale.astype(np.float64)[None, :, None, None]
    dxp = np.zeros((n_, wl.in_channels, wl.height + pt + pb, wl.width + pl + pr))
    for gi in range(wl.groups):
        gg = gs[:, gi * og:(gi + 1) * og]
        wg = w[gi * og:(gi + 1) * og].astype(np.float64)
        for r in range(kh):
            for s in range(kw):
                contrib = np.einsum("noyx,oc->ncyx", gg, wg[:, :, r, s], optimize=True)  # to BLAS
                dxp[:, gi * cg:(gi + 1) * cg, r * dh:r * dh + (oh - 1) * sh + 1:sh,
                    s * dw:s * dw + (ow - 1) * sw + 1:sw] += contrib
    return dxp[:, :, pt:pt + wl.height, pl:pl + wl.width]


# ----------------------------------------------------------------------------- CUDA schedule

# Heuristic tile caps (H100/H200-class; not tuned).
MAX_C_REG = 8      # input channels per thread (registers)
MAX_Y_REG = 2      # input rows per thread (registers)
MAX_XT = 32        # threads along the width: a warp reads 32 consecutive staged floats
MAX_THREADS = 256
MAX_RO = 16        # output channels staged per shared tile
SMEM_TARGET = 24 * 1024


def cooperative_fetch(sch, block, at_loop, nthreads: int) -> None:
    """Spread a shared-memory staging block (placed under ``at_loop``) over the block's threads:
    its copy loops fused, split by ``nthreads``, consecutive threads on consecutive elements."""
    own = loops_under(sch, block, at_loop)
    if not own:
        return
    fused = sch.fuse(*own) if len(own) > 1 else own[0]
    _, tx = sch.split(fused, [None, nthreads])
    sch.bind(tx, "threadIdx.x")


def schedule_grad_input_cuda(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """Schedule :func:`conv2d_grad_input_int8` for CUDA: shared-memory tiles, register accumulators.

    Tiling, outermost first::

        blockIdx.z  n * G * (Cg / CB)     blockIdx.y  H / YB     blockIdx.x  W / XT
        threadIdx.x (CT, YT, XT)          columns fastest: a warp reads 32 consecutive staged
                                          gradient floats (no bank conflict) and writes 32
                                          consecutive dx floats (coalesced)
          ro / RO                         shared tiles: grad_pad [RO, YB + halo, XT + halo]
                                          (scaled while staged) and int8 W [RO, CB, kh, kw]
            ro % RO, rr, rs
              CR, YR (unrolled)           CR x YR float32 accumulators per thread

        CB = CT*CR channels, YB = YT*YR rows.  Tile sizes divide their extents (no predicates).

    Args:
        func: the unscheduled PrimFunc.
        target: CUDA target (``max_shared_memory_per_block``, ``max_threads_per_block`` read).

    Returns:
        The scheduled PrimFunc with ``tir.is_scheduled``.
    """
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    smem_max = min(SMEM_TARGET, int(target.attrs.get("max_shared_memory_per_block", 49152)))
    max_threads = min(MAX_THREADS, int(target.attrs.get("max_threads_per_block", 1024)))
    sch = tvm.s_tir.Schedule(func)
    dx, gpad = sch.get_sblock("dx"), sch.get_sblock("grad_pad")
    n, g, c, y, x, ro, rr, rs = sch.get_loops(dx)
    cg, h, w, og, kh, kw = (int(sch.get(l).extent) for l in (c, y, x, ro, rr, rs))
    dh, dw = ConvWorkload.of(func).dilation

    xt = divisor_at_most(w, MAX_XT)
    yr = divisor_at_most(h, MAX_Y_REG)
    cr = divisor_at_most(cg, MAX_C_REG)
    yt = divisor_at_most(h // yr, max(1, 128 // xt))
    ct = divisor_at_most(cg // cr, max(1, max_threads // (xt * yt)))
    threads = ct * yt * xt
    rows, cols = yt * yr + (kh - 1) * dh, xt + (kw - 1) * dw
    per_ro = 4 * rows * cols + ct * cr * kh * kw
    ro_tile = divisor_at_most(og, min(MAX_RO, max(1, smem_max // per_ro)))

    c_b, c_t, c_r = sch.split(c, [None, ct, cr])
    y_b, y_t, y_r = sch.split(y, [None, yt, yr])
    x_b, x_t = sch.split(x, [None, xt])
    ro_o, ro_i = sch.split(ro, [None, ro_tile])
    sch.reorder(n, g, c_b, y_b, x_b, c_t, y_t, x_t, ro_o, ro_i, rr, rs, c_r, y_r)
    sch.bind(sch.fuse(n, g, c_b), "blockIdx.z")
    sch.bind(y_b, "blockIdx.y")
    sch.bind(x_b, "blockIdx.x")
    tx = sch.fuse(c_t, y_t, x_t)
    sch.bind(tx, "threadIdx.x")

    acc = sch.cache_write(dx, 0, "local")
    sch.reverse_compute_at(acc, tx)
    sch.set_scope(gpad, 0, "shared")
    sch.compute_at(gpad, ro_o)
    cooperative_fetch(sch, gpad, ro_o, threads)
    w_sh = sch.cache_read(dx, 1, "shared")
    sch.compute_at(w_sh, ro_o)
    cooperative_fetch(sch, w_sh, ro_o, threads)

    init = sch.decompose_reduction(dx, ro_o)
    for loop in [rr, rs, c_r, y_r] + loops_under(sch, init, tx) + loops_under(sch, acc, tx):
        sch.unroll(loop)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


class SimtGradKernel(KernelImpl):
    """A gradient kernel of the training path: scheduled on CUDA (``SCHEDULES``), unscheduled on
    llvm (the CPU tests).  Subclasses give ``compute_fn`` and ``reference_fn``."""

    layout = "NCHW"
    family = "simt"
    SCHEDULES: dict = {}  # target kind -> schedule; other kinds run unscheduled
    compute_fn = None
    reference_fn = None

    def applies(self, wl, target) -> bool:
        return target.kind in ("cuda", "llvm")

    def compute(self, wl: ConvWorkload):
        return self.tag(type(self).compute_fn(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return type(self).reference_fn(*args, wl)

    def schedule(self, func, target):
        rule = self.SCHEDULES.get(target.kind.name)
        return rule(func, target) if rule else None


class GradInput(SimtGradKernel):
    """``dx`` of the training path's int8 conv."""

    name = "conv2d_grad_input.nchw.simt"
    op = "conv2d_grad_input"
    SCHEDULES = {"cuda": schedule_grad_input_cuda}
    compute_fn = conv2d_grad_input_int8
    reference_fn = conv2d_grad_input_int8_ref


GRAD_INPUT = GradInput()
