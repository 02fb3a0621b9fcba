"""Planning rules of the pools: max pooling (the same integers: its input's scale and zero
point) and average pooling (a requantize of the window's sum; a classifier's global mean too)."""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import static_shape
from ..schedules.requantize import quantize_multiplier
from ..schedules.workload import AvgPoolWorkload, PoolWorkload
from .plan import LayerPlan, TensorQuant, TensorRead


def plan_max_pool2d(p, ly) -> LayerPlan | str:
    a = ly.call.attrs
    x = p.quantized(ly.inputs[0])
    wl = PoolWorkload(x.shape, tuple(map(int, a.pool_size)), tuple(map(int, a.strides)),
                      tuple(map(int, a.padding)), tuple(map(int, a.dilation)), bool(a.ceil_mode))
    impl = p.select("max_pool2d", wl, layout=x.layout)
    if impl is None:
        return p.no_kernel("max_pool2d", f"{x.layout} tensor")
    n, _, oh, ow = static_shape(ly.output.ty)
    out_shape = registry.layout(x.layout).packed_shape((n, x.channels, oh, ow))
    out = TensorQuant(x.scale, x.zero, x.channels, impl.layout, out_shape)   # the same integers
    p.produce(ly.output, out)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(ly.inputs[0], x),), output=out,
                     out_shape=out_shape, row=dict(layer=ly.name, kind="max_pool2d", kernel=impl.name, dtype="int8",
                                                   shape=f"{wl.pool} s{wl.stride[0]}"))


def plan_avg_pool2d(p, ly) -> LayerPlan | str:
    x = p.quantized(ly.inputs[0])
    pool, stride, padding = ly.window
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    mult, shift = quantize_multiplier(np.array([x.scale / (pool[0] * pool[1] * s_y)]))
    wl = AvgPoolWorkload(x.shape, pool, stride, padding, int(mult[0]), int(shift[0]), x.zero, z_y)
    impl = p.select("avg_pool2d", wl, layout=x.layout)
    if impl is None:
        return p.no_kernel("avg_pool2d", f"{x.layout} tensor")
    n, _, oh, ow = static_shape(ly.output.ty)
    out_shape = registry.layout(x.layout).packed_shape((n, x.channels, oh, ow))
    out = TensorQuant(s_y, z_y, x.channels, impl.layout, out_shape)
    p.produce(ly.output, out)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(ly.inputs[0], x),), output=out,
                     out_shape=out_shape, row=dict(layer=ly.name, kind="avg_pool2d", kernel=impl.name, dtype="int8",
                                                   shape=f"{pool} s{wl.stride[0]}"))
