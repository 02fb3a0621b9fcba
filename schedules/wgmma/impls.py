"""The wgmma family's kernel implementation, as the registry (``tvm_qconv/registry.py``) sees it.

=============================  =======  =====================================================
name                           op       runs
=============================  =======  =====================================================
``conv2d.nhwc32.wgmma``        conv2d   CUDA sm_90a (H100 / H200), 16+ input channels, convs
                                        TMA im2col can gather (``conv2d.supports``)
=============================  =======  =====================================================

It shares the mma.sync family's layout (NHWC32), compute definition, NumPy reference and packed
weights, so the two mix layer by layer with no conversion between them, and the max-pool, add,
concat and affine kernels of NHWC32 serve both.  Its schedule is not a schedule of that compute:
it is the hand-written TIRx kernel of ``conv2d.py`` with the same arguments.  No search space:
MetaSchedule cannot sample a TIRx kernel's decisions (``docs/wgmma.md``).
"""
from __future__ import annotations

from tvm_qconv.target import TargetInfo

from ..kernel import KernelImpl, TIRX_ATTR
from ..tensorcore import conv2d as nhwc32_conv2d
from ..tensorcore import pipeline
from ..tensorcore.impls import MIN_IN_CHANNELS
from ..tensorcore.layout import LAYOUT
from ..workload import ConvWorkload
from . import conv2d


class Conv2dWgmma(KernelImpl):
    """The fused conv as a persistent, warp-specialized implicit GEMM on ``wgmma.mma_async``."""

    name = "conv2d.nhwc32.wgmma"
    op = "conv2d"
    layout = LAYOUT.name
    family = "wgmma"
    instruction = "wgmma"

    def applies(self, wl: ConvWorkload, target) -> bool:
        # A layer of fewer tiles than SMs leaves SMs idle under this persistent one-tile-per-
        # consumer kernel, where the mma.sync template splits it finer: VGG16 at batch 1 (most
        # layers under 132 tiles) ran 0.318 ms all-wgmma vs 0.292 ms all-mma on an H100, at
        # batch 64 (every layer 392+ tiles) 4.07 vs 5.98 ms.  The threshold is reasoned from
        # that, not measured layer by layer.
        return (target.kind == "cuda" and target.has_wgmma and wl.in_channels >= MIN_IN_CHANNELS
                and conv2d.supports(wl) and conv2d.tiles(wl, conv2d.default_config(wl)) >= target.num_sm)

    def compute(self, wl: ConvWorkload):
        return self.tag(nhwc32_conv2d.conv2d_nhwc_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return nhwc32_conv2d.conv2d_nhwc_int8_ref(wl, *args)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [nhwc32_conv2d.pack_weight(weight), nhwc32_conv2d.pack_channels(bias),
                nhwc32_conv2d.pack_channels(mult), nhwc32_conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return LAYOUT.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))

    def config(self, wl: ConvWorkload) -> conv2d.Config:
        return conv2d.default_config(wl)

    def schedule(self, func, target):
        """The TIRx kernel in place of ``func``, keeping its attributes (implementation, workload)."""
        wl = ConvWorkload.of(func)
        kernel = conv2d.conv2d_wgmma(wl, self.config(wl), TargetInfo.from_target(target).num_sm)
        attrs = {k: v for k, v in func.attrs.items()}
        attrs[TIRX_ATTR] = True
        # "tirx.is_scheduled": the mark dlight reads (its rules would parse a TIRx kernel as S-TIR)
        attrs.update({"tir.is_scheduled": True, "tirx.is_scheduled": True})
        return kernel.with_attr(attrs)

    def compile_options(self) -> dict:
        return pipeline.compile_options()


CONV2D_WGMMA = Conv2dWgmma()
IMPLEMENTATIONS = (CONV2D_WGMMA,)
