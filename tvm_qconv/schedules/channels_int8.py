"""int8 channel gather in any activation layout: a piece of a channel split, a channel shuffle
(ShuffleNet), or both composed.  Output channel ``j`` is input channel ``index[j]``; the values are
moved, not changed, so the output keeps the input's scale and no requantize runs.  The index is a
parameter (an int32 table packed at build time), so one kernel serves any permutation.
Memory-bound; dlight schedules it on CUDA.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout


def gather_channels_int8(layout: Layout, shape: tuple[int, int, int], in_channels: int,
                         out_channels: int) -> tirx.PrimFunc:
    """Kernel: int8 ``X`` of ``in_channels`` channels in ``layout`` and int32 ``index`` of
    ``out_channels`` entries -> ``out[:, j] = X[:, index[j]]`` in ``layout`` (padded channels 0).

    Args:
        layout: the activation layout of the input and the output.
        shape: (N, H, W).
    """
    n, h, w = shape
    X = te.placeholder(layout.packed_shape((n, in_channels, h, w)), "int8", name="X")
    index = te.placeholder((out_channels,), "int32", name="index")

    def body(*at):
        b, c, y, x = layout.to_logical(at)
        src = index[tirx.min(c, out_channels - 1)]
        return tirx.if_then_else(c < out_channels, X[layout.to_packed(b, src, y, x)], tirx.const(0, "int8"))

    out = te.compute(layout.packed_shape((n, out_channels, h, w)), body, name="gather_channels")
    return te.create_prim_func([X, index, out]).with_attr(
        {"tvm_qconv.kernel": f"channels_{layout.name.lower()}_int8"})


def gather_channels_int8_ref(layout: Layout, x: np.ndarray, in_channels: int, index: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`gather_channels_int8`."""
    return layout.pack(layout.unpack(x, in_channels)[:, np.asarray(index)])
