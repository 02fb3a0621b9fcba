"""Tuning tasks: the distinct tunable kernels of an int8 module, in the one form that tuning
commits and building looks up.

A task is one distinct kernel PrimFunc whose implementation (``tvm_qconv.impl``, see
``tvm_qconv/registry.py``) has search spaces: a *workload* in MetaSchedule's terms.  The
database finds a schedule by structural equality of the function, so tuning and building
present the same canonical function (:func:`task_func`): the computation only, without the
attributes that say where the function sat or which layer it serves.
"""
from __future__ import annotations

import dataclasses

from collections import Counter
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx

from .. import registry
from ..schedules.kernel import KernelImpl
from ..schedules.workload import ConvWorkload

# Attributes the Relax module adds to a kernel that say nothing about its computation.
_RELAX_ONLY_ATTRS = ("global_symbol", "op_pattern")
_OWN_ATTR_PREFIX = "tvm_qconv."  # names the implementation and layer: not part of the computation
# Kept in the task of an implementation that shares another's compute (``KernelImpl.own_task``).
TASK_IMPL_ATTR = "qconv_task_impl"


@dataclass
class KernelTask:
    """One distinct tunable kernel of a model.

    Attributes:
        name: readable and unique within the model, e.g. ``64to64_3x3s1_56x56_b1``.
        impl: the kernel implementation (its spaces and seed are the tuner's).
        workload: the layer, from the PrimFunc's ``tvm_qconv.workload`` attribute.
        func: the PrimFunc as MetaSchedule sees it (:func:`task_func`).
        weight: how many times the model calls it.
        default: its implementation is the one the registry gives the layer untuned (the others
            of a layer are the families a tuning database may move it to).
    """

    name: str
    impl: KernelImpl
    workload: ConvWorkload
    func: tirx.PrimFunc
    weight: int
    default: bool = True


def task_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The PrimFunc in the one form that tuning commits and building looks up.

    Drops what the Relax module added (its name, the FuseOps pattern) and this project's own
    ``tvm_qconv.*`` attributes, and adds what TuneContext's normalization would
    (``global_symbol`` "main", ``tirx.noalias``), so the structural match depends only on the
    computation, not on where the function sat or which layer it serves -- except where two
    implementations share one compute definition (wgmma and mma.sync): an ``own_task``
    implementation's task also names it, so each family's records stay its own.
    """
    impl = registry.of_func(func)
    for key in list(func.attrs.keys()) if func.attrs is not None else []:
        if key in _RELAX_ONLY_ATTRS or str(key).startswith(_OWN_ATTR_PREFIX):
            func = func.without_attr(key)
    attrs = {"global_symbol": "main", "tirx.noalias": True}
    if impl is not None and impl.own_task:  # its compute is another family's: keep the records apart
        attrs[TASK_IMPL_ATTR] = impl.name
    return func.with_attr(attrs)


def is_tunable(func) -> bool:
    """An unscheduled kernel whose implementation has search spaces."""
    impl = registry.of_func(func) if isinstance(func, tirx.PrimFunc) else None
    return impl is not None and bool(impl.spaces) and not func.attrs.get("tir.is_scheduled", False)


def task_name(wl: ConvWorkload) -> str:
    """``64to64_3x3s1_56x56_b1`` (+ ``_g32``, ``_d2x2``, ``_norelu`` / ``_clip0_100``)."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    name = f"{wl.in_channels}to{wl.out_channels}_{kh}x{kw}s{sh}" + (f"x{sw}" if sw != sh else "")
    name += f"_{wl.height}x{wl.width}_b{wl.batch}"
    if wl.groups > 1:
        name += f"_g{wl.groups}"
    if (dh, dw) != (1, 1):
        name += f"_d{dh}x{dw}"
    return name + {"relu": "", "none": "_norelu"}.get(wl.activation, f"_clip{wl.act_min}_{wl.act_max}")


def extract_tasks(mod: tvm.IRModule, target=None, families: list[str] | None = None) -> list[KernelTask]:
    """The distinct tunable kernels an int8 Relax module calls, in graph order.

    Args:
        mod: the output of ``quantize_module`` (before or after ``LiftConstantsToParams``).
        target: a ``TargetInfo``: also every other tunable implementation that could run each
            of those layers on it (the tensor-core and the dp4a kernel of a conv), so that the
            database can pick a family per layer by measurement; None: the module's kernels only.
        families: keep only the tasks of these families (e.g. ``["mma"]``).
    Returns:
        One KernelTask per structurally distinct tunable PrimFunc, with ``weight`` = how many
        layers use it (VGG16 at 224 on one family: 13 convs, 9 tasks).
    """
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls: Counter = Counter()  # GlobalVar name -> call sites, in first-call order

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            calls[expr.args[0].name_hint] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    tasks: list[KernelTask] = []
    by_hash: dict[int, list[KernelTask]] = {}

    def add(impl, func, wl, count, family_in_name: bool, default: bool) -> None:
        if families is not None and impl.family not in families:
            return
        canon = task_func(func)
        bucket = by_hash.setdefault(tvm_ffi.structural_hash(canon), [])
        same = next((t for t in bucket if tvm_ffi.structural_equal(t.func, canon)), None)
        if same is not None:
            same.weight += count
            return
        base = task_name(wl) + (f"_{impl.family}" if family_in_name else "")
        name, taken, suffix = base, {t.name for t in tasks}, 2
        while name in taken:  # same shape, other padding: keep names unique
            name, suffix = f"{base}_{suffix}", suffix + 1
        task = KernelTask(name, impl, wl, canon, count, default)
        bucket.append(task)
        tasks.append(task)

    for gv_name, count in calls.items():
        func = mod[gv_name]
        if not is_tunable(func):
            continue
        impl, wl = registry.of_func(func), ConvWorkload.of(func)
        if wl.residual:   # tuned as the plain conv, which every family can run (apply.tuning_twin serves it)
            wl = dataclasses.replace(wl, residual=())
            func = impl.compute(wl)
        others = [c for c in registry.candidates(impl.op, wl, target) if c.spaces and c is not impl] \
            if target is not None else []
        add(impl, func, wl, count, bool(others), True)  # the family names the task where a layer has two
        for other in others:
            add(other, other.compute(wl), wl, count, True, False)
    return tasks
