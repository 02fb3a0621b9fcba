"""The NCHW4c family's kernel implementations, as the registry (``tvm_qconv/registry.py``) sees them.

=============================  ===========  =================================================
name                           op           runs
=============================  ===========  =================================================
``conv2d.nchw4c.depthwise``    conv2d       depthwise convs, CUDA and llvm (memory-bound)
``conv2d.nchw4c.dp4a``         conv2d       CUDA (sm_61+), ``__dp4a``; default + 2 spaces
``conv2d.nchw4c.cpu``          conv2d       llvm, vectorized over output channels; 1 space
``max_pool2d.nchw4c``          max_pool2d   any target (one thread per output on CUDA)
``add.nchw4c``                 add          any target (dlight on CUDA)
``concat.nchw4c``              concat       any target (dlight on CUDA)
``channels.nchw4c``            channels     split, shuffle; any target (dlight on CUDA)
``avg_pool2d.nchw4c``          avg_pool2d   any target (one thread per output on CUDA)
``affine.nchw4c``              affine       inference BatchNorm no conv absorbs (dlight on CUDA)
``quantize.nchw4c.generic``    quantize     float NCHW -> NCHW4c, any target (one 32-bit word
                                            per pixel on CUDA: ``layout.schedule_quantize``)
``dequantize.nchw4c.generic``  dequantize   NCHW4c -> float NCHW, any target (dlight on CUDA)
=============================  ===========  =================================================

The two conversions (``schedules/conversion_kernels.py``) are made with the layout
(``layout.py``) and are not in :data:`IMPLEMENTATIONS`: the registry lists every layout's
conversions together.
"""
from __future__ import annotations

import numpy as np

from .. import epilogue_residual, epilogue_table
from ..kernel import KernelImpl
from ..layout_kernels import layout_kernels
from ..workload import ConvWorkload
from . import conv2d, cpu, cpu_space, depthwise, dp4a, dp4a_space
from .layout import LAYOUT, ceil4


class _Conv2dNCHW4c(KernelImpl):
    """The fused conv on NCHW4c / OIHW4o4i (``conv2d.py``); families differ by schedule."""

    op = "conv2d"
    layout = LAYOUT.name
    takes_table = True
    takes_residual = True

    def applies(self, wl: ConvWorkload, target) -> bool:
        # A group whose channels are not a multiple of 4 would need each group padded on its
        # own, which is not the NCHW4c its neighbours use; the training path packs that itself.
        aligned = wl.groups == 1 or (wl.group_in % 4 == 0 and wl.group_out % 4 == 0)
        return aligned or wl.out_dtype == "int32"

    def compute(self, wl: ConvWorkload):
        return self.tag(conv2d.conv2d_nchw4c_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return epilogue_residual.reference(
            wl, args, lambda wl, *a: epilogue_table.reference(LAYOUT, wl, a, conv2d.conv2d_nchw4c_int8_ref))

    def pack_params(self, wl: ConvWorkload, weight: np.ndarray, bias: np.ndarray, mult: np.ndarray,
                    shift: np.ndarray) -> list[np.ndarray]:
        """The kernel's constant arguments from the layer's int8 OIHW weight and int32 vectors."""
        g = wl.groups
        return [conv2d.pack_oihw4o4i(weight, g), conv2d.pack_channels(bias, groups=g),
                conv2d.pack_channels(mult, groups=g), conv2d.pack_channels(shift, fill=1, groups=g)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return (wl.batch, wl.groups * conv2d.group_blocks(wl)[1], wl.out_height, wl.out_width, 4)


class Conv2dDepthwise(KernelImpl):
    """Depthwise convs (one input channel per group, any channel multiplier): ``depthwise.py``."""

    name = "conv2d.nchw4c.depthwise"
    op = "conv2d"
    layout = LAYOUT.name
    family = "depthwise"
    runs_on = "CUDA or CPU"
    takes_table = True
    follows_input = True
    SCHEDULES = {"cuda": depthwise.schedule_cuda, "llvm": lambda func, target: depthwise.schedule_cpu(func)}

    def applies(self, wl: ConvWorkload, target) -> bool:
        return wl.is_depthwise and wl.out_dtype == "int8" and target.kind in self.SCHEDULES

    def compute(self, wl: ConvWorkload):
        return self.tag(depthwise.depthwise_nchw4c_int8(wl), wl)

    def reference(self, wl: ConvWorkload, *args):
        return epilogue_table.reference(LAYOUT, wl, args, depthwise.depthwise_nchw4c_int8_ref)

    def schedule(self, func, target):
        return self.SCHEDULES[target.kind.name](func, target)

    def pack_params(self, wl, weight, bias, mult, shift):
        return [depthwise.pack_depthwise(weight), conv2d.pack_channels(bias), conv2d.pack_channels(mult),
                conv2d.pack_channels(shift, fill=1)]

    def out_shape(self, wl: ConvWorkload) -> tuple[int, ...]:
        return (wl.batch, ceil4(wl.out_channels) // 4, wl.out_height, wl.out_width, 4)


class Conv2dDp4a(_Conv2dNCHW4c):
    name = "conv2d.nchw4c.dp4a"
    family = "dp4a"
    runs_on = "CUDA sm_61+"
    spaces = dp4a_space.SPACES
    instruction = "dp4a"

    def applies(self, wl, target) -> bool:
        return target.kind == "cuda" and target.has_dp4a and super().applies(wl, target)

    def schedule(self, func, target):
        return dp4a.schedule_dp4a(func, target)

    def space_generator(self, space: str, func, target):
        return dp4a_space.space_generator(space)

    def seed(self, sch, target, wl: ConvWorkload | None = None) -> None:
        # The tuner's task function carries no workload attribute: ``wl`` gives grouped convs
        # their group-aware tiles (default_tiles).
        dp4a.apply_dp4a_schedule(sch, dp4a.default_tiles(sch.mod["main"], target, wl))

    def prepare(self) -> None:
        dp4a._ensure_dp4a_registered()


class Conv2dCpu(_Conv2dNCHW4c):
    name = "conv2d.nchw4c.cpu"
    family = "cpu"
    runs_on = "a CPU (llvm)"
    spaces = cpu_space.SPACES
    search = "replay_func"  # the oc tile is also the accumulator's layout (cpu_space.py)

    def applies(self, wl, target) -> bool:
        return target.kind == "llvm" and super().applies(wl, target)

    def schedule(self, func, target):
        return cpu.schedule_cpu(func)

    def space_generator(self, space: str, func, target):
        return cpu_space.space_generator(space)

    def seed(self, sch, target, wl: ConvWorkload | None = None) -> None:
        cpu.apply_cpu_schedule(sch, *cpu.default_tiles(sch.mod["main"]))


CONV2D_DEPTHWISE = Conv2dDepthwise()
CONV2D_DP4A = Conv2dDp4a()
CONV2D_CPU = Conv2dCpu()
IMPLEMENTATIONS = (CONV2D_DEPTHWISE, CONV2D_DP4A, CONV2D_CPU, *layout_kernels(LAYOUT))
