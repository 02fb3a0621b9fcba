"""``BatchNormReLU``'s per-channel arithmetic, one kernel a pass: its statistics finished (forward)
and its gradient's coefficients (backward) from the float64 channel sums.

In torch each is a dozen and more launches of one-channel-vector operations (``s1 / m``, ``mean *
mean``, a clamp, ``rsqrt``, casts, the running statistics' ``mul_`` and ``add_``; backward's ``a``,
``b``, ``c``, ``dgamma``, ``dbeta``): ~40 launches a layer, 1,900 of ResNet-50's step at batch 128,
each ~1 us of GPU time plus its gap in a CUDA graph and ~10 us of host time eagerly
(``docs/history.md``).  Here a thread a channel does them in the same order, each float64
operation rounded on its own (CUDA's ``__d*_rn``: ``--use_fast_math`` would contract ``a * b + c``),
each float32 one as ``exact_float.exact``: torch's float64 then float32 values of
``batch_norm.train_stats`` and ``batch_norm.grad_coefficients``, except the running statistics,
whose ``add_(x, alpha=momentum)`` torch may contract into one rounding on some devices (they are
compared with a tolerance).

Workload: ``elementwise.ElementwiseWorkload`` of kind ``bn_finish`` (with ``eps`` and ``momentum``)
or ``bn_coeffs``, ``shape`` the BatchNorm input's NCHW (``M = N * H * W`` its elements a channel;
``bn_coeffs``: ``(M, C, 1, 1)``).  With ``partials`` ``K > 1`` the two float64 sums arrive as the
statistics kernels' ``[C, K]`` per-thread partials (``elementwise.stats_grid``: ``K = P * T``) and
each is added in the kernel, a block a channel (:func:`schedule_cuda`: 256 threads, a cross-thread
reduction, then one thread does the channel's arithmetic), instead of by two torch reductions a
pass (ResNet-50 b32: 250 launches, 1.1 ms of ~4.4 us each on an H200, history.md).  The sums' order
is the block's, not torch's: the same float64 sums but for rounding in their last bit.
"""
from __future__ import annotations

import tvm
from tvm import te, tirx

from .exact_float import OPS, exact

_RN64 = {"*": "__dmul_rn", "/": "__ddiv_rn", "+": "__dadd_rn", "-": "__dsub_rn"}


def _f64(op: str, a, b, rn: bool):
    """float64 ``a op b`` rounded once (CUDA: its ``__d*_rn`` intrinsic; elsewhere IEEE as it is)."""
    if rn:
        return tirx.call_pure_extern("float64", _RN64[op], a, b)
    return OPS[op](a, b)


def _f32(op: str, a, b, rn: bool):
    return exact(op, a, b, rn)


def _rsqrt64(v, rn: bool):
    """torch's float64 ``rsqrt``: CUDA's ``rsqrt`` there, ``1 / sqrt`` (two roundings) elsewhere."""
    return tirx.rsqrt(v) if rn else tirx.const(1.0, "float64") / tirx.sqrt(v)


THREADS = 256      # a channel's block, where the partials are added in the kernel
UNROLL = 8          # partials a thread has in flight
# Above this many partials a channel torch adds them first (tvm_kernels): a block a channel reads
# 16 bytes a partial alone, and at ResNet-50 b128's stem (64 channels, K = 50,176: 800 KB a block,
# 64 blocks on 132 SMs) that is likely slower than torch's two reductions (a guess, to be timed)
MAX_PARTIALS = 16384


def adds_in_kernel(k: int) -> bool:
    """Whether ``k`` partials a channel go to the kernel as they are (else torch adds them first)."""
    return 1 < k <= MAX_PARTIALS


def _sums(wl, names: tuple[str, str]) -> tuple[list, list]:
    """The placeholders of the two float64 sums (``[C]``, or ``[C, K]`` partials) and their ``[C]``
    values (the placeholders themselves, or a reduction of each)."""
    c, k = wl.shape[1], wl.partials
    if k == 1:
        sums = [te.placeholder((c,), "float64", name=nm) for nm in names]
        return sums, sums
    parts = [te.placeholder((c, k), "float64", name=nm) for nm in names]
    return parts, [_total(part, k, nm) for part, nm in zip(parts, names)]


def _total(part: te.Tensor, k: int, name: str, reduce=te.sum) -> te.Tensor:
    """``reduce`` (``te.sum``, ``te.max``) of each channel's ``k`` partials: block ``{name}_total``."""
    r = te.reduce_axis((0, k), f"{name}_k")
    return te.compute((part.shape[0],), lambda ch: reduce(part[ch, r], axis=r), name=f"{name}_total")


TOTALS = {"bn_finish": ("s2_total", "s1_total"), "bn_coeffs": ("s2_total", "s1_total"),
          "grad_finish": ("sum_total", "amax_total")}     # the reduction blocks of each kind, last first


def schedule_cuda(func: tirx.PrimFunc, wl) -> tirx.PrimFunc:
    """A thread a channel; with ``partials``, a block a channel: each sum a cross-thread reduction of
    its ``K`` partials (``UNROLL`` loads in flight a thread, coalesced), the arithmetic after them
    on thread 0 (a unit loop split by the block's threads: TVM guards it, where a thread loop of
    extent 1 in a 256-thread kernel is not guarded)."""
    sch = tvm.s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_sblock(f"{wl.kind}_v0"))[0]
    if wl.partials == 1:
        bx, tx = sch.split(loop, [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    sch.bind(loop, "blockIdx.x")
    _, tx = sch.split(sch.add_unit_loop(sch.get_sblock(f"{wl.kind}_v0")), [None, THREADS])
    sch.bind(tx, "threadIdx.x")
    for name in TOTALS[wl.kind]:
        block = sch.get_sblock(name)
        sch.set_scope(block, 0, "shared")
        sch.compute_at(block, loop, preserve_unit_loops=True)
        rest, tx = sch.split(sch.get_loops(block)[-1], [None, THREADS])
        sch.reorder(tx, rest)
        sch.bind(tx, "threadIdx.x")
        sch.unroll(sch.split(rest, [None, UNROLL])[1])
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def bn_finish(wl, rn: bool = False) -> tirx.PrimFunc:
    """``(s1, s2, gamma, running_mean, running_var, mean, invstd, scale, new_mean, new_var)``: from
    the float64 sums of ``y`` and ``y * y`` a channel, ``mean = s1 / M``, the biased ``var = max(s2 /
    M - mean^2, 0)`` (float64, float32 out), ``invstd = rsqrt(var + eps)``, ``scale = gamma * invstd``
    and the running statistics ``r * (1 - momentum) + momentum * x`` (``x``: the mean, and the
    unbiased ``var * M / (M - 1)``).  The last two outputs may be the running tensors themselves (a
    thread reads its channel's before it writes it).  ``s1``, ``s2``: ``[C, K]`` partials with
    ``wl.partials`` ``K > 1``."""
    n, c, h, w = wl.shape
    m = n * h * w
    params, (s1, s2) = _sums(wl, ("s1", "s2"))
    gamma, rmean, rvar = (te.placeholder((c,), "float32", name=nm) for nm in ("gamma", "running_mean", "running_var"))
    f64, f32 = (lambda v: tirx.const(v, "float64")), (lambda v: tirx.const(v, "float32"))

    def element(ch):
        mean64 = _f64("/", s1[ch], f64(m), rn)
        d = _f64("-", _f64("/", s2[ch], f64(m), rn), _f64("*", mean64, mean64, rn), rn)
        var64 = tirx.if_then_else(d < f64(0.0), f64(0.0), d)      # clamp_min: a NaN stays NaN (max would drop it)
        mean, var = mean64.astype("float32"), var64.astype("float32")
        invstd = _rsqrt64(_f64("+", var64, f64(wl.eps), rn), rn).astype("float32")
        unbiased = _f32("*", var, f32(m / (m - 1)), rn)
        keep, take = f32(1.0 - wl.momentum), f32(wl.momentum)
        new_mean = _f32("+", _f32("*", rmean[ch], keep, rn), _f32("*", take, mean, rn), rn)
        new_var = _f32("+", _f32("*", rvar[ch], keep, rn), _f32("*", take, unbiased, rn), rn)
        return mean, invstd, _f32("*", gamma[ch], invstd, rn), new_mean, new_var

    outs = te.compute((c,), element, name="bn_finish")
    return te.create_prim_func(params + [gamma, rmean, rvar] + list(outs)).with_attr(
        {"tvm_qconv.kernel": "train_bn_finish", "tvm_qconv.workload": str(wl.to_dict())})


def bn_coeffs(wl, rn: bool = False) -> tirx.PrimFunc:
    """``(s1, s2, gamma, invstd, a, b, c, dgamma, dbeta)``: from backward's float64 sums ``s1 = sum
    dz``, ``s2 = sum dz * (y - mean)`` a channel, ``a = gamma * invstd``, ``b = -a * invstd^2 * s2 /
    M``, ``c = -a * s1 / M`` (float64, float32 out), ``dgamma = s2 * invstd``, ``dbeta = s1``.
    ``s1``, ``s2``: ``[C, K]`` partials with ``wl.partials`` ``K > 1``."""
    n, ch_count, h, w = wl.shape
    m = n * h * w
    params, (s1, s2) = _sums(wl, ("s1", "s2"))
    gamma, invstd = (te.placeholder((ch_count,), "float32", name=nm) for nm in ("gamma", "invstd"))

    def element(ch):
        i64 = invstd[ch].astype("float64")
        a64 = _f64("*", gamma[ch].astype("float64"), i64, rn)
        i2 = _f64("*", i64, i64, rn)
        neg = _f64("*", a64, tirx.const(-1.0, "float64"), rn)      # -a: exact
        b = _f64("/", _f64("*", _f64("*", neg, i2, rn), s2[ch], rn), tirx.const(m, "float64"), rn)
        c = _f64("/", _f64("*", neg, s1[ch], rn), tirx.const(m, "float64"), rn)
        return (a64.astype("float32"), b.astype("float32"), c.astype("float32"),
                _f64("*", s2[ch], i64, rn).astype("float32"), s1[ch].astype("float32"))

    outs = te.compute((ch_count,), element, name="bn_coeffs")
    return te.create_prim_func(params + [gamma, invstd] + list(outs)).with_attr(
        {"tvm_qconv.kernel": "train_bn_coeffs", "tvm_qconv.workload": str(wl.to_dict())})
