"""The memory-bound int8 kernels every activation layout has: max- and average pool, residual
add, concat, channel gather (split pieces, shuffles), stand-alone BatchNorm, lookup-table
activations, squeeze-excite's channel scaling and LayerNorm over channels.  Their compute
definitions are layout-generic (``pool_int8.py``, ``add_int8.py``, ``concat_int8.py``,
``channels_int8.py``, ``affine_int8.py``, ``lut_int8.py``, ``scale_int8.py``,
``layer_norm_int8.py``), so each is one implementation class here, instantiated once per layout by :func:`layout_kernels` and named
``<op>.<layout>`` (``max_pool2d.nchw4c``, ``add.nhwc32``); a family's ``impls.py`` lists the
instances of its layout.  Family ``generic``: every target runs them; on CUDA the pools have
their own schedule (``pool_int8.schedule_pool``), add, affine, lut and scale the vectorized
elementwise one (``elementwise_int8.py``), LayerNorm a warp per pixel in a channels-last layout
(``layer_norm_int8.schedule_layer_norm``), the NHWC32 concat 16 bytes a thread
(``tensorcore/concat.py``); the NCHW4c concat and the channel gather are left to dlight.
"""
from __future__ import annotations

import ast

import numpy as np
import tvm

from . import add_int8, affine_int8, channels_int8, concat_int8, layer_norm_int8, lut_int8, pool_int8, scale_int8
from .elementwise_int8 import schedule_elementwise
from .kernel import WORKLOAD_ATTR, KernelImpl, Layout, no_constants, written_kernel
from .tensorcore import affine as tensorcore_affine
from .tensorcore import concat as tensorcore_concat
from .tensorcore import global_pool
from .tensorcore import scale as tensorcore_scale
from .workload import AffineWorkload, AvgPoolWorkload, ConcatWorkload, ScaleWorkload


class LayoutKernel(KernelImpl):
    """One memory-bound op in one layout (``packing``: the Layout object; ``layout``: its name)."""

    family = "generic"

    def __init__(self, packing: Layout):
        self.packing = packing
        self.layout = packing.name
        self.name = f"{self.op}.{packing.name.lower()}"

    def applies(self, wl, target) -> bool:
        return True

    def pack_params(self, wl, *arrays) -> list[np.ndarray]:
        """None by default: the op's only arguments are its int8 inputs."""
        return no_constants(self, arrays)

    def _packed(self, n: int, c: int, h: int, w: int) -> tuple[int, ...]:
        return tuple(self.packing.packed_shape((n, c, h, w)))

    def _per_pixel(self, wl) -> tuple[int, ...]:
        """The packed shape of an elementwise op of (N, H, W) = ``wl.shape`` with ``wl.channels``."""
        n, h, w = wl.shape
        return self._packed(n, wl.channels, h, w)

    def _pooled(self, wl, dilation=(1, 1), ceil_mode=False) -> tuple[int, ...]:
        """The packed shape a pool of ``wl`` writes: the input's (padded) channels at the pooled size."""
        n, c, h, w = self.packing.logical_shape(wl.shape)
        return self._packed(n, c, *pool_int8.pool_out_size(h, w, wl.pool, wl.stride, wl.padding, dilation, ceil_mode))


def _schedule_reading_x(func, target, block: str):
    """The vectorized elementwise schedule of ``block``, its reads of ``X`` vectorized (its other
    input is read by index or per channel)."""
    sch = tvm.s_tir.Schedule(func)
    names = [r.source.name for r in sch.get(sch.get_sblock(block)).reads]
    return schedule_elementwise(func, target, block, operands=(names.index("X"),))


class MaxPool2d(LayoutKernel):
    op = "max_pool2d"

    def compute(self, wl):
        return self.tag(pool_int8.max_pool2d_int8(self.packing, wl.shape, wl.pool, wl.stride, wl.padding,
                                                  wl.dilation, wl.ceil_mode), wl)

    def reference(self, wl, x):
        return pool_int8.max_pool2d_int8_ref(self.packing, x, wl.pool, wl.stride, wl.padding, wl.dilation,
                                             wl.ceil_mode)

    def schedule(self, func, target):
        return pool_int8.schedule_pool(func, target)

    def out_shape(self, wl):
        return self._pooled(wl, wl.dilation, wl.ceil_mode)


class AvgPool2d(LayoutKernel):
    op = "avg_pool2d"

    def compute(self, wl):
        return self.tag(pool_int8.avg_pool2d_int8(self.packing, wl.shape, wl.pool, wl.stride, wl.padding,
                                                  wl.mult, wl.shift, wl.in_zero, wl.out_zero), wl)

    def reference(self, wl, x):
        return pool_int8.avg_pool2d_int8_ref(self.packing, x, wl.pool, wl.stride, wl.padding, wl.mult, wl.shift,
                                             wl.in_zero, wl.out_zero)

    def schedule(self, func, target):
        wl = ast.literal_eval(str(func.attrs[WORKLOAD_ATTR]))
        h, w = self.packing.logical_shape(tuple(wl["shape"]))[2:]
        if tuple(wl["pool"]) == (h, w) and h * w >= pool_int8.GLOBAL_MIN_PIXELS:
            # a global pool of a large map (squeeze-excite's at 112 x 112) has few outputs: one thread
            # per output would sum 12,544 bytes alone; dlight's reduction rule spreads each sum over a
            # block (NCHW4c; NHWC32 has its own kernels, GlobalAvgPool2d, where they apply)
            return None
        return pool_int8.schedule_pool(func, target)

    def out_shape(self, wl):
        return self._pooled(wl)


class GlobalAvgPool2d(AvgPool2d):
    """The average pool over a whole large map in NHWC32 (squeeze-excite's squeeze): the sums of
    chunks of each image's pixels, an output the build allocates, then requantized; on CUDA a block
    per chunk with 16-byte loads (``tensorcore/global_pool.py``).  At batch 1 on an H200 dlight's
    reduction and per-output schedules of these pools took 232 of EfficientNet-B0's 613 us of kernels
    (``docs/results/kernel_profile_efficientnet_b0_b1_h200_squeeze_excite.json``)."""

    def __init__(self, packing: Layout):
        super().__init__(packing)
        self.name = f"avg_pool2d.{packing.name.lower()}.global"

    def applies(self, wl, target) -> bool:
        return global_pool.applies(wl)

    def compute(self, wl):
        return self.tag(global_pool.global_avg_pool_int8(wl), wl)

    def schedule(self, func, target):
        if target.kind.name != "cuda":
            return None
        return written_kernel(func, global_pool.global_pool_kernel(AvgPoolWorkload.of(func)))

    def scratch(self, wl):
        return [(global_pool.scratch_shape(wl), "int32")]


class Add(LayoutKernel):
    op = "add"

    def compute(self, wl):
        return self.tag(add_int8.add_int8(wl.shape, wl.mult_a, wl.mult_b, wl.shift, wl.act_min, wl.act_max,
                                          f"add_{self.layout.lower()}_int8", (wl.zero_a, wl.zero_b, wl.zero_out)), wl)

    def reference(self, wl, a, b):
        return add_int8.add_int8_ref(a, b, wl.mult_a, wl.mult_b, wl.shift, wl.act_min, wl.act_max,
                                     (wl.zero_a, wl.zero_b, wl.zero_out))

    def schedule(self, func, target):
        return schedule_elementwise(func, target, "add_requant", operands=(0, 1))

    def out_shape(self, wl):
        return tuple(wl.shape)


class Concat(LayoutKernel):
    op = "concat"

    def compute(self, wl):
        return self.tag(concat_int8.concat_int8(self.packing, wl.shape, list(wl.channels), list(wl.mults),
                                                list(wl.shifts), list(wl.zeros) or None, wl.out_zero,
                                                wl.gather), wl)

    def reference(self, wl, *args):
        xs, index = (args[:-1], args[-1]) if wl.gather else (args, None)
        return concat_int8.concat_int8_ref(self.packing, list(xs), list(wl.channels), wl.mults, wl.shifts,
                                           list(wl.zeros) or None, wl.out_zero, index)

    def schedule(self, func, target):
        if target.kind.name == "cuda" and self.layout == "NHWC32":
            # 16 channels x up to 8 pixels a thread, 16-byte stores (tensorcore/concat.py)
            kernel = tensorcore_concat.concat_kernel(ConcatWorkload.of(func))
            if kernel is not None:
                return written_kernel(func, kernel)
        return None     # dlight's kernel

    def pack_params(self, wl, *arrays) -> list:
        """A gathering concatenation's index (output channel j = concatenated channel ``index[j]``);
        none for a plain one."""
        if not wl.gather:
            return []
        index = np.asarray(arrays[0], np.int32)
        assert index.shape == (wl.gather,) and 0 <= index.min() and index.max() < sum(wl.channels), index
        return [index]

    def out_shape(self, wl):
        n, h, w = wl.shape
        return self._packed(n, wl.gather or sum(wl.channels), h, w)


class Channels(LayoutKernel):
    op = "channels"

    def compute(self, wl):
        return self.tag(channels_int8.gather_channels_int8(self.packing, wl.shape, wl.in_channels, wl.out_channels), wl)

    def reference(self, wl, x, index):
        return channels_int8.gather_channels_int8_ref(self.packing, x, wl.in_channels, index)

    def pack_params(self, wl, index) -> list:
        """The index table: output channel j reads input channel ``index[j]``."""
        index = np.asarray(index, np.int32)
        assert index.shape == (wl.out_channels,) and 0 <= index.min() and index.max() < wl.in_channels, index
        return [index]

    def out_shape(self, wl):
        n, h, w = wl.shape
        return self._packed(n, wl.out_channels, h, w)


class Lut(LayoutKernel):
    op = "lut"

    def compute(self, wl):
        n, h, w = wl.shape
        return self.tag(lut_int8.lut_int8(self.packing, self.packing.packed_shape((n, wl.channels, h, w)),
                                          wl.channels), wl)

    def reference(self, wl, x, table):
        return lut_int8.lut_int8_ref(self.packing, x, wl.channels, table)

    def schedule(self, func, target):
        # the table's index makes the Table read data-dependent: only X's reads are vectorized
        return _schedule_reading_x(func, target, "lut")

    def pack_params(self, wl, table) -> list:
        """The table: entry ``q + 128`` is the output integer for input ``q``."""
        table = np.asarray(table)
        assert table.shape == (256,) and table.min() >= -128 and table.max() <= 127, table
        return [table.astype(np.int8)]

    def out_shape(self, wl):
        return self._per_pixel(wl)


class Scale(LayoutKernel):
    """Squeeze-excite's gated multiply: int8 in, a float gate per (image, channel) -- or the gate's
    int8 input and its 256-entry table -- int8 out."""

    op = "scale"

    def compute(self, wl):
        n, h, w = wl.shape
        return self.tag(scale_int8.scale_int8(self.packing, self.packing.packed_shape((n, wl.channels, h, w)),
                                              wl.channels, wl.rescale, wl.in_zero, wl.out_zero, wl.gate_table,
                                              wl.gate_shift), wl)

    def reference(self, wl, x, gate, table=None):
        return scale_int8.scale_int8_ref(self.packing, x, gate, wl.channels, wl.rescale, wl.in_zero, wl.out_zero,
                                         table, wl.gate_shift)

    def schedule(self, func, target):
        if target.kind.name == "cuda" and self.layout == "NHWC32":
            # 16 channels x up to 8 pixels a thread, their factors computed once
            kernel = tensorcore_scale.scale_kernel(ScaleWorkload.of(func))
            if kernel is not None:
                return written_kernel(func, kernel)
        # the gate is one value per (image, channel): only X's reads are vectorized
        return _schedule_reading_x(func, target, "scale")

    def pack_params(self, wl, *table) -> list:
        if not wl.gate_table:
            return no_constants(self, table)
        # the gate's float values -> int32 fixed point at the workload's shift (scale_int8.py)
        return [scale_int8.gate_multipliers(table[0], wl.rescale, wl.gate_shift)]

    def out_shape(self, wl):
        return self._per_pixel(wl)


class LayerNorm(LayoutKernel):
    """A LayerNorm over each pixel's channels: int8 in, int8 out, exact integer statistics."""

    op = "layer_norm"

    def compute(self, wl):
        n, h, w = wl.shape
        return self.tag(layer_norm_int8.layer_norm_int8(self.packing, self._per_pixel(wl), wl.channels, wl.out_zero),
                        wl)

    def reference(self, wl, x, gain, offset, consts):
        return layer_norm_int8.layer_norm_int8_ref(self.packing, x, gain, offset, consts, wl.channels, wl.out_zero)

    def schedule(self, func, target):
        return layer_norm_int8.schedule_layer_norm(func, target)

    def pack_params(self, wl, gain, offset, consts) -> list:
        return [np.ascontiguousarray(gain, np.int64), np.ascontiguousarray(offset, np.int64),
                np.ascontiguousarray(consts, np.float64)]

    def out_shape(self, wl):
        return self._per_pixel(wl)


class Affine(LayoutKernel):
    """A per-channel affine (BatchNorm) with its clamp; of one int8 tensor, or of the concatenation of
    several that it reads in place (``AffineWorkload.inputs``)."""

    op = "affine"

    def compute(self, wl):
        return self.tag(affine_int8.affine_int8(self.packing, wl.shape, wl.act_min, wl.act_max, wl.out_zero,
                                                tuple(wl.inputs)), wl)

    def reference(self, wl, *args):
        *xs, mult, shift, bias = args
        return affine_int8.affine_int8_ref(self.packing, xs if wl.inputs else xs[0], mult, shift, bias, wl.act_min,
                                           wl.act_max, wl.out_zero, tuple(wl.inputs))

    def schedule(self, func, target):
        if target.kind.name == "cuda" and self.layout == "NHWC32":
            # 16 channels x up to 8 pixels a thread, the concat's inputs read in place by vector
            kernel = tensorcore_affine.affine_kernel(AffineWorkload.of(func))
            if kernel is not None:
                return written_kernel(func, kernel)
        # one input: its bytes loaded 16 at a time; several: each byte from its input, the stores vectorized
        return schedule_elementwise(func, target, "affine", operands=(0,) if len(func.params) == 5 else ())

    def pack_params(self, wl, mult, shift, bias) -> list:
        return affine_int8.pack_affine(self.packing, wl.shape, mult, shift, bias)

    def out_shape(self, wl):
        return tuple(wl.shape)


def layout_kernels(packing: Layout) -> tuple[LayoutKernel, ...]:
    """The max-pool, add, concat, channel gather, average pool (NHWC32: its whole-map pool first),
    affine, lookup-table, channel-scale and LayerNorm implementations of ``packing``."""
    whole_map = (GlobalAvgPool2d(packing),) if packing.name == "NHWC32" else ()
    return (MaxPool2d(packing), Add(packing), Concat(packing), Channels(packing), *whole_map,
            AvgPool2d(packing), Affine(packing), Lut(packing), Scale(packing), LayerNorm(packing))
