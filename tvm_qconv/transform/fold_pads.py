"""fold_pads: an explicit zero ``pad`` before a conv written as the conv's own padding.

Models from TensorFlow and Keras, and ports of them (EfficientNet-Lite's ``Conv2dStaticSamePadding``,
a Keras-style ONNX file's ``Pad`` node), pad "same" in a node of its own, often asymmetrically
(one more row at the bottom), then convolve without padding.  ``graph.py`` leaves that ``pad`` a
float op: each such conv's input was dequantized to float32, padded, and quantized again
(EfficientNet-Lite0: 17 of them).  A zero pad of the two spatial axes of an NCHW tensor read only by
a conv2d is that conv's ``padding`` (top, left, bottom, right), added to what it has: the same values
(int8 zero is float zero, the quantization has no zero point), one float op fewer.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..relax_utils import bindings_of, emit_like, free_vars, rebuild_main, substitute


def _spatial_zero_pad(call) -> tuple[int, int, int, int] | None:
    """(top, left, bottom, right) of a constant-zero ``nn.pad`` of an NCHW tensor's H and W only."""
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", None) == "relax.nn.pad"):
        return None
    if str(call.attrs.pad_mode) != "constant" or float(call.attrs.pad_value) != 0.0:
        return None
    width = [int(w) for w in call.attrs.pad_width]
    if len(width) != 8 or any(width[:4]) or min(width) < 0:
        return None
    return width[4], width[6], width[5], width[7]


def fold_pads_into_convs(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each zero spatial pad read only by an NCHW conv2d folded into its padding
    (``mod`` itself where there is none)."""
    binds = bindings_of(mod["main"])
    pads = {b.var: (b.value.args[0], p) for b in binds if (p := _spatial_zero_pad(b.value)) is not None}
    if not pads:
        return mod
    readers: dict = {}
    for b in binds:
        for arg in free_vars(b.value):      # (inside tuples too: a concat's, a call_tir's)
            readers.setdefault(arg, []).append(b.value)
    returned = set()
    body = mod["main"].body.body
    if isinstance(body, relax.Var):
        returned.add(body)

    def foldable(conv) -> bool:
        return (isinstance(conv, relax.Call) and getattr(conv.op, "name", None) == "relax.nn.conv2d"
                and str(conv.attrs.data_layout) == "NCHW" and conv.args[0] in pads
                and len(readers.get(conv.args[0], [])) == 1 and conv.args[0] not in returned)

    folded = {b.value.args[0] for b in binds if foldable(b.value)}

    def rewrite(bb, b, vmap, is_output):
        if b.var in folded:
            return None     # read by its conv alone, which now pads itself
        if not foldable(b.value):
            return emit_like(bb, b, substitute(b.value, vmap), is_output)
        conv = b.value
        x, (t, l, bo, r) = pads[conv.args[0]]
        top, left, bottom, right = (int(p) for p in conv.attrs.padding)
        a = conv.attrs
        new = relax.op.nn.conv2d(substitute(x, vmap), substitute(conv.args[1], vmap), strides=a.strides,
                                 padding=[top + t, left + l, bottom + bo, right + r], dilation=a.dilation,
                                 groups=int(a.groups), data_layout=a.data_layout, kernel_layout=a.kernel_layout,
                                 out_layout=a.out_layout, out_dtype=a.out_dtype if str(a.out_dtype) else None)
        return emit_like(bb, b, new, is_output)

    return rebuild_main(mod, rewrite)
