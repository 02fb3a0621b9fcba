"""int8 channel concatenation in any activation layout (Inception, DenseNet, GoogLeNet, SqueezeNet
branches): each input is requantized from its own scale to the output's (integer-only, as every
epilogue) and placed at its channel offset.  Any channel counts: a branch whose channels are not
a multiple of the layout's channel group (ShuffleNet's 58 in NCHW4c, 48 in NHWC32) starts
mid-group, so the kernel reads by logical channel through the layout's index maps.

With ``gather`` > 0 the kernel writes only the concatenation's channels an int32 ``index`` picks
(output channel j = concatenated channel ``index[j]``): a channel gather of a concatenation read
from the concatenation's inputs, so that the concatenation is never written (ShuffleNet-V2's
concat -> shuffle -> split: each split piece one kernel from the two branches;
``quantization/channels.py``).  Memory-bound; on CUDA the NHWC32 form is written out
(``tensorcore/concat.py``), the NCHW4c one left to dlight."""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kernel import Layout
from .requantize import QMIN, requantize_ref, requantize_tir


def concat_int8(layout: Layout, shape: tuple[int, int, int], channels: list[int], mults: list[int],
                shifts: list[int], zeros: list[int] | None = None, out_zero: int = 0,
                gather: int = 0) -> tirx.PrimFunc:
    """Kernel: int8 inputs of ``channels[i]`` channels in ``layout`` -> their concatenation in it
    (``gather``: the ``gather`` channels of it an int32 ``index`` parameter, after the inputs, picks).

    Args:
        layout: the activation layout of the inputs and the output.
        shape: (N, H, W).
        channels: the real channel count of each input.
        mults, shifts: each input's fixed-point multiplier to the output scale.
        zeros, out_zero: the inputs' and the output's zero points (0, or -128 for an unsigned
            tensor): ``(q_i - zeros[i])`` is requantized, ``out_zero`` added before the clamp.
    """
    zeros = list(zeros) if zeros is not None else [0] * len(channels)
    lo = QMIN if out_zero == 0 else -128
    n, h, w = shape
    ins = [te.placeholder(layout.packed_shape((n, c, h, w)), "int8", name=f"X{i}") for i, c in enumerate(channels)]
    offsets = np.cumsum([0] + list(channels)).tolist()
    out_channels = gather or offsets[-1]
    index = te.placeholder((gather,), "int32", name="index") if gather else None

    def body(*at):
        b, c_out, y, x = layout.to_logical(at)
        c = index[tirx.min(c_out, gather - 1)] if gather else c_out    # the concatenated channel
        value = tirx.const(0, "int8")
        for i in reversed(range(len(ins))):
            local = tirx.max(tirx.min(c - offsets[i], channels[i] - 1), 0)
            q = ins[i][layout.to_packed(b, local, y, x)].astype("int64")
            if zeros[i]:
                q = q - tirx.const(zeros[i], "int64")
            v = requantize_tir(q, tirx.const(mults[i], "int32"), tirx.const(shifts[i], "int32"), lo, 127,
                               zero=out_zero)
            value = tirx.if_then_else(c < offsets[i + 1], v, value)
        return tirx.if_then_else(c_out < out_channels, value, tirx.const(0, "int8"))  # padded channels: 0

    out = te.compute(layout.packed_shape((n, out_channels, h, w)), body, name="concat")
    return te.create_prim_func([*ins, *([index] if gather else []), out]).with_attr({"tvm_qconv.kernel": f"concat_{layout.name.lower()}_int8"})


def concat_int8_ref(layout: Layout, xs: list[np.ndarray], channels: list[int], mults, shifts,
                    zeros=None, out_zero: int = 0, index: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`concat_int8` (``index``: the gather's)."""
    zeros = list(zeros) if zeros is not None else [0] * len(xs)
    lo = QMIN if out_zero == 0 else -128
    parts = [requantize_ref(layout.unpack(x, c).astype(np.int64) - z, np.int64(m), np.int64(s), lo, 127, zero=out_zero)
             for x, c, m, s, z in zip(xs, channels, mults, shifts, zeros)]
    joined = np.concatenate(parts, axis=1)
    return layout.pack(joined if index is None else joined[:, np.asarray(index)])
