"""Planning rule of the int8 LayerNorm over each pixel's channels (``layer_norm_int8.py``): the
gains, offsets and row constants from gamma, beta, epsilon and the input and output scales."""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import static_shape
from ..schedules.layer_norm_int8 import MAX_GAIN, layer_norm_params
from ..schedules.workload import LayerNormWorkload
from .plan import LayerPlan, TensorQuant, TensorRead


def plan_layer_norm(p, ly) -> LayerPlan | str:
    x = p.quantized(ly.inputs[0])
    impl = p.first("layer_norm", x.layout)
    if impl is None:
        return p.no_kernel("layer_norm", f"{x.layout} tensor")
    n, c, h, w = static_shape(ly.output.ty)
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    gain = float(np.abs(ly.weight).max()) / s_y
    if gain > MAX_GAIN:
        return f"gamma / output scale up to {gain:.3g}: past the int8 kernel's fixed point ({MAX_GAIN:.0f})"
    wl = LayerNormWorkload((n, h, w), c, z_y)
    params = layer_norm_params(ly.weight, ly.bias, float(ly.call.attrs.epsilon), x.scale, s_y, z_y, c)
    out_shape = registry.layout(x.layout).packed_shape((n, c, h, w))
    out = TensorQuant(s_y, z_y, c, impl.layout, out_shape)
    p.produce(ly.output, out)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(ly.inputs[0], x),), output=out,
                     out_shape=out_shape, params=tuple(impl.pack_params(wl, *params)),
                     row=dict(layer=ly.name, kind="layer_norm", kernel=impl.name, dtype="int8",
                              shape=f"{static_shape(ly.output.ty)} over channels"))
