"""Targets: the TVM target of a build, and :class:`TargetInfo`, the GPU facts kernels decide by.

Every per-GPU fact a kernel or a heuristic uses (SM count, shared memory and threads per block,
which int8 instructions exist) comes from one :class:`TargetInfo`, built from the TVM target
and, where this machine has that GPU, from the device itself.  No schedule keeps its own copy
of "132 SMs".
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import tvm

from .errors import InputError

# SM count per arch, used only when the GPU is not on this machine (cross-compiling, tuning
# through RPC): the arch alone does not say it, and TVM targets carry no such attribute.
# The local device's own count always wins (``TargetInfo.from_target``).
TYPICAL_SM_COUNT = {"sm_70": 80, "sm_75": 40, "sm_80": 108, "sm_86": 84, "sm_87": 16, "sm_89": 128,
                    "sm_90": 132, "sm_90a": 132, "sm_100": 148, "sm_120": 84}
DEFAULT_SM_COUNT = 80  # an unknown arch: a mid-size GPU (it only steers tile heuristics)


def _arch_number(arch: str) -> int | None:
    """``sm_90a`` -> 90; None if ``arch`` is not of that form."""
    if not arch.startswith("sm_"):
        return None
    digits = arch[3:].rstrip("a")
    return int(digits) if digits.isdigit() else None


def make_target(target: str, arch: str | None = None) -> tvm.target.Target:
    """``llvm`` or ``cuda`` (+ arch such as ``sm_90``) as a TVM target with the attributes
    MetaSchedule's CUDA rules need.

    Raises:
        InputError: an unknown target or a malformed arch.
    """
    if target == "llvm":
        # Without mcpu LLVM emits baseline x86-64 (SSE2: no 32-bit vector multiply), ~4x slower int8
        # convs; the library is then tuned to this machine's CPU, like gcc -march=native.
        return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1,
                                  "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    if target == "cuda":
        arch = arch or "sm_90"
        number = _arch_number(arch)
        if number is None or number < 50:
            raise InputError(f"--arch {arch!r} is not a CUDA arch such as sm_90 or sm_80")
        return tvm.target.Target({"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                                  "max_shared_memory_per_block": 49152, "thread_warp_size": 32}, host="llvm")
    raise InputError(f"unknown target {target!r}: choose llvm or cuda")


@dataclass(frozen=True)
class TargetInfo:
    """What the kernels need to know about a target.

    Attributes:
        kind: ``llvm`` or ``cuda``.
        arch: the CUDA arch (``sm_90``), None for llvm.
        num_sm: streaming multiprocessors (CPU: cores), for grid-balance heuristics.
        max_shared_memory_per_block, max_threads_per_block: the per-block limits schedules
            must respect (VerifyGPUCode checks the same).
        has_dp4a: ``__dp4a`` (sm_61 and newer).
        has_int8_mma: ``mma.sync.m16n8k32`` on s8 (sm_80 and newer).
        has_wgmma: ``wgmma.mma_async`` (sm_90a only).
    """

    kind: str
    arch: str | None = None
    num_sm: int = 1
    max_shared_memory_per_block: int = 49152
    max_threads_per_block: int = 1024
    has_dp4a: bool = False
    has_int8_mma: bool = False
    has_wgmma: bool = False

    @classmethod
    def from_target(cls, target: tvm.target.Target) -> "TargetInfo":
        """The facts of ``target``; the SM count from the local GPU when it has the target's arch."""
        kind = target.kind.name
        if kind != "cuda":
            return cls(kind=kind, num_sm=int(target.attrs.get("num-cores", os.cpu_count() or 1)))
        arch = str(target.attrs.get("arch", "sm_50"))
        sm = _arch_number(arch) or 50
        return cls(kind="cuda", arch=arch, num_sm=_sm_count(arch),
                   max_shared_memory_per_block=int(target.attrs.get("max_shared_memory_per_block", 49152)),
                   max_threads_per_block=int(target.attrs.get("max_threads_per_block", 1024)),
                   has_dp4a=sm >= 61, has_int8_mma=sm >= 80, has_wgmma=arch == "sm_90a")


def _sm_count(arch: str) -> int:
    """The local GPU's SM count if it is of ``arch``, else the arch's typical count."""
    try:
        dev = tvm.cuda(0)
        if dev.exist and f"sm_{dev.compute_version.replace('.', '')}" == arch.rstrip("a"):
            return int(dev.multi_processor_count)
    except Exception:  # no CUDA runtime on this machine
        pass
    return TYPICAL_SM_COUNT.get(arch, DEFAULT_SM_COUNT)


def device_arch(index: int = 0, full: bool = False) -> str | None:
    """``sm_XY`` of the local CUDA GPU ``index``, None where there is none; ``full``: the arch
    that targets all of its instructions (``sm_90a`` on an H100 / H200: wgmma, setmaxnreg)."""
    try:
        dev = tvm.cuda(index)
        arch = f"sm_{dev.compute_version.replace('.', '')}" if dev.exist else None
    except Exception:
        return None
    return arch + "a" if full and arch in ARCH_SPECIFIC else arch


def arch_runs_on(built: str, gpu: str) -> bool:
    """Whether CUDA code built for ``built`` runs on a GPU of arch ``gpu``.  TVM builds SASS
    (cubins) only: a cubin runs on its own major architecture at its minor version or later, and
    an arch-specific one (``sm_90a``: wgmma, setmaxnreg) on exactly its arch.  Unparsable names: True."""
    b, g = _arch_number(built), _arch_number(gpu)
    if b is None or g is None:
        return True
    if built.endswith("a"):
        return b == g
    return b // 10 == g // 10 and g % 10 >= b % 10


ARCH_SPECIFIC = ("sm_90",)  # archs with an "a" variant this project's kernels use (wgmma: sm_90a)


def cuda_source(ex) -> str:
    """The CUDA C of a ``tvm.compile`` result (its module tree varies: walk it for the cuda module)."""
    mods = [ex.mod if hasattr(ex, "mod") else ex]
    while mods:
        mod = mods.pop()
        if mod.kind == "cuda":
            return mod.inspect_source()
        mods.extend(mod.imports)
    raise ValueError("the build holds no CUDA module")
