"""conv_bias_batch_norms: a conv's bias add before a batch norm moved into the batch norm's mean.

TVM's ``FoldBatchnormToConv2D`` folds ``batch_norm(conv2d(x, W))`` into the conv, the pattern of
torchvision's convs (``bias=False``).  A conv with a bias -- a user's ``nn.Conv2d(bias=True)``
before an ``nn.BatchNorm2d``, an ONNX ``Conv`` with its ``B`` input before a
``BatchNormalization`` -- is imported as ``batch_norm(add(conv2d(x, W), b))``, which that
pattern does not match: the batch norm stayed a kernel of its own (an int8 BatchNorm layer, or a
float op), one more requantization and one more pass over the activation.

A batch norm subtracts its mean first: ``bn(y + b; mean) = bn(y; mean - b)``, exactly, per channel.
So the add is dropped and its bias moved into the mean; ``FoldBatchnormToConv2D`` then folds the
batch norm, and the conv's bias becomes ``beta + (b - mean) * gamma / sqrt(var + eps)``: one conv,
one bias, as for a conv without one.  Only where the conv's and the add's results are read by
nothing else (the conv is not duplicated) and the pattern is one TVM's pass folds (constant
OIHW weight, constant batch-norm parameters over the channel axis).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..graph import _const, _op, static_shape
from ..relax_utils import bindings_of, emit_like, free_vars, rebuild_main, substitute


def _channel_bias(const, channels: int) -> np.ndarray | None:
    """The per-channel values of a constant added to an NCHW tensor of ``channels`` channels
    (shape ``[1, C, 1, 1]``, ``[C, 1, 1]``, or one value for all), else None."""
    b = _const(const)
    if b is None or b.ndim > 4 or b.dtype != np.float32:
        return None
    shape = (1,) * (4 - b.ndim) + b.shape
    if shape[0] != 1 or shape[2:] != (1, 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(b.reshape(-1), (channels,)).astype(np.float32)


def move_conv_biases_into_batch_norms(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each ``batch_norm(add(conv2d(x, W), b))`` written ``batch_norm(conv2d(x, W))``
    at the mean ``mean - b`` (``mod`` itself where there is none).  Run it on a module whose
    constants are folded (the bias a constant, not a reshape of one)."""
    binds = bindings_of(mod["main"])
    value = {b.var: b.value for b in binds}
    readers: dict = {}
    for b in binds:
        for arg in free_vars(b.value):
            readers.setdefault(arg, []).append(b.var)
    outputs = {b.var for b in binds if not isinstance(b.var, relax.DataflowVar)}
    body = mod["main"].body.body
    if isinstance(body, relax.Var):
        outputs.add(body)

    def only_reader(var, reader) -> bool:
        return var not in outputs and readers.get(var, []) == [reader]

    moved: dict = {}    # batch_norm var -> (conv var, the mean less the bias)
    for b in binds:
        bn = b.value
        if _op(bn) != "relax.nn.batch_norm" or int(bn.attrs.axis) != 1:
            continue
        if any(_const(p) is None for p in bn.args[1:]):
            continue
        added = bn.args[0]
        add = value.get(added)
        if _op(add) != "relax.add" or not only_reader(added, b.var):
            continue
        for conv_var, const in (add.args, add.args[::-1]):
            conv = value.get(conv_var)
            if _op(conv) != "relax.nn.conv2d" or not only_reader(conv_var, added):
                continue
            a = conv.attrs
            if str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" or str(a.out_layout) != "NCHW" \
                    or _const(conv.args[1]) is None:
                continue
            shape = static_shape(conv_var.ty)
            bias = _channel_bias(const, shape[1]) if shape is not None and len(shape) == 4 else None
            mean = _const(bn.args[3])
            if bias is None or mean.shape != bias.shape:
                continue
            moved[b.var] = (conv_var, added, (mean - bias).astype(mean.dtype))
            break
    if not moved:
        return mod
    dropped = {added for _, added, _ in moved.values()}

    def rewrite(bb, b, vmap, is_output):
        if b.var in dropped:
            return None     # the bias add: read by its batch norm alone, which now subtracts it
        if b.var not in moved:
            return emit_like(bb, b, substitute(b.value, vmap), is_output)
        conv_var, _, mean = moved[b.var]
        bn = b.value
        args = [substitute(conv_var, vmap), bn.args[1], bn.args[2], relax.const(mean), bn.args[4]]
        return emit_like(bb, b, tvm.ir.Call(bn.op, args, bn.attrs, bn.ty_args), is_output)

    return rebuild_main(mod, rewrite)
