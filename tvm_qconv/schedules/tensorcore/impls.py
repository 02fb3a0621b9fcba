"""The tensor-core family's kernel implementations, as the registry (``tvm_qconv/registry.py``) sees them.

=============================  ==========  ==============================================================
name                           op          runs
=============================  ==========  ==============================================================
``conv2d.nhwc32.mma``          conv2d      CUDA sm_80+, ``mma.sync.m16n8k32`` s8; template space; a table
                                           or a residual add in the epilogue
``conv2d.nhwc32.depthwise``    conv2d      CUDA sm_80+, depthwise convs (memory-bound: ``depthwise.py``);
                                           with the LayerNorm after it at batch 1
                                           (``depthwise_layer_norm.py``)
``conv2d.nhwc32.grouped``      conv2d      CUDA sm_80+, grouped convs (and one group of < 16 input
                                           channels) on ``__dp4a`` (``grouped.py``): no relayouts around them
``conv2d.nhwc32.grouped_mma``  conv2d      CUDA sm_80+, grouped convs of group widths dividing 32 (or 64,
                                           128) as GEMMs per 32 channels on ``mma.sync`` (``grouped_gemm.py``);
                                           preferred from 16 channels a group (measured)
``dense.rows.mma``             dense       CUDA sm_80+, 2+ rows: the same template, float epilogue
``max_pool2d.nhwc32``          max_pool2d  any target (16 channels per thread on CUDA: ``pool.py``)
``add.nhwc32``                 add         any target (16 bytes per thread on CUDA: ``elementwise_int8.py``)
``concat.nhwc32``              concat      any target (16 bytes per thread on CUDA: ``concat.py``)
``channels.nhwc32``            channels    split, shuffle; any target (dlight on CUDA)
``avg_pool2d.nhwc32.global``   avg_pool2d  a pool over a whole map of 49+ pixels: per-chunk sums, then
                                           requantized (written out on CUDA: ``global_pool.py``)
``avg_pool2d.nhwc32``          avg_pool2d  any target (one thread per output on CUDA)
``affine.nhwc32``              affine      inference BatchNorm no conv absorbs, a concat's inputs read in
                                           place (written out on CUDA: ``affine.py``)
``scale.nhwc32``               scale       squeeze-excite's gated multiply (written out on CUDA: ``scale.py``)
``quantize.nhwc32.generic``    quantize    float NCHW -> NHWC32, any target (threads on pixels on CUDA:
                                           ``channels_last_conversions.py``)
``dequantize.nhwc32.generic``  dequantize  NHWC32 -> float NCHW, any target (the same on CUDA)
=============================  ==========  ==============================================================

The two conversions (``schedules/conversion_kernels.py``) are made with the layout
(``layout.py``) and are not in :data:`IMPLEMENTATIONS`: the registry lists every layout's
conversions together.
"""
from __future__ import annotations

import tvm

from tvm_qconv.target import TargetInfo

from .. import epilogue_residual, epilogue_table
from ..kernel import KernelImpl, written_kernel
from ..dense_int8 import DenseWorkload
from ..layout_kernels import layout_kernels
from ..workload import ConvWorkload
from . import (conv2d, dense, depthwise, depthwise_dp4a, depthwise_layer_norm, grouped, grouped_gemm, mma, pipeline,
               space)
from .pool import MaxPool2dNhwc32
from .layout import LAYOUT

# A layer with fewer input channels than this runs better on dp4a: its channels are padded to 32
# for the mma K step (VGG16's first conv, 3 channels, would do 10x the multiply-adds), against 4.
MIN_IN_CHANNELS = 16


def _defaults(sch, target):
    return mma.default_decisions(*mma.gemm_extents(sch), TargetInfo.from_target(target).num_sm)


def _default_schedule(func, target):
    """The template with its default decisions (``mma.default_decisions``)."""
    sch = tvm.s_tir.Schedule(func)
    decisions, stages = _defaults(sch, target)
    mma.apply_mma_schedule(sch, decisions, stages)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


class Conv2dMma(KernelImpl):
    """The fused conv as an implicit GEMM on int8 tensor cores (``conv2d.py``, ``mma.py``); with
    ``out_dtype="int32"`` the training path's forward, its accumulators stored (``conv2d_nhwc_int32``)."""

    name = "conv2d.nhwc32.mma"
    op = "conv2d"
    layout = LAYOUT.name
    family = "mma"
    runs_on = "CUDA sm_80+"
    spaces = space.SPACES
    instruction = "mma.sync"
    takes_table = True
    takes_residual = True
    takes_splits = True     # the int32 form's split-K (the training path's weight gradient)

    def applies(self, wl: ConvWorkload, target) -> bool:
        # A GEMM of exactly one 16-row fragment (M = batch x out_h x out_w = 16: ConvNeXt's
        # 4x4 stage at batch 1 and 64 px) makes TVM's reverse_compute_at of the epilogue fail
        # (its region check cannot prove the single fragment row); such a layer is tiny: dp4a.
        # int32 out: the training path's forward (the accumulators, no epilogue: conv2d_nhwc_int32)
        return (target.kind == "cuda" and target.has_int8_mma and wl.groups == 1 and wl.in_channels >= MIN_IN_CHANNELS
                and (wl.out_dtype == "int8" or (wl.in_zero == 0 and not wl.norm))
                and conv2d.gemm_shape(wl)[0] != 16)

    def compute(self, wl: ConvWorkload):
        if wl.out_dtype == "int32":
            return self.tag(conv2d.conv2d_nhwc_int32(wl), wl)
        return self.tag(conv2d.conv2d_nhwc_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        if wl.out_dtype == "int32":
            return conv2d.conv2d_nhwc_int32_ref(wl, *args)
        return epilogue_residual.reference(
            wl, args, lambda wl, *a: epilogue_table.reference(LAYOUT, wl, a, conv2d.conv2d_nhwc_int8_ref))

    def pack_params(self, wl, weight, bias, mult, shift):
        return [conv2d.pack_weight(weight), conv2d.pack_channels(bias), conv2d.pack_channels(mult),
                conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))

    def _defaults(self, sch, target):
        return _defaults(sch, target)

    def schedule(self, func, target):
        return _default_schedule(func, target)

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


class Conv2dDepthwise(KernelImpl):
    """Depthwise convs (any channel multiplier) in the tensor cores' layout, where the convs
    around them run: ``depthwise.py``.  GPUs without int8 tensor cores keep the NCHW4c kernel."""

    name = "conv2d.nhwc32.depthwise"
    op = "conv2d"
    layout = LAYOUT.name
    family = "depthwise"
    runs_on = "CUDA sm_80+"
    takes_table = True
    takes_norm = True
    follows_input = True

    def applies(self, wl: ConvWorkload, target) -> bool:
        return (target.kind == "cuda" and target.has_int8_mma and wl.is_depthwise and wl.out_dtype == "int8"
                and (not wl.norm or depthwise_layer_norm.takes(wl)))

    def compute(self, wl: ConvWorkload):
        return self.tag(depthwise.depthwise_nhwc32_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return epilogue_table.reference(LAYOUT, wl, args, depthwise.depthwise_nhwc32_int8_ref)

    def schedule(self, func, target):
        wl = ConvWorkload.of(func)
        if wl.norm:   # with the LayerNorm after it: only the written-out kernel computes both
            return written_kernel(func, depthwise_layer_norm.depthwise_layer_norm_kernel(wl))
        return depthwise.schedule_cuda(func, target, written=depthwise_dp4a.depthwise_dp4a_kernel)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [depthwise.pack_depthwise(weight), conv2d.pack_channels(bias), conv2d.pack_channels(mult),
                conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))


class Conv2dGrouped(KernelImpl):
    """Grouped convs (group widths a multiple of 4: ResNeXt, RegNet) in the tensor cores' layout on
    ``__dp4a`` (``grouped.py``): no relayout around them.  Preferred over the NCHW4c dp4a kernel: on an
    H200 (2026-11-28) ResNeXt-50 at batch 64 ran 2.26 ms of kernels with it against 3.68 ms with the
    NCHW4c kernel and its 32 relayouts, the grouped kernels themselves about as fast as the NCHW4c
    ones (229 against 209 us, 206 against 262 us for the two largest:
    ``docs/results/kernel_profile_resnext50_32x4d_b64_h200_{grouped,nchw4c}.json``).  Also one
    group of fewer than 16 input channels, where its input already is NHWC32 (``follows_input``;
    otherwise the stem or NCHW4c kernels keep it: ``preferred``)."""

    name = "conv2d.nhwc32.grouped"
    op = "conv2d"
    layout = LAYOUT.name
    family = "grouped"
    runs_on = "CUDA sm_80+"
    instruction = "dp4a"
    follows_input = True

    def preferred(self, wl: ConvWorkload, target) -> bool:
        return wl.groups > 1

    def applies(self, wl: ConvWorkload, target) -> bool:
        return target.kind == "cuda" and target.has_int8_mma and grouped.takes(wl)

    def compute(self, wl: ConvWorkload):
        return self.tag(grouped.grouped_nhwc32_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return grouped.grouped_nhwc32_int8_ref(wl, *args)

    def schedule(self, func, target):
        if target.kind.name != "cuda":
            return None
        return written_kernel(func, grouped.grouped_kernel(ConvWorkload.of(func)))

    def pack_params(self, wl, weight, bias, mult, shift):
        return [grouped.pack_grouped(weight, wl.groups), conv2d.pack_channels(bias), conv2d.pack_channels(mult),
                conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))


MMA_GROUP_WIDTH = 16   # grouped convs with this many channels a group and more: GEMMs on the tensor cores


class Conv2dGroupedMma(KernelImpl):
    """Grouped convs as GEMMs on the int8 tensor cores (``grouped_gemm.py``): each 32 output channels
    a GEMM of their super-group's 32 input channels (or one group of 64 or 128), the mma.sync template
    with one super-group a block.  Applies where a group has as many inputs as outputs and its width
    divides 32 or is 64 or 128 (ResNeXt, RegNet-X-400MF; ``grouped_gemm.super_width``).

    Preferred untuned for groups of ``MMA_GROUP_WIDTH`` channels and more, the dp4a kernel below that
    (registry order), as measured on an H200 at batch 64 (2026-11-28, ``docs/performance.md``):
    RegNet-X-400MF's groups of 16 took 0.33 ms on the tensor cores against 0.57 ms (one output word a
    thread) and 0.82 ms (4 words) on dp4a, every layer faster; ResNeXt-50's groups of 16 and 32 too
    (177 against 206 us, 38 against 127 us), but its groups of 4 and 8 not (489 against 125 us, 215
    against 104 us: a super-group of 8 or 4 groups multiplies 8 or 4 times the useful products).
    No search space yet, so a tuning database does not choose between it and the dp4a kernel
    (``tuning.apply.measured_chooser`` compares tunable implementations only)."""

    name = "conv2d.nhwc32.grouped_mma"
    op = "conv2d"
    layout = LAYOUT.name
    family = "grouped_mma"
    runs_on = "CUDA sm_80+"
    instruction = "mma.sync"

    def preferred(self, wl: ConvWorkload, target) -> bool:
        return wl.out_channels // wl.groups >= MMA_GROUP_WIDTH

    def applies(self, wl: ConvWorkload, target) -> bool:
        return target.kind == "cuda" and target.has_int8_mma and grouped_gemm.takes(wl)

    def compute(self, wl: ConvWorkload):
        return self.tag(grouped_gemm.grouped_gemm_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return grouped_gemm.grouped_gemm_int8_ref(wl, *args)

    def schedule(self, func, target):
        if target.kind.name != "cuda":
            return None
        return grouped_gemm.schedule(func, TargetInfo.from_target(target).num_sm)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [grouped_gemm.pack_weight(wl, weight), conv2d.pack_channels(bias),
                conv2d.pack_channels(mult), conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))

    def prepare(self) -> None:
        mma.intrinsics()

    def compile_options(self) -> dict:
        return pipeline.compile_options()


# Fewer rows than this and a linear layer is a GEMV, which dlight's GEMV rule streams at the
# weights' read speed.  From 2 rows on, dlight has only its SIMT matmul rule: VGG16's fc6 at
# batch 16 took 781 us there (30 % of the model's GPU time, H100, 2026-11-25,
# benchmarks/kernel_profile.py) against ~96 us on this GEMM padded to 128 rows
# (benchmarks/dense_layers.py measures both at every batch: docs/history.md).
MIN_DENSE_ROWS = 2


class DenseMma(KernelImpl):
    """The int8 linear layer as a GEMM on int8 tensor cores (``dense.py``: the conv template)."""

    name = "dense.rows.mma"
    op = "dense"
    layout = "rows"
    family = "mma"
    runs_on = "CUDA sm_80+"
    instruction = "mma.sync"

    def applies(self, wl: DenseWorkload, target) -> bool:
        return target.kind == "cuda" and target.has_int8_mma and wl.batch >= MIN_DENSE_ROWS

    def in_features_padded(self, wl: DenseWorkload) -> int:
        return dense.gemm_shape(wl)[2]

    def pack_params(self, wl: DenseWorkload, weight, scale, bias):
        return dense.pack_params(wl, weight, scale, bias)

    def compute(self, wl: DenseWorkload):
        return self.tag(dense.dense_mma_int8(wl), wl)

    def reference(self, wl: DenseWorkload, *args):
        return dense.dense_mma_int8_ref(wl, *args)

    def out_shape(self, wl: DenseWorkload) -> tuple[int, ...]:
        return (wl.batch, wl.out_features)

    def schedule(self, func, target):
        return _default_schedule(func, target)

    def prepare(self) -> None:
        mma.intrinsics()

    def compile_options(self) -> dict:
        return pipeline.compile_options()


CONV2D_MMA = Conv2dMma()
CONV2D_DEPTHWISE = Conv2dDepthwise()
CONV2D_GROUPED = Conv2dGrouped()
CONV2D_GROUPED_MMA = Conv2dGroupedMma()
DENSE_MMA = DenseMma()
# the layout's memory-bound kernels, the max-pool with its vector CUDA kernel (``pool.py``)
IMPLEMENTATIONS = (CONV2D_MMA, CONV2D_DEPTHWISE, CONV2D_GROUPED, CONV2D_GROUPED_MMA, DENSE_MMA, MaxPool2dNhwc32(LAYOUT),
                   *(k for k in layout_kernels(LAYOUT) if k.op != "max_pool2d"))
