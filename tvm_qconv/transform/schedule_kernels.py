"""ScheduleInt8Kernels: give every tvm_qconv kernel its default schedule for the target.

Schedules are looked up in a table keyed by (kernel, target kind); a kernel with no entry for
the target is left unscheduled, and on CUDA dlight's default rules (in the Relax CUDA pipeline)
schedule it instead.  A kernel a tuning database covers is scheduled from the database first
(``deploy.py build --tuning-log``) and marked ``tir.is_scheduled``, so it is skipped here.
"""
from __future__ import annotations

import tvm


def _conv_cpu(func, target):
    from schedules.conv2d_nchw4c_cpu import schedule_cpu
    return schedule_cpu(func)


def _conv_cuda(func, target):
    from schedules.conv2d_nchw4c_dp4a import schedule_dp4a
    return schedule_dp4a(func, target)


DEFAULT_SCHEDULES = {
    ("conv2d_nchw4c_int8", "llvm"): _conv_cpu,
    ("conv2d_nchw4c_int8", "cuda"): _conv_cuda,
}


@tvm.transform.module_pass(opt_level=0, name="ScheduleInt8Kernels")
class ScheduleInt8Kernels:
    def __init__(self, target: tvm.target.Target):
        self.target = target
        self.applied: dict = {}  # function name -> [kernel, "tuned" | "default" | "dlight" | "unscheduled"]

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc) or "tvm_qconv.kernel" not in func.attrs:
                continue
            kernel = str(func.attrs["tvm_qconv.kernel"])
            if func.attrs.get("tir.is_scheduled", False):
                self.applied[gv.name_hint] = [kernel, "tuned"]
                continue
            rule = DEFAULT_SCHEDULES.get((kernel, self.target.kind.name))
            if rule is None:
                self.applied[gv.name_hint] = [kernel, "dlight" if self.target.kind.name == "cuda" else "unscheduled"]
                continue
            sched = rule(func, self.target)
            sched = sched if isinstance(sched, tvm.tirx.PrimFunc) else sched.mod["main"]
            mod[gv] = sched.with_attr("tir.is_scheduled", True)
            self.applied[gv.name_hint] = [kernel, "default"]
        return mod
