"""The tensor-core family's kernel implementations, as the registry (``tvm_qconv/registry.py``) sees them.

=========================  ===========  ==================================================
name                       op           runs
=========================  ===========  ==================================================
``conv2d.nhwc32.mma``      conv2d       CUDA sm_80+, ``mma.sync.m16n8k32`` s8; template space
``max_pool2d.nhwc32``      max_pool2d   any target (one thread per output on CUDA)
``add.nhwc32``             add          any target (dlight on CUDA)
``concat.nhwc32``          concat       any target (dlight on CUDA)
``avg_pool2d.nhwc32``      avg_pool2d   any target (one thread per output on CUDA)
``affine.nhwc32``          affine       inference BatchNorm no conv absorbs (dlight on CUDA)
=========================  ===========  ==================================================
"""
from __future__ import annotations

import tvm

from tvm_qconv.target import TargetInfo

from .. import add_int8, affine_int8, concat_int8, pool_int8
from ..kernel import GenericKernel, KernelImpl
from ..workload import ConvWorkload
from . import conv2d, mma, pipeline, space
from .layout import LAYOUT

# A layer with fewer input channels than this runs better on dp4a: its channels are padded to 32
# for the mma K step (VGG16's first conv, 3 channels, would do 10x the multiply-adds), against 4.
MIN_IN_CHANNELS = 16


class Conv2dMma(KernelImpl):
    """The fused conv as an implicit GEMM on int8 tensor cores (``conv2d.py``, ``mma.py``)."""

    name = "conv2d.nhwc32.mma"
    op = "conv2d"
    layout = LAYOUT.name
    family = "mma"
    spaces = space.SPACES

    def applies(self, wl: ConvWorkload, target) -> bool:
        # A GEMM of exactly one 16-row fragment (M = batch x out_h x out_w = 16: ConvNeXt's
        # 4x4 stage at batch 1 and 64 px) makes TVM's reverse_compute_at of the epilogue fail
        # (its region check cannot prove the single fragment row); such a layer is tiny: dp4a.
        return (target.kind == "cuda" and target.has_int8_mma and wl.groups == 1 and wl.out_dtype == "int8"
                and wl.in_channels >= MIN_IN_CHANNELS and conv2d.gemm_shape(wl)[0] != 16)

    def compute(self, wl: ConvWorkload):
        return self.tag(conv2d.conv2d_nhwc_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return conv2d.conv2d_nhwc_int8_ref(wl, *args)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [conv2d.pack_weight(weight), conv2d.pack_channels(bias), conv2d.pack_channels(mult),
                conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))

    def _defaults(self, sch, target):
        return mma.default_decisions(*mma.gemm_extents(sch), TargetInfo.from_target(target).num_sm)

    def schedule(self, func, target):
        sch = tvm.s_tir.Schedule(func)
        decisions, stages = self._defaults(sch, target)
        mma.apply_mma_schedule(sch, decisions, stages)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)

    def seed(self, sch, target, wl: ConvWorkload | None = None) -> None:  # the GEMM extents are all it needs
        decisions, stages = self._defaults(sch, target)
        mma.apply_mma_schedule(sch, decisions, stages)

    def space_generator(self, space_name: str, func, target):
        _, stages = self._defaults(tvm.s_tir.Schedule(func), target)
        return space.space_generator(stages, space_name)

    def tuning_target(self, target):
        config = dict(target.export())
        config["max_shared_memory_per_block"] = mma.DYN_SMEM_BUDGET
        return tvm.target.Target(config, host=target.host)

    def prepare(self) -> None:
        mma.intrinsics()

    def compile_options(self) -> dict:
        return pipeline.compile_options()


class MaxPool2d(pool_int8.PoolKernel):
    name = "max_pool2d.nhwc32"
    op = "max_pool2d"
    layout = LAYOUT.name
    compute_fn = lambda wl: pool_int8.max_pool2d_int8(LAYOUT, wl.shape, wl.pool, wl.stride, wl.padding,  # noqa: E731
                                                      wl.dilation, wl.ceil_mode)
    reference_fn = lambda wl, x: pool_int8.max_pool2d_int8_ref(LAYOUT, x, wl.pool, wl.stride, wl.padding,  # noqa: E731
                                                               wl.dilation, wl.ceil_mode)


class AvgPool2d(pool_int8.PoolKernel):
    name = "avg_pool2d.nhwc32"
    op = "avg_pool2d"
    layout = LAYOUT.name
    compute_fn = lambda wl: pool_int8.avg_pool2d_int8(LAYOUT, wl.shape, wl.pool, wl.stride, wl.padding,  # noqa: E731
                                                      wl.mult, wl.shift)
    reference_fn = lambda wl, x: pool_int8.avg_pool2d_int8_ref(LAYOUT, x, wl.pool, wl.stride, wl.padding,  # noqa: E731
                                                               wl.mult, wl.shift)


class Add(GenericKernel):
    name = "add.nhwc32"
    op = "add"
    layout = LAYOUT.name
    compute_fn = lambda wl: add_int8.add_int8(wl.shape, wl.mult_a, wl.mult_b, wl.shift, wl.act_min,  # noqa: E731
                                              wl.act_max, "add_nhwc_int8")
    reference_fn = lambda wl, a, b: add_int8.add_int8_ref(a, b, wl.mult_a, wl.mult_b, wl.shift,  # noqa: E731
                                                          wl.act_min, wl.act_max)


class Concat(GenericKernel):
    name = "concat.nhwc32"
    op = "concat"
    layout = LAYOUT.name
    compute_fn = lambda wl: concat_int8.concat_int8(LAYOUT, wl.shape, list(wl.channels),  # noqa: E731
                                                     list(wl.mults), list(wl.shifts))
    reference_fn = lambda wl, *xs: concat_int8.concat_int8_ref(LAYOUT, list(xs), list(wl.channels),  # noqa: E731
                                                                wl.mults, wl.shifts)


class Affine(GenericKernel):
    name = "affine.nhwc32"
    op = "affine"
    layout = LAYOUT.name
    compute_fn = lambda wl: affine_int8.affine_int8(LAYOUT, wl.shape, wl.act_min, wl.act_max)  # noqa: E731
    reference_fn = lambda wl, x, mult, shift, bias: affine_int8.affine_int8_ref(  # noqa: E731
        LAYOUT, x, mult, shift, bias, wl.act_min, wl.act_max)

    def pack_params(self, wl, mult, shift, bias) -> list:
        return affine_int8.pack_affine(LAYOUT, wl.shape, mult, shift, bias)


CONV2D_MMA = Conv2dMma()
MAX_POOL2D = MaxPool2d()
ADD = Add()
CONCAT = Concat()
AVG_POOL2D = AvgPool2d()
AFFINE = Affine()
IMPLEMENTATIONS = (CONV2D_MMA, MAX_POOL2D, ADD, CONCAT, AVG_POOL2D, AFFINE)
