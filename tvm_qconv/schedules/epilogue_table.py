"""A conv's epilogue that ends in a 256-entry table: the elementwise function after the conv
(SiLU, hardswish, GELU: ``lut_int8.py``) applied to the requantized int8 before it is stored.

    out = Table[requantize(acc + bias) + 128]        (padded channels: 0, as the table kernel writes)

The table kernel alone reads the conv's int8 output back and writes it again: one launch and one
round trip of the activation per conv (EfficientNet-B0: 49 table kernels, 60 of its 418 us of
kernels at batch 1 on an H200, 2026-11-28).  Fused, the conv stores the table's entry instead, so
the result is the unfused pair's, bit for bit: the table indexes the same int8 the conv would have
stored.  ``ConvWorkload.table`` asks for this form; an implementation that has it says
``KernelImpl.takes_table``, and the quantization plan fuses a table into the conv that feeds it
alone (``tvm_qconv/quantization/epilogues.py``).

The table is the kernel's last argument before its output.  A compute written in TE takes it as a
placeholder (:func:`te_table`); one written in TVMScript reads a buffer declared here
(:func:`script_table`) and gets it as a parameter afterwards (:func:`with_table_param`).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

TABLE_SIZE = 256


def te_table(wl):
    """The table's TE placeholder where ``wl.table``, else None."""
    return te.placeholder((TABLE_SIZE,), "int8", name="Table") if wl.table else None


def script_table(wl):
    """The table's buffer for a TVMScript compute where ``wl.table``, else None; the function
    gets it as a parameter from :func:`with_table_param`."""
    return tirx.decl_buffer((TABLE_SIZE,), "int8", name="Table") if wl.table else None


def finish(value, channel, table, channels: int):
    """The int8 ``value`` a conv stores for output ``channel``: itself without a table, else the
    table's entry for it (0 on the padded channels ``channel >= channels``)."""
    if table is None:
        return value
    return tirx.if_then_else(channel < channels, table[value.astype("int32") + 128], tirx.const(0, "int8"))


def finish_int32(q, channel, table, channels: int):
    """:func:`finish` on an int32 that holds the int8 value (the hand-written kernels' epilogues)."""
    return q if table is None else finish(q.astype("int8"), channel, table, channels).astype("int32")


def with_table_param(func: tirx.PrimFunc, table) -> tirx.PrimFunc:
    """``func`` (whose body reads ``table``, a buffer of no parameter) with ``table`` as the
    parameter before its output; ``func`` itself where ``table`` is None."""
    if table is None:
        return func
    # a TIRx buffer is a Var of BufferType: the parameter is the buffer itself
    return tirx.PrimFunc([*func.params[:-1], table, func.params[-1]], func.body, func.ret_type, func.attrs)


def reference(layout, wl, args: tuple, plain) -> np.ndarray:
    """A conv's NumPy reference with its table: ``plain(wl, *args)`` (the conv without one) on the
    arguments before the table, then :func:`finish`'s twin on its packed int8 output of ``layout``
    (a ``Layout``); ``plain`` alone where ``wl`` has no table."""
    if not wl.table:
        return plain(wl, *args)
    *args, table = args
    out = plain(wl, *args)
    return layout.pack(np.asarray(table, np.int8)[layout.unpack(out, wl.out_channels).astype(np.int32) + 128])
