"""A conv's epilogue that ends in a residual add: the int8 add after the conv (``add_int8.py``)
applied to the conv's requantized int8 before it is stored, with the other addend read there.

    c   = requantize(acc + bias)                                      (what the conv would store)
    out = clamp(((c - z_c) * m_c + (r - z_r) * m_r) >> s + z_out)     (the add kernel's integers)

Unfused, the conv writes ``c`` and the add kernel reads it back with the residual ``r`` and writes
``out``: one launch and one round trip of the activation per residual block (ConvNeXt-T at batch
1 on an H200, 2026-11-28: 18 add kernels, 21 of its 448 us of GPU kernels and 18 of its 107
launches; ResNeXt-50 at batch 64: 291 of 2,173 us).  Fused, the conv reads ``r`` where it stores and
stores ``out``: the same integers, bit for bit (the add kernel's 32-bit form equals the int64 form
written here: ``add_int8.split_multipliers``), so a fused build computes what the unfused one does
and the CPU build (whose kernels fuse too) stays bit-identical to the CUDA build.

``ConvWorkload.residual`` = ``(z_c, z_r, z_out, act_min, act_max)`` asks for this form: the add's
zero points and clamp (the conv's own clamp, ``act_min``/``act_max`` of the workload, still
applies to ``c``).  The multipliers ``(m_c, m_r, s)`` differ per layer, not per kernel, so they
are an int64[3] argument (:func:`add_params`; a multiplier may reach 2**32).  Arguments: ``(data,
residual, weight, bias, mult, shift, add, out)``: the residual after the data (a layer's int8
inputs come first, as the quantization plan orders its reads), the multipliers last before the
output; the residual in the layout and shape of the output.  Not with a table epilogue (``epilogue_table.py``) in the same
kernel.  An implementation that has this form says ``KernelImpl.takes_residual``; the quantization
plan fuses an add into the conv that feeds it alone (``tvm_qconv/quantization/residuals.py``).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .add_int8 import add_int8_ref, add_tir

ADD_PARAMS = 3     # (m_c, m_r, s)


def add_params(mult_c: int, mult_r: int, shift: int) -> np.ndarray:
    """The kernel's int64[3] argument: the add's multiplier of the conv's output, of the residual,
    and their shift (``requantize.add_multipliers``)."""
    return np.array([mult_c, mult_r, shift], np.int64)


def te_buffers(wl, shape):
    """``(residual, add)`` TE placeholders where ``wl.residual`` (the residual in the output's
    ``shape``), else ``(None, None)``."""
    if not wl.residual:
        return None, None
    return te.placeholder(shape, "int8", name="Residual"), te.placeholder((ADD_PARAMS,), "int64", name="AddParams")


def script_buffers(wl, shape):
    """:func:`te_buffers` for a TVMScript compute: buffers of no parameter, made parameters by
    :func:`with_params`."""
    if not wl.residual:
        return None, None
    return (tirx.decl_buffer(shape, "int8", name="Residual"),
            tirx.decl_buffer((ADD_PARAMS,), "int64", name="AddParams"))


def finish(value, residual, add, wl):
    """The int8 the fused conv stores: ``value`` (the int8 the conv would store) plus ``residual``
    (the other addend's int8 at the same place) as the add kernel computes it; ``value`` itself
    without a residual."""
    if not wl.residual:
        return value
    z_c, z_r, z_out, lo, hi = wl.residual
    return add_tir(value, residual, add[0], add[1], add[2], lo, hi, (z_c, z_r, z_out))


def with_params(func: tirx.PrimFunc, residual, add) -> tirx.PrimFunc:
    """``func`` (whose body reads ``residual`` and ``add``, buffers of no parameter) with
    ``residual`` as the parameter after the data and ``add`` before the output; ``func`` itself
    where ``residual`` is None."""
    if residual is None:
        return func
    data, *rest, out = func.params
    return tirx.PrimFunc([data, residual, *rest, add, out], func.body, func.ret_type, func.attrs)


def te_args(data, rest: list, out, residual, add) -> list:
    """A TE compute's arguments in this order (module docstring)."""
    return [data, *rest, out] if residual is None else [data, residual, *rest, add, out]


def reference(wl, args: tuple, plain) -> np.ndarray:
    """A conv's NumPy reference with its residual: ``plain(wl, data, *rest)`` (the conv without
    one), then the add kernel's reference on its output and the residual; ``plain`` alone where
    ``wl`` has no residual."""
    if not wl.residual:
        return plain(wl, *args)
    data, residual, *rest, add = args
    z_c, z_r, z_out, lo, hi = wl.residual
    c = plain(wl, data, *rest)
    return add_int8_ref(c, np.asarray(residual), int(add[0]), int(add[1]), int(add[2]), lo, hi, (z_c, z_r, z_out))
