"""The training path's weight gradient on int8 tensor cores: ``dw`` as a split-K int8 conv.

With the gradient quantized to int8 per output channel (``g ~ g_q[o] * s_g[o]``,
``tvm_qconv/nn/functional.py``), the weight gradient of a one-group conv is an exact int32 sum::

    dw[o, c, ky, kx] = s_x * s_g[o] * sum_{n, y, x} g_q[n, o, y, x] * x_q[n, c, y*sh + ky*dh - top, x*sw + kx*dw - left]

and that sum is itself a convolution, of the input with the gradient as its kernel: take the
input's channels ``c`` as the batch and its batch ``n`` as the channels (``x^T``: ``[C, N, H,
W]``), the gradient as the weight (``g^T``: ``[O, N, OH, OW]``, a kernel of ``OH x OW`` taps),
the forward's dilation as the stride and its stride as the dilation: the output ``[C, O, KH, KW]``
is ``dw`` transposed.  So the forward's own implicit GEMM on ``mma.sync``
(``schedules/tensorcore/conv2d.py``, :func:`conv2d_nhwc_int32`) computes it, with both operands
K-major as ``mma.row.col`` needs (the reduction ``(y, x, n)`` runs along ``n``, the NHWC32
channels, 16 contiguous bytes per copy):

    GEMM  M = C * KH * KW,  N = O_p,  K = OH * OW * ceil32(N)

K is long (1.6 M for VGG16's first convs at batch 32) and M x N small (576 x 64), so the
reduction is split into ``splits`` slices (split-K, :func:`weight_grad_splits`): a grid of
about ``BLOCKS_PER_SM`` x SMs blocks, each slice's int32 sums stored on their own and added by
the caller in int64.  A slice is at most ``MAX_SLICE`` long, so its int32 sum cannot overflow
(127 * 127 * 2**17 < 2**31).

What the tensor cores cannot take is None here and runs the float32 kernel
(``grad_weight.py``): grouped convs, and a batch under 16 (the batch is the GEMM's channels:
padded to 32, at 16 half of each mma step is padding, below it most).
"""
from __future__ import annotations

from tvm_qconv.target import TargetInfo

from ..tensorcore import conv2d, mma
from ..tensorcore.impls import MIN_IN_CHANNELS
from ..workload import ConvWorkload

BLOCKS_PER_SM = 2       # two 96 KB blocks fit an SM (mma.DYN_SMEM_BUDGET)
MAX_SLICE = 2**17       # K per slice: 127 * 127 * 2**17 < 2**31, the int32 sum is exact
MIN_SLICE = 4096        # K per slice at least (32 steps of 128): the pipeline's fill amortized


def weight_grad_conv(wl: ConvWorkload, target: TargetInfo) -> ConvWorkload | None:
    """The int32 conv whose output is ``dw`` of the one-group conv ``wl`` (module docstring), with
    its split; None where the tensor cores cannot take it.

    Its output ``[splits, C, KH', KW', O_p]`` has ``KH' >= KH`` rows: where the forward leaves
    rows of the padded input unread (a stride that does not divide it), no padding makes the
    output exactly ``KH``; the rows past ``KH`` are the caller's to drop.
    """
    if wl.groups != 1 or wl.batch < MIN_IN_CHANNELS or not (target.kind == "cuda" and target.has_int8_mma):
        return None
    oh, ow = wl.out_height, wl.out_width
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    top, left = wl.padding[:2]
    bottom = max(0, (kh - 1) * dh + sh * (oh - 1) + 1 - wl.height - top)
    right = max(0, (kw - 1) * dw + sw * (ow - 1) + 1 - wl.width - left)
    conv = ConvWorkload(wl.in_channels, wl.batch, wl.height, wl.width, wl.out_channels, (oh, ow), (dh, dw),
                        (top, left, bottom, right), (sh, sw), activation="none", act_min=-127, out_dtype="int32")
    if conv2d.gemm_shape(conv)[0] == 16:     # mma.py's one-fragment GEMM (Conv2dMma.applies)
        return None
    return ConvWorkload(**{**conv.__dict__, "splits": weight_grad_splits(conv, target.num_sm)})


def weight_grad_splits(conv: ConvWorkload, num_sm: int) -> int:
    """The split count of ``conv``'s reduction: the fewest slices that bring the grid (at the
    default tile, ``mma.default_decisions``) to ``BLOCKS_PER_SM`` blocks per SM, keep each slice
    at most ``MAX_SLICE`` (exact int32) and, where that allows, at least ``MIN_SLICE``; a divisor
    of ``K / 32`` (whole mma steps per slice)."""
    _, mp, op, k = conv2d.gemm_shape(conv)
    steps = k // 32
    decisions, _ = mma.default_decisions(mp, op, k, num_sm)
    blocks = decisions["m"][0] * decisions["o"][0]
    least = -(-k // MAX_SLICE)
    want = max(least, min(-(-BLOCKS_PER_SM * num_sm // blocks), k // MIN_SLICE))
    return next(d for d in range(want, steps + 1) if steps % d == 0)
