"""Planning rule of the int8 LayerNorm over each pixel's channels (``layer_norm_int8.py``): the
gains, offsets and row constants from gamma, beta, epsilon and the input and output scales."""
from __future__ import annotations

import numpy as np

from ..graph import static_shape
from ..schedules.layer_norm_int8 import MAX_GAIN, layer_norm_params
from ..schedules.workload import LayerNormWorkload
from .plan import LayerPlan, TensorRead


def plan_layer_norm(p, ly) -> LayerPlan | str:
    x = p.quantized(ly.inputs[0])
    impl = p.first("layer_norm", x.layout)
    if impl is None:
        return p.no_kernel("layer_norm", f"{x.layout} tensor")
    n, c, h, w = static_shape(ly.output.ty)
    gain = float(np.abs(ly.weight).max()) / p.scale(ly.output)
    if gain > MAX_GAIN:
        return f"gamma / output scale up to {gain:.3g}: past the int8 kernel's fixed point ({MAX_GAIN:.0f})"
    out = p.produce_output(ly, impl)
    wl = LayerNormWorkload((n, h, w), c, out.zero)
    params = layer_norm_params(ly.weight, ly.bias, float(ly.call.attrs.epsilon), x.scale, out.scale, out.zero, c)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(ly.inputs[0], x),), output=out,
                     out_shape=out.shape, params=tuple(impl.pack_params(wl, *params)),
                     row=dict(layer=ly.name, kind="layer_norm", kernel=impl.name, dtype="int8",
                              shape=f"{static_shape(ly.output.ty)} over channels"))
