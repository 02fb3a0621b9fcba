"""identity_reshapes: a reshape to the shape its input already has, dropped.

ConvNeXt's classifier LayerNorm2d permutes the pooled ``[N, C, 1, 1]`` map to channels last and
back; on a 1 x 1 map torch.export writes the permute as a reshape, and once the LayerNorm is read
as a LayerNorm over channels (``channels_first.py``) what is left is ``reshape(x, shape(x))``.  It
moves nothing, but as a float op between the int8 pool and the LayerNorm it kept the LayerNorm in
float ("input is float") with a dequantize before it.  Dropped, the LayerNorm reads the pool's int8
output (one int8 kernel) and the classifier's only float op is the flatten, a view.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..graph import static_shape
from ..relax_utils import bindings_of, emit_like, rebuild_main, substitute


def _identity(b) -> bool:
    call = b.value
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", None) == "relax.reshape"):
        return False
    shape = static_shape(call.args[0].ty)
    return shape is not None and shape == static_shape(b.var.ty) and not isinstance(b.var.ty, relax.TupleType)


def drop_identity_reshapes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without its identity reshapes (``mod`` itself where there is none); a returned one stays."""
    binds = bindings_of(mod["main"])
    if not any(_identity(b) and isinstance(b.var, relax.DataflowVar) for b in binds):
        return mod

    def rewrite(bb, b, vmap, is_output):
        new = substitute(b.value, vmap)
        if _identity(b) and not is_output:
            return new.args[0]      # readers read the reshape's input
        return emit_like(bb, b, new, is_output)

    return rebuild_main(mod, rewrite)
