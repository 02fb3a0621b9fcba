"""ScheduleInt8Kernels: give every tvm_qconv kernel its implementation's default schedule.

Each PrimFunc the quantize pass emitted -- a layer's kernel or a conversion (quantize,
dequantize, relayout, a linear layer's input rows) -- names its implementation
(``tvm_qconv.impl``); the registry's implementation schedules it for the target, or declines
(returns None), and then dlight's default rules in the Relax CUDA pipeline schedule it instead
(llvm: unscheduled).  A kernel a tuning database covers was scheduled from the database first
(``deploy.py build --tuning-log``) and marked ``tir.is_scheduled``, so it is skipped here.
"""
from __future__ import annotations

import tvm

from .. import registry
from ..schedules.kernel import KERNEL_ATTR


@tvm.transform.module_pass(opt_level=0, name="ScheduleInt8Kernels")
class ScheduleInt8Kernels:
    """After the pass, ``self.applied`` maps each function name to ``[label, how]``: the
    implementation's label (``KernelImpl.label``: its registry name; a conversion's kernel name,
    e.g. ``quantize_pack``) and ``how``, one of ``tuned``, ``default``, ``dlight`` or
    ``unscheduled``."""

    def __init__(self, target: tvm.target.Target):
        self.target = target
        self.applied: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fallback = "dlight" if self.target.kind.name == "cuda" else "unscheduled"
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None or KERNEL_ATTR not in func.attrs:
                continue
            impl = registry.of_func(func)
            # no implementation: a kernel made outside the registry (a test's stand-in layout's
            # relayout), left to dlight / unscheduled
            label = impl.label(func) if impl is not None else str(func.attrs[KERNEL_ATTR])
            if func.attrs.get("tir.is_scheduled", False):
                self.applied[gv.name_hint] = [label, "tuned"]
                continue
            sched = impl.schedule(func, self.target) if impl is not None else None
            if sched is None:
                self.applied[gv.name_hint] = [label, fallback]
                continue
            sched = sched if isinstance(sched, tvm.tirx.PrimFunc) else sched.mod["main"]
            mod[gv] = sched.with_attr("tir.is_scheduled", True)
            self.applied[gv.name_hint] = [label, "default"]
        return mod
