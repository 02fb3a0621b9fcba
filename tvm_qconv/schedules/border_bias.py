"""The padding of an unsigned input, as a bias per border class: for a kernel that pads with 0.

An unsigned tensor is stored as ``q = v - 128`` (zero point -128, ``zero_points.py``), so a padded
conv reading it must pad with -128, its real zero.  A kernel whose padding can only be 0 (the
wgmma family's TMA im2col: its out-of-bounds fill is 0) sums ``w * 0`` at each padded tap where
``w * -128`` belongs.  What it misses, ``-128 * sum(w)`` over the taps that fall in the padding,
depends only on which taps those are: on the output pixel's *border class*, per axis the rows
whose window starts above the image (``top`` of them), those whose window ends below it
(``bottom``), and the interior (one class)::

    class(o) = min(o, top) + max(o - (out - bottom - 1), 0)         (top + bottom < out)
    class(o) = o                                                     (otherwise: every row its own)

So the kernel adds a ``[classes_h * classes_w, O]`` int32 table instead of its ``[O]`` bias: row
``class_h * classes_w + class_w`` is the bias plus that class's missing ``-128 * sum(w)``
(:func:`bias_table`); the interior row is the bias itself.  A 3x3 conv with padding 1 has 9 rows.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx

from .workload import ConvWorkload


def axis_classes(size: int, out: int, kernel: int, stride: int, pad_before: int, dilation: int) -> tuple[int, int, int]:
    """``(top, bottom, classes)`` of one axis: the output rows whose window starts before the input
    (they are rows ``0..top-1``), those whose window ends after it (the last ``bottom``), and the
    number of classes."""
    top = sum(1 for o in range(out) if o * stride - pad_before < 0)
    bottom = sum(1 for o in range(out) if o * stride - pad_before + (kernel - 1) * dilation > size - 1)
    return top, bottom, (top + bottom + 1 if top + bottom < out else out)


def class_of(o, top: int, bottom: int, out: int, minimum=min, maximum=max):
    """The border class of output row ``o`` (an int, array or TIR expression: pass the matching
    ``minimum`` / ``maximum``, e.g. ``tirx.min``)."""
    if top + bottom >= out:
        return o
    return minimum(o, top) + maximum(o - (out - bottom - 1), 0)


def classes(wl: ConvWorkload) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """:func:`axis_classes` of ``wl``'s height and width."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    return (axis_classes(wl.height, wl.out_height, kh, sh, wl.padding[0], dh),
            axis_classes(wl.width, wl.out_width, kw, sw, wl.padding[1], dw))


def table_row(wl: ConvWorkload, m, minimum=tirx.min, maximum=tirx.max):
    """The table row of GEMM row ``m`` (output pixel ``m`` of ``N*OH*OW``): a TIR expression, or
    with ``np.minimum`` / ``np.maximum`` an index array."""
    (th, bh, _), (tw, bw, cw) = classes(wl)
    oh, ow = wl.out_height, wl.out_width
    return (class_of(m // ow % oh, th, bh, oh, minimum, maximum) * cw
            + class_of(m % ow, tw, bw, ow, minimum, maximum))


def table_rows(wl: ConvWorkload) -> int:
    """Rows of ``wl``'s bias table (1 where its padding needs no correction)."""
    if not wl.pads_with_zero_point:
        return 1
    (_, _, ch), (_, _, cw) = classes(wl)
    return ch * cw


def _outside(size: int, out: int, kernel: int, stride: int, pad_before: int, dilation: int, top: int,
             bottom: int) -> np.ndarray:
    """``[classes, kernel]`` bool: which taps of a row of each class fall in the padding."""
    rows = np.arange(out)
    cls = class_of(rows, top, bottom, out, np.minimum, np.maximum)
    first = np.array([rows[cls == c][0] for c in range(int(cls.max()) + 1)])   # a row of each class
    pos = first[:, None] * stride - pad_before + np.arange(kernel)[None, :] * dilation
    return (pos < 0) | (pos >= size)


def bias_table(wl: ConvWorkload, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """int32 ``[table_rows(wl), O]``: ``bias`` plus, per border class, ``in_zero * sum(w)`` over
    the taps in the padding (``weight``: the int8 OIHW weights, ungrouped)."""
    if not wl.pads_with_zero_point:
        return bias.astype(np.int32)[None, :]
    (th, bh, _), (tw, bw, _) = classes(wl)
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    out_h = _outside(wl.height, wl.out_height, kh, sh, wl.padding[0], dh, th, bh)     # [CH, KH]
    out_w = _outside(wl.width, wl.out_width, kw, sw, wl.padding[1], dw, tw, bw)       # [CW, KW]
    tap_sums = weight.astype(np.int64).sum(axis=1)                                    # [O, KH, KW]
    padded = out_h[:, None, :, None] | out_w[None, :, None, :]                         # [CH, CW, KH, KW]
    missing = np.einsum("hwyx,oyx->hwo", padded.astype(np.int64), tap_sums)             # [CH, CW, O]
    table = bias.astype(np.int64)[None, :] + wl.in_zero * missing.reshape(-1, weight.shape[0])
    # saturated like the bias itself (the quantize pass clips and counts those): only a channel
    # whose bias is already near the int32 limit, whose outputs saturate anyway, can reach it
    return np.clip(table, -2**31, 2**31 - 1).astype(np.int32)
