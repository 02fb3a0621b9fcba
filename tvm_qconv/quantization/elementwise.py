"""Planning rules of the elementwise int8 layers: a residual add (each input requantized to the
output's scale), an affine layer (a BatchNorm no conv absorbed: a multiplier, shift and offset
per channel), a lookup table (an elementwise function of one int8 tensor, 256 entries) and a
channel scale (squeeze-excite's gated multiply: a factor per image and channel, read in float or
computed from its int8 input by a table of the gate function)."""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import static_shape
from ..lut_table import dequantized_inputs, evaluate, lut_table
from ..schedules import scale_int8
from ..schedules.requantize import add_multipliers, affine_params
from ..schedules.workload import AddWorkload, AffineWorkload, LutWorkload, ScaleWorkload
from .plan import LayerPlan, TensorQuant, TensorRead
from .scales import activation_suffix, int8_clamp


def plan_add(p, ly) -> LayerPlan | str:
    # the layout most of the input channels are in (a float input is quantized into it)
    layout_name = p.majority_layout(ly.inputs)
    for name in ([layout_name] if layout_name else list(registry.LAYOUTS)):
        impl = p.first("add", name)
        if impl is not None:
            break
    else:
        return p.no_kernel("add", "these inputs")
    ra, rb = (p.read(v, impl.layout) for v in ly.inputs)
    qa, qb = ra.quant, rb.quant
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    mult_a, mult_b, shift = add_multipliers(qa.scale, qb.scale, s_y)
    activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
    wl = AddWorkload(qa.shape, mult_a, mult_b, shift, act_min, act_max, qa.zero, qb.zero, z_y)
    out = TensorQuant(s_y, z_y, qa.channels, impl.layout, qa.shape)
    p.produce(ly.output, out)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(ra, rb), output=out, out_shape=qa.shape,
                     row=dict(layer=ly.name, kind="add" + activation_suffix(activation, act_min, act_max),
                              kernel=impl.name, dtype="int8", shape=str(static_shape(ly.output.ty))))


def plan_affine(p, ly) -> LayerPlan | str:
    s_y, z_y = p.scale(ly.output), p.zero(ly.output)
    activation, act_min, act_max = int8_clamp(ly, s_y, z_y)
    n, c, h, w = static_shape(ly.output.ty)
    if ly.joined is None:
        x = p.quantized(ly.inputs[0])
        reads, layout = (TensorRead(ly.inputs[0], x),), x.layout
    else:   # a concat read in place: each input in the layout most of its channels are in
        layout = p.majority_layout(ly.inputs)
        reads = tuple(p.read(v, layout) for v in ly.inputs)
    shape = registry.layout(layout).packed_shape((n, c, h, w))
    inputs = tuple(r.quant.channels for r in reads) if ly.joined is not None else ()
    wl = AffineWorkload(shape, act_min, act_max, z_y, inputs)
    impl = p.select("affine", wl, layout=layout)
    if impl is None:
        return p.no_kernel("affine", f"{layout} tensor")
    # each channel's fixed point from its input's scale and zero point
    offsets = np.cumsum([0, *(r.quant.channels for r in reads)])
    try:
        parts = [affine_params(ly.weight[a:b], ly.bias[a:b], r.quant.scale, s_y, r.quant.zero)
                 for r, a, b in zip(reads, offsets[:-1], offsets[1:])]
    except ValueError as err:   # a multiplier past the kernel's 15 bits: the ranges disagree with the BatchNorm
        return str(err)
    mult, shift, bias = (np.concatenate([part[i] for part in parts]) for i in range(3))
    out = TensorQuant(s_y, z_y, c, impl.layout, shape)
    p.produce(ly.output, out)
    kind = "batch_norm" + activation_suffix(activation, act_min, act_max)
    return LayerPlan(ly, impl=impl, workload=wl, reads=reads, output=out, out_shape=shape,
                     params=tuple(impl.pack_params(wl, mult, shift, bias)),
                     row=dict(layer=ly.name, kind=kind if ly.joined is None else f"concat x{len(reads)}+{kind}",
                              kernel=impl.name, dtype="int8", shape=str(static_shape(ly.output.ty))))


def plan_lut(p, ly) -> LayerPlan | str:
    x = p.quantized(ly.inputs[0])
    impl = p.first("lut", x.layout)
    if impl is None:
        return p.no_kernel("lut", f"{x.layout} tensor")
    n, c, h, w = static_shape(ly.output.ty)
    wl = LutWorkload((n, h, w), c)
    table = lut_table(ly, p.value, x.scale, p.scale(ly.output), x.zero)
    out = p.produce_output(ly, impl)
    ops = " ".join(str(p.value[v].op.name).removeprefix("relax.") for v in ly.vars)
    return LayerPlan(ly, impl=impl, workload=wl, reads=(TensorRead(ly.inputs[0], x),), output=out,
                     out_shape=out.shape, params=tuple(impl.pack_params(wl, table)),
                     row=dict(layer=ly.name, kind="lut", kernel=impl.name, dtype="int8", shape=f"table of {ops}"))


def plan_scale(p, ly) -> LayerPlan | str:
    x = p.quantized(ly.inputs[0])
    impl = p.first("scale", x.layout)
    if impl is None:
        return p.no_kernel("scale", f"{x.layout} tensor")
    n, c, h, w = static_shape(ly.output.ty)
    reads, float_reads, params = (TensorRead(ly.inputs[0], x),), (ly.gate,), ()
    shift, s_y, why = 0, p.scale(ly.output), ""
    if ly.gate_chain is not None and p.quantized(ly.inputs[1]) is not None:
        # the gate's sigmoid / hard-sigmoid as a fixed-point table of its int8 input's 256 values
        gate_q = p.quantized(ly.inputs[1])
        values = evaluate(ly.gate_chain, p.value, dequantized_inputs(gate_q.scale, gate_q.zero)).astype(np.float32)
        shift = scale_int8.gate_shift(values, x.scale / s_y) or 0   # None: a gate too large, kept float
        if shift:
            reads, float_reads, params = reads + (p.read(ly.inputs[1], x.layout),), (), (values,)
        else:
            why = f" (its table's largest gate, {np.abs(values).max():.3g}, is past the fixed point's 2**21)"
    out = p.produce_output(ly, impl)
    table = shift > 0
    wl = ScaleWorkload((n, h, w), c, x.scale / out.scale, x.zero, out.zero, gate_table=table, gate_shift=shift)
    how = "a gate table of its int8 input" if table else "a float gate" + why
    return LayerPlan(ly, impl=impl, workload=wl, reads=reads, float_reads=float_reads, output=out,
                     out_shape=out.shape, params=tuple(impl.pack_params(wl, *params)),
                     row=dict(layer=ly.name, kind="scale", kernel=impl.name, dtype="int8",
                              shape=f"{static_shape(ly.output.ty)} by {how}"))
