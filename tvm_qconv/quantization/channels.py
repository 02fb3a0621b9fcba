"""Planning rules of the layers that move channels: a concatenation (each input requantized to
the output's scale) and a channel gather (a split piece, a shuffle: values moved, not changed,
so the input's scale and zero point; a gather of a gather reads the first one's input, and a gather
of a concatenation reads the concatenation's inputs: ``concat_int8.py``'s ``gather`` form)."""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import registry
from ..graph import static_shape
from ..schedules.requantize import quantize_multiplier
from ..schedules.workload import ChannelsWorkload, ConcatWorkload
from .plan import LayerPlan, TensorQuant, TensorRead


def plan_concat(p, ly) -> LayerPlan | str:
    layout_name = p.majority_layout(ly.inputs)
    impl = p.first("concat", layout_name) if layout_name else p.select("concat", None)
    if impl is None:
        return p.no_kernel("concat", "these inputs")
    reads = tuple(p.read(v, impl.layout) for v in ly.inputs)
    qs = [r.quant for r in reads]
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    mult, shift = quantize_multiplier(np.array([q.scale / s_y for q in qs]))
    n, c, h, w = static_shape(ly.output.ty)
    zeros = tuple(q.zero for q in qs) if any(q.zero for q in qs) else ()
    wl = ConcatWorkload((n, h, w), tuple(q.channels for q in qs), tuple(map(int, mult)), tuple(map(int, shift)),
                        zeros, z_y)
    out_shape = registry.layout(impl.layout).packed_shape((n, c, h, w))
    out = TensorQuant(s_y, z_y, c, impl.layout, out_shape)
    p.produce(ly.output, out)
    lp = LayerPlan(ly, impl=impl, workload=wl, reads=reads, output=out, out_shape=out_shape,
                   row=dict(layer=ly.name, kind=f"concat x{len(qs)}", kernel=impl.name, dtype="int8",
                            shape=str((n, c, h, w))))
    p.concats[ly.output] = lp
    return lp


def plan_channels(p, ly) -> LayerPlan | str:
    # A gather of a gather reads the first one's source with the two indices composed (a shuffle
    # then a split is one kernel per piece; the shuffle's own kernel is then dead).
    src, index = ly.inputs[0], list(ly.channel_index)
    while src in p.gathered:
        src, inner = p.gathered[src]
        index = [inner[i] for i in index]
    x = p.quantized(src)
    if src in p.concats:
        return _gather_of_concat(p, ly, src, index, x)
    impl = p.first("channels", x.layout)
    if impl is None:
        return p.no_kernel("channels", f"{x.layout} tensor")
    n, c, h, w = static_shape(ly.output.ty)
    wl = ChannelsWorkload((n, h, w), x.channels, c)
    out_shape = registry.layout(x.layout).packed_shape((n, c, h, w))
    out = TensorQuant(x.scale, x.zero, c, impl.layout, out_shape)  # values moved, not changed: the input's scale
    p.produce(ly.output, out)
    p.gathered[ly.output] = (src, index)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(src, x),), output=out, out_shape=out_shape,
                     params=tuple(impl.pack_params(wl, np.array(index, np.int32))), gather=(src, index),
                     row=dict(layer=ly.name, kind="channels", kernel=impl.name, dtype="int8",
                              shape=f"{x.channels}->{c} channels"))


def _gather_of_concat(p, ly, src, index, x) -> LayerPlan:
    """A gather of a concatenation's output: the concatenation's kernel in its ``gather`` form, on
    its inputs (the same requantized integers, moved): the concatenation is not written where
    gathers are all that read it (ShuffleNet-V2: concat -> shuffle -> split pieces, 4 passes over the
    unit's channels -> 2; the concatenation's own kernel is then dead)."""
    concat = p.concats[src]
    n, c, h, w = static_shape(ly.output.ty)
    wl = dataclasses.replace(concat.workload, gather=c)
    out_shape = registry.layout(x.layout).packed_shape((n, c, h, w))
    out = TensorQuant(x.scale, x.zero, c, x.layout, out_shape)
    p.produce(ly.output, out)
    p.gathered[ly.output] = (src, index)
    return LayerPlan(ly, impl=concat.impl, workload=wl, reads=concat.reads, output=out, out_shape=out_shape,
                     params=tuple(concat.impl.pack_params(wl, np.array(index, np.int32))), gather=(src, index),
                     row=dict(layer=ly.name, kind="channels", kernel=concat.impl.name, dtype="int8",
                              shape=f"{sum(concat.workload.channels)}->{c} channels of {concat.layer.name}'s inputs"))
