"""ScheduleInt8Kernels: give every tvm_qconv kernel its implementation's default schedule.

Each PrimFunc the quantize pass emitted names its implementation (``tvm_qconv.impl``); the
registry's implementation schedules it for the target, or declines (returns None), and then
dlight's default rules in the Relax CUDA pipeline schedule it instead (llvm: unscheduled).
A kernel a tuning database covers was scheduled from the database first
(``deploy.py build --tuning-log``) and marked ``tir.is_scheduled``, so it is skipped here.
"""
from __future__ import annotations

import tvm

from .. import registry
from ..schedules.channels_last_conversions import schedule_dequantize_nhwc32, schedule_quantize_nhwc32
from ..schedules.elementwise_int8 import schedule_elementwise
from ..schedules.kernel import KERNEL_ATTR

# Kernels of no implementation (the quantize pass's layout conversions) with a schedule of their
# own, by their compute's name.  The model input's quantize to NCHW4c (the stem's input): one
# thread per pixel, its 4 channels stored as one 32-bit word (dlight's took 65 us of ResNet-50's
# forward at batch 64 on an H200, ~5x its 51 MB of traffic).  The float <-> NHWC32 conversions
# around float ops: threads on pixels (``channels_last_conversions.py``; dlight's read the float
# side a feature map apart per thread).
CONVERSION_SCHEDULES = {
    "quantize_pack": lambda func, target: schedule_elementwise(func, target, "quantize_pack", operands=()),
    "quantize_pack_nhwc32": schedule_quantize_nhwc32,
    "dequantize_unpack_nhwc32": schedule_dequantize_nhwc32,
}


@tvm.transform.module_pass(opt_level=0, name="ScheduleInt8Kernels")
class ScheduleInt8Kernels:
    """After the pass, ``self.applied`` maps each function name to ``[implementation, how]``
    with ``how`` one of ``tuned``, ``default``, ``dlight`` or ``unscheduled``."""

    def __init__(self, target: tvm.target.Target):
        self.target = target
        self.applied: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fallback = "dlight" if self.target.kind.name == "cuda" else "unscheduled"
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or KERNEL_ATTR not in func.attrs:
                continue
            impl = registry.of_func(func)
            label = impl.name if impl is not None else str(func.attrs[KERNEL_ATTR])
            if func.attrs.get("tir.is_scheduled", False):
                self.applied[gv.name_hint] = [label, "tuned"]
                continue
            if impl is not None:
                sched = impl.schedule(func, self.target)
            else:
                own = CONVERSION_SCHEDULES.get(label)
                sched = own(func, self.target) if own is not None else None
            if sched is None:
                self.applied[gv.name_hint] = [label, fallback]
                continue
            sched = sched if isinstance(sched, tvm.tirx.PrimFunc) else sched.mod["main"]
            mod[gv] = sched.with_attr("tir.is_scheduled", True)
            self.applied[gv.name_hint] = [label, "default"]
        return mod
