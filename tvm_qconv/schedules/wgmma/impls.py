"""The wgmma family's kernel implementation, as the registry (``tvm_qconv/registry.py``) sees it.

=============================  =======  =====================================================
name                           op       runs
=============================  =======  =====================================================
``conv2d.nhwc32.wgmma``        conv2d   CUDA sm_90a (H100 / H200), 16+ input channels, convs
                                        TMA im2col can gather (``conv2d.supports``), tiles of
                                        64+ columns; untuned, only layers of at least one
                                        tile per SM (:meth:`Conv2dWgmma.preferred`)
=============================  =======  =====================================================

It shares the mma.sync family's layout (NHWC32), compute definition, NumPy reference and packed
weights (it subclasses ``Conv2dMma``), so the two mix layer by layer with no conversion between
them, and the max-pool, add, concat and affine kernels of NHWC32 serve both.  One difference:
a padded conv of an unsigned input, which must pad with -128 where TMA fills 0, takes the
compute's ``border`` form, its bias a table per border class (``schedules/border_bias.py``).  Its schedule is
not a schedule of that compute: it is the hand-written TIRx kernel of ``conv2d.py`` with the
same arguments.  Its search space is the kernel's ``Config`` (``space.py``: a few tiles per
layer, each measured once), recorded as a trace of the compute definition, so the tuner
measures it beside the mma.sync and dp4a kernels and the build takes the fastest per layer.
"""
from __future__ import annotations

import numpy as np

from tvm_qconv.target import TargetInfo

from .. import border_bias
from ..kernel import tirx_kernel
from ..tensorcore import conv2d as tc_conv2d
from ..tensorcore import pipeline
from ..tensorcore.impls import MIN_IN_CHANNELS, Conv2dMma
from ..workload import ConvWorkload
from . import conv2d, space

# Narrower tiles than this (O_p = 352, 416, ...: no wider wgmma N divides them) would re-read
# the activations O_p / BN times; mma.sync takes those layers (reasoned, not measured).
MIN_TILE_COLUMNS = 64


class Conv2dWgmma(Conv2dMma):
    """The fused conv as a persistent, warp-specialized implicit GEMM on ``wgmma.mma_async``.

    Compute definition, reference, packed parameters and output shape: the mma.sync family's
    (inherited); the schedule is the TIRx kernel."""

    name = "conv2d.nhwc32.wgmma"
    family = "wgmma"
    runs_on = "--arch sm_90a (Hopper)"
    spaces = ("configs",)
    search = "exhaustive"
    own_task = True
    instruction = "wgmma"
    takes_residual = False   # its epilogue is written in the TIRx kernel: a table, no other addend

    def compute(self, wl: ConvWorkload):
        if wl.out_dtype == "int32":      # the training forward's accumulators, as the mma.sync family's
            return super().compute(wl)
        return self.tag(tc_conv2d.conv2d_nhwc_int8(wl, border=True), wl)

    def pack_params(self, wl, weight, bias, mult, shift):
        packed = super().pack_params(wl, weight, bias, mult, shift)
        if wl.pads_with_zero_point:   # the bias per border class, each row padded to O_p
            packed[1] = np.stack([tc_conv2d.pack_channels(row) for row in border_bias.bias_table(wl, weight, bias)])
        return packed

    def applies(self, wl: ConvWorkload, target) -> bool:
        # int32 outputs (the training convs) take this kernel only as a measured choice
        # (``tvm_qconv/nn/conv_tiles.py``): its tuning space and records describe int8 layers
        if not (target.kind == "cuda" and target.has_wgmma and wl.in_channels >= MIN_IN_CHANNELS
                and wl.out_dtype == "int8" and conv2d.supports(wl)):
            return False
        return conv2d.default_config(wl).bn >= MIN_TILE_COLUMNS

    def preferred(self, wl: ConvWorkload, target) -> bool:
        # A layer of fewer tiles than SMs leaves SMs idle under this persistent one-tile-per-
        # consumer kernel, where the mma.sync template splits it finer: VGG16 at batch 1 (most
        # layers under 132 tiles) ran 0.318 ms all-wgmma vs 0.292 ms all-mma on an H100, at
        # batch 64 (every layer 392+ tiles) 4.07 vs 5.98 ms.  Untuned, such layers take mma.sync;
        # a tuning database that measured both families per layer overrides this.
        return conv2d.tiles(wl, conv2d.default_config(wl)) >= target.num_sm

    def schedule(self, func, target):
        """The TIRx kernel in place of ``func``, keeping its attributes (implementation, workload)."""
        wl = ConvWorkload.of(func)
        kernel = conv2d.conv2d_wgmma(wl, conv2d.default_config(wl), TargetInfo.from_target(target).num_sm)
        return tirx_kernel(func, kernel)

    def space_size(self, wl) -> int:
        return len(space.candidate_configs(wl))

    def trace_point(self, sch, wl, index: int) -> None:
        space.apply_config(sch, wl, index)

    def seed(self, sch, target, wl=None) -> None:
        space.apply_config(sch, wl if wl is not None else ConvWorkload.of(sch.mod["main"]), 0)

    def space_generator(self, space_name: str, func, target):
        if space_name not in self.spaces:
            raise ValueError(f"unknown wgmma search space {space_name!r}; it has {', '.join(self.spaces)}")
        raise ValueError(f"{self.name}'s space is measured point by point (search = exhaustive), "
                         f"not sampled by MetaSchedule")

    def decision(self, scheduled) -> str:
        found = space.chosen(scheduled)
        return f"wgmma {space.describe(found[1])}" if found else ""

    def realize(self, func, target):
        found = space.chosen(func)
        if found is None:
            return None
        wl, config = found
        return conv2d.conv2d_wgmma(wl, config, TargetInfo.from_target(target).num_sm)

    def tuned(self, scheduled, func, target):
        """The layer's own kernel (``func``'s workload) with the record's tile: a record may be
        the layer's symmetric twin's (``tuning/apply.py``), whose workload has another zero point,
        clamp and bias shape."""
        found = space.chosen(scheduled)
        if found is None:
            return super().tuned(scheduled, func, target)
        kernel = conv2d.conv2d_wgmma(ConvWorkload.of(func), found[1], TargetInfo.from_target(target).num_sm)
        return tirx_kernel(func, kernel)

    def compile_options(self) -> dict:
        return pipeline.compile_options()


CONV2D_WGMMA = Conv2dWgmma()
IMPLEMENTATIONS = (CONV2D_WGMMA,)
