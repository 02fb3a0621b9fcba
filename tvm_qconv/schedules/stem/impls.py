"""The stem conv's kernel implementation, as the registry (``tvm_qconv/registry.py``) sees it.

=========================  =======  =========================================================
name                       op       runs
=========================  =======  =========================================================
``conv2d.nhwc32.stem``     conv2d   CUDA with int8 tensor cores (sm_80+): a conv of 1-4 input
                                    channels, NCHW4c in, NHWC32 out, on ``mma.sync``
=========================  =======  =========================================================

The one implementation whose input layout differs from its output's (``in_layout``): it reads
the image as the quantizer packs it for dp4a (4 channels = one int32 per pixel: one 32-bit
register of mma's A fragment) and writes the
layout of the tensor-core families that take the next layer.  It applies only where those
families exist (sm_80+) and can take its output (16+ channels); elsewhere the dp4a family keeps
the first conv in NCHW4c.
"""
from __future__ import annotations

from .. import epilogue_table
from ..kernel import KernelImpl, tirx_kernel
from ..nchw4c.layout import LAYOUT as NCHW4C
from ..tensorcore import pipeline
from ..tensorcore.conv2d import pack_channels
from ..tensorcore.impls import MIN_IN_CHANNELS
from ..tensorcore.layout import LAYOUT as NHWC32
from ..workload import ConvWorkload
from tvm_qconv.target import TargetInfo
from . import conv2d


class Conv2dStem(KernelImpl):
    """A first conv (1-4 input channels) on mma.sync, NCHW4c in, NHWC32 out (``conv2d.py``)."""

    name = "conv2d.nhwc32.stem"
    op = "conv2d"
    layout = NHWC32.name
    in_layout = NCHW4C.name
    family = "stem"
    runs_on = "CUDA sm_80+"
    spaces = ()
    instruction = "mma.sync"
    takes_table = True

    def applies(self, wl: ConvWorkload, target) -> bool:
        # Its output must be able to feed tensor cores (16+ channels): a stem of fewer output
        # channels is followed by a dp4a layer in NCHW4c, and writing NHWC32 would only add a
        # layout conversion between the two.
        return (target.kind == "cuda" and target.has_int8_mma and conv2d.supports(wl)
                and wl.out_channels >= MIN_IN_CHANNELS)

    def compute(self, wl: ConvWorkload):
        return self.tag(conv2d.conv2d_stem_compute(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return epilogue_table.reference(NHWC32, wl, args, conv2d.conv2d_stem_ref)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [conv2d.pack_weight(weight), pack_channels(bias), pack_channels(mult), pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return NHWC32.packed_shape((wl.batch, wl.out_channels, wl.out_height, wl.out_width))

    def schedule(self, func, target):
        """The TIRx kernel in place of ``func``, keeping its attributes (as the wgmma family does)."""
        return tirx_kernel(func, conv2d.conv2d_stem(ConvWorkload.of(func), TargetInfo.from_target(target).num_sm))

    def compile_options(self) -> dict:
        return pipeline.compile_options()


CONV2D_STEM = Conv2dStem()
IMPLEMENTATIONS = (CONV2D_STEM,)
