"""The kernels a training step's int8 conv may be built with, as *choices*: what
``tvm_qconv/nn/conv_tiles.py`` measures, ``tvm_qconv/nn/conv_table.py`` tables and
``tvm_qconv/nn/tvm_kernels.py`` builds, and how each is scheduled.

Every int8 conv of a training step on the tensor cores -- the forward, ``dx`` and ``dw`` (the
split-K conv of ``grad_weight_mma.py``) -- is the compute of :data:`IMPL` with int32 output, by
default scheduled by the ``mma.sync`` template (``tensorcore/mma.py``) at ``mma.default_decisions``.
A choice is a dict:

* ``{"family": "mma", "tiles": decisions, "stages": n}``: the template with these decisions
  (:func:`candidates`: every block tile of 32 / 64 / 128 rows and columns dividing the GEMM, its
  warps 2 x 2, and 4 x 2 / 2 x 4 for 128-wide tiles, the two longest K steps that fit the shared
  memory, each at its deepest pipeline; the default always among them);
* ``{"family": "wgmma", "config": {"bm", "bn", "stages"}}``: Hopper's warp-specialized TMA +
  ``wgmma`` kernel (``wgmma/conv2d.py``) with its int32 epilogue, for the convs TMA im2col can
  gather in one slice (:func:`wgmma_choices`; built for ``sm_90a``: :func:`build_arch`), and with
  a ``"splits"`` count of its own for a split-K ``dw`` (:func:`wgmma_split_choices`).

:func:`measured_choices` says which a GPU measures.  The family words live here, with the
kernels: ``tvm_qconv.nn`` only passes the dicts around, and reaches the ``dw`` conv
(:func:`weight_grad_conv`) and its layout (:data:`LAYOUT`) through this module too.
"""
from __future__ import annotations

import dataclasses

import tvm

from tvm_qconv.target import TargetInfo

from ..kernel import tirx_kernel
from ..tensorcore import layout as tensorcore_layout
from ..tensorcore import mma
from ..tensorcore.impls import MIN_IN_CHANNELS
from ..wgmma import conv2d as wgmma_conv2d
from ..wgmma import space
from ..wgmma.impls import MIN_TILE_COLUMNS
from ..workload import ConvWorkload
from . import grad_weight_mma

IMPL = "conv2d.nhwc32.mma"      # the registry implementation whose compute every choice schedules
LAYOUT = tensorcore_layout.LAYOUT.name    # its activations: [N, H, W, C_p], channels padded to 32
FAMILIES = ("mma", "wgmma")
HOPPER = (9, 0)                 # the compute capability whose GPUs also measure the wgmma choices
# What :func:`schedule` raises for a choice its kernel does not take: template tiles that do not fit
# the GEMM or the shared memory, a wgmma config its kernel refuses.
INVALID_CHOICE = (mma.InvalidDecisions, AssertionError)


def build_arch(choice: dict | None, arch: str) -> str:
    """The arch a choice is built for: ``sm_90a`` for wgmma (its instructions exist only there)."""
    return "sm_90a" if choice and choice["family"] == "wgmma" else arch


def schedule(func, choice: dict, target):
    """``func`` (``conv2d_nhwc_int32``'s PrimFunc, tagged with its workload) as ``choice``.

    Raises:
        mma.InvalidDecisions: template tiles that do not fit this GEMM or the shared memory.
        AssertionError: a wgmma config its kernel does not take.
    """
    if choice["family"] == "wgmma":
        wl = ConvWorkload.of(func)
        assert wgmma_conv2d.supports(wl), wl
        kernel = wgmma_conv2d.conv2d_wgmma(wl, wgmma_conv2d.Config(**choice["config"], staged_store=False),
                                           TargetInfo.from_target(target).num_sm)
        return tirx_kernel(func, kernel)
    sch = tvm.s_tir.Schedule(func)
    mma.apply_mma_schedule(sch, choice["tiles"], choice["stages"])
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def gemm_extents(func) -> tuple[int, int, int]:
    return mma.gemm_extents(tvm.s_tir.Schedule(func))


def mma_choice(decisions: dict, stages: int) -> dict:
    return {"family": "mma", "tiles": decisions, "stages": stages}


def default_choice(mp: int, op: int, k: int, num_sm: int) -> dict:
    """The template's default for an ``(M_p, O_p, K)`` GEMM on ``num_sm`` SMs, as a choice."""
    return mma_choice(*mma.default_decisions(mp, op, k, num_sm))


def candidates(mp: int, op: int, k: int) -> list[dict]:
    """The template's choices to measure for an ``(M_p, O_p, K)`` GEMM (module docstring); no
    duplicates."""
    mt, ot, kt = mp // 16, op // 16, k // 32
    out = []
    for bm in (128, 64, 32):
        for bn in (128, 64, 32):
            if mp % bm or op % bn:
                continue
            warps = [(2, 2)] + ([(4, 2)] if bm == 128 else []) + ([(2, 4)] if bn == 128 else [])
            for wm, wn in warps:
                fm, fn = bm // 16 // wm, bn // 16 // wn
                if not (1 <= fm <= mma.MAX_FRAGS and 1 <= fn <= mma.MAX_FRAGS):
                    continue
                fits = [(kk, s) for kk in (4, 2, 1) if kt % kk == 0 for s in sorted(mma.STAGE_CHOICES, reverse=True)
                        if (bm + bn) * (32 * kk + mma.SMEM_PAD) * s <= mma.DYN_SMEM_BUDGET and kt // kk >= s - 1]
                longest = []                    # the two longest K steps, each at its deepest pipeline
                for kk, s in fits:
                    if all(kk != c[0] for c in longest) and len(longest) < 2:
                        longest.append((kk, s))
                for kk, s in longest:
                    out.append(mma_choice({"m": [mt // (bm // 16), wm, fm], "o": [ot // (bn // 16), wn, fn],
                                           "k": [kt // kk, kk]}, s))
    return out


def measured_choices(wl: ConvWorkload, gemm: tuple[int, int, int], default: dict, capability: tuple[int, int],
                     num_sm: int) -> list[dict]:
    """The choices to measure against ``default`` for ``wl`` (its ``(M_p, O_p, K)`` GEMM ``gemm``)
    on a GPU of compute ``capability`` with ``num_sm`` SMs: the template's :func:`candidates` but
    the default, and on Hopper the wgmma kernel's (:func:`wgmma_split_choices`)."""
    return [c for c in candidates(*gemm) if c != default] + (wgmma_split_choices(wl, num_sm)
                                                             if tuple(capability) == HOPPER else [])


def wgmma_choices(wl: ConvWorkload) -> list[dict]:
    """The wgmma kernel's tiles for ``wl`` (``wgmma/space.py``, at least ``MIN_TILE_COLUMNS``
    wide), none where its kernel cannot compute ``wl``."""
    if wl.in_channels < MIN_IN_CHANNELS or not wgmma_conv2d.supports(wl):
        return []
    return [{"family": "wgmma", "config": {"bm": c.bm, "bn": c.bn, "stages": c.stages}}
            for c in space.candidate_configs(wl) if c.bn >= MIN_TILE_COLUMNS]


def wgmma_split_choices(wl: ConvWorkload, num_sm: int) -> list[dict]:
    """:func:`wgmma_choices` of a split-K ``wl`` (dw), each at ``wl``'s split count and at the
    counts that give the persistent grid about 2 and 4 tiles per SM (its two consumers take a
    tile each: a count chosen for mma.sync's grid can leave one idle), where the kernel takes them."""
    out = []
    for choice in wgmma_choices(wl):
        out.append(choice)
        if wl.splits == 1:
            continue
        per_slice = wgmma_conv2d.tiles(wl, wgmma_conv2d.Config(**choice["config"], staged_store=False))
        for want in (2 * num_sm, 4 * num_sm):
            splits = -(-want // per_slice)
            while splits < 4096 and not wgmma_conv2d.supports(dataclasses.replace(wl, splits=splits)):
                splits += 1
            if splits < 4096 and splits != wl.splits and all(c.get("splits") != splits or c["config"] !=
                                                              choice["config"] for c in out):
                out.append({**choice, "splits": splits})
    return out


def describe_choice(choice: dict | None) -> str:
    if choice is None:
        return "default"
    if choice["family"] == "wgmma":
        c = choice["config"]
        split = f", split {choice['splits']}" if "splits" in choice else ""
        return f"wgmma {c['bm']}x{c['bn']}, {c['stages']} stages{split}"
    d = choice["tiles"]
    return (f"mma {16 * d['m'][1] * d['m'][2]}x{16 * d['o'][1] * d['o'][2]}, warps {d['m'][1]}x{d['o'][1]}, "
            f"BK {32 * d['k'][1]}, {choice['stages']} stages")


def weight_grad_conv(wl: ConvWorkload, target: TargetInfo) -> ConvWorkload | None:
    """The int32 conv whose output is ``dw`` of the one-group conv ``wl``, with its split
    (``grad_weight_mma.weight_grad_conv``: a conv of :data:`IMPL`'s, so the table's choices apply
    to it too); None where the tensor cores cannot take it."""
    return grad_weight_mma.weight_grad_conv(wl, target)
