"""The quantizers' scalar arithmetic around a training conv, one kernel each instead of a chain of
one-element torch launches.

* ``range_ema``: a layer's range record, ``buf = where(buf > 0, buf + momentum * (m - buf), m)``
  (``nn.modules._RangeTracker``: the EMA of each batch's ``max|t|``, the batch's own the first
  time).  In torch that is six launches (``gt``, ``sub``, ``mul``, ``add``, ``where``, ``copy_``),
  twice a conv a step.
* ``conv_scales``: a conv's forward scales from its input range and its weight's per-channel
  ranges: ``s_x = max(amax / 127, MIN)``, ``s_w[o] = max(w_amax[o] / 127, MIN)`` and the
  dequantizing scale ``s_x * s_w[o]`` (``functional.input_scale``, ``weight_scales`` and their
  product: five launches).  With ``mult``, backward's: the int8 gradients' scales from
  ``max_o(max|g[o]| * s_w[o])`` and ``max|g[o]|`` (``functional.input_grad_scale``,
  ``weight_grad_scales``) and ``dw``'s scale ``s_x * s_g[o]`` with the forward's ``s_x`` as an
  input (``times``): five launches too.

ResNet-50's training step at batch 32 ran ~1,600 such launches, each ~1 us of GPU time in a CUDA
graph (H200, 2026-11-29; ``docs/history.md``).  A thread a channel (``elementwise.CHANNEL_KINDS``),
each float32 operation rounded on its own as ``exact_float.exact`` (CUDA's ``__f*_rn``): torch's
bits, except that CUDA flushes subnormals to 0 under TVM's ``--use_fast_math`` (as in every kernel
here): a product ``s_x * s_w`` below 1.2e-38 (an input range under ~1e-28 times a weight channel's
under ~1.5e-6), and in ``range_ema`` a range record or batch range below 1.2e-38, which compares
as 0 and is replaced or flushed.  ``max(v, MIN)`` is torch's ``clamp(min=)``: a NaN
stays NaN.

* ``grad_finish``: ``grad_stats``' ``[C, K]`` per-thread partials finished: ``max|g|`` a channel
  (the int8 gradients' ranges) and ``sum g`` (float64, float32 out: the bias gradient), a block a
  channel as ``bn_channel``'s partials (in torch: two reductions and a cast).

Workloads (``elementwise.ElementwiseWorkload``): ``range_ema`` of shape ``(1, 1, 1, 1)`` with the
layer's ``momentum``; ``conv_scales`` of shape ``(1, O, 1, 1)`` [with ``mult``]; ``grad_finish`` of
``g``'s shape with ``partials``.
"""
from __future__ import annotations

from tvm import te, tirx

from .bn_channel import _total
from .exact_float import exact

QMAX = 127.0
MIN_SCALE = 1e-30   # functional.MIN_INPUT_SCALE == observers.MIN_WEIGHT_SCALE


def _clamp_min(v, low):
    return tirx.if_then_else(v < low, low, v)


def range_ema(wl, rn: bool = False) -> tirx.PrimFunc:
    """``(buf, m, new)``: float32 ``[1]`` each, ``new = where(buf > 0, buf + momentum * (m - buf),
    m)``; ``new`` may be ``buf`` itself (the one thread reads it before it writes it)."""
    buf, m = (te.placeholder((1,), "float32", name=nm) for nm in ("buf", "m"))
    zero, mom = tirx.const(0.0, "float32"), tirx.const(wl.momentum, "float32")

    def element(i):
        moved = exact("+", buf[i], exact("*", exact("-", m[i], buf[i], rn), mom, rn), rn)
        return tirx.if_then_else(buf[i] > zero, moved, m[i])

    new = te.compute((1,), element, name="range_ema")
    return te.create_prim_func([buf, m, new]).with_attr(
        {"tvm_qconv.kernel": "train_range_ema", "tvm_qconv.workload": str(wl.to_dict())})


def grad_finish(wl, rn: bool = False) -> tirx.PrimFunc:
    """``(amax, total, g_amax, g_sum)``: from ``grad_stats``' partials ``amax`` (float32 ``[C, K]``)
    and ``total`` (float64), ``g_amax[c] = max_k amax[c, k]`` (exact in any order) and ``g_sum[c] =
    float32(sum_k total[c, k])`` (the float64 sum in the block's order: its last bit may differ
    from torch's).  ``grad_stats``' own max already drops a NaN (a float max under
    ``--use_fast_math``), so the max here sees none that torch's would."""
    c, k = wl.shape[1], wl.partials
    amax = te.placeholder((c, k), "float32", name="amax")
    total = te.placeholder((c, k), "float64", name="total")
    g_amax, g_sum = _total(amax, k, "amax", te.max), _total(total, k, "sum")
    outs = te.compute((c,), lambda ch: (g_amax[ch], g_sum[ch].astype("float32")), name="grad_finish")
    return te.create_prim_func([amax, total] + list(outs)).with_attr(
        {"tvm_qconv.kernel": "train_grad_finish", "tvm_qconv.workload": str(wl.to_dict())})


def conv_scales(wl, rn: bool = False) -> tirx.PrimFunc:
    """``(amax, w_amax[, times], s_x, s_w, scale)``: from the input's range ``amax`` (float32
    ``[1]``) and the weight's per-output-channel ``w_amax`` (``[O]``), ``s_x`` (``[O]``, every
    element the same: the caller takes one), ``s_w`` and ``scale = s_x * s_w`` (``[O]``), or ``times
    * s_w`` with ``wl.mult`` (``times``: ``[1]``)."""
    o = wl.shape[1]
    amax = te.placeholder((1,), "float32", name="amax")
    w_amax = te.placeholder((o,), "float32", name="w_amax")
    times = te.placeholder((1,), "float32", name="times") if wl.mult else None
    qmax, low = tirx.const(QMAX, "float32"), tirx.const(MIN_SCALE, "float32")

    def element(ch):
        s_x = _clamp_min(exact("/", amax[0], qmax, rn), low)
        s_w = _clamp_min(exact("/", w_amax[ch], qmax, rn), low)
        return s_x, s_w, exact("*", s_x if times is None else times[0], s_w, rn)

    outs = te.compute((o,), element, name="conv_scales")
    return te.create_prim_func([amax, w_amax] + ([times] if times is not None else []) + list(outs)).with_attr(
        {"tvm_qconv.kernel": "train_conv_scales", "tvm_qconv.workload": str(wl.to_dict())})
