"""The wgmma family's search space: the kernel's :class:`~.conv2d.Config`, chosen by measurement.

The TIRx kernel is written whole, so MetaSchedule cannot sample its loops; what the tuner
decides is which :class:`~.conv2d.Config` to write it with.  A candidate is a trace of the
unscheduled compute definition (``conv2d_nhwc_int8``, shared with the mma.sync family) that
records the decision and carries what the kernel needs, as annotations of its root block::

    v = sch.sample_categorical(candidates=[0, 1, ...], probs=[...])   # which config
    sch.annotate(root, "tvm_qconv.wgmma_config", v)
    sch.annotate(root, "tvm_qconv.wgmma_configs", "128x128x5,64x256x4,...")   # BM x BN x stages
    sch.annotate(root, "tvm_qconv.wgmma_workload", "{...}")                   # ConvWorkload

so the record is MetaSchedule's JSON like every other family's, and replaying it (building
with a database, or the tuner's builder) gives a function :func:`realize` turns into the
kernel.  The list travels in the trace, so a record keeps meaning the tile it was measured
with even if :func:`candidate_configs` changes later.

The space is small (BM in {64, 128} x the BN that divide the layer's columns, each with the
deepest ring that fits: 2-5 points for each of VGG16's and ResNet-50's convs, at most 9), so the
tuner measures every point once (``KernelImpl.search = "exhaustive"``) instead of sampling it.
"""
from __future__ import annotations

import ast

import tvm
from tvm import tirx
from tvm.s_tir.stmt import SBlockRealize

from ..tensorcore.conv2d import gemm_shape
from ..tensorcore.layout import ceil32
from ..workload import ConvWorkload
from .conv2d import MAX_ACC, WGMMA_N, Config, default_config, k_tile, ring_stages

CONFIG_ANN = "tvm_qconv.wgmma_config"
CONFIGS_ANN = "tvm_qconv.wgmma_configs"
WORKLOAD_ANN = "tvm_qconv.wgmma_workload"
# Narrower tiles re-read the activations O_p / BN times (impls.MIN_TILE_COLUMNS says the same).
MIN_COLUMNS = 64


def candidate_configs(wl: ConvWorkload) -> list[Config]:
    """The tiles the tuner measures for ``wl``, :func:`~.conv2d.default_config` first: BM in
    {64, 128} x BN in the wgmma widths of 64-128 columns that divide O_p, 256 (two n128 blocks)
    where O_p is a multiple of 256, and O_p itself where one block spans it (<= 224); each with
    the deepest ring that fits beside the staged epilogue, and at most ``MAX_ACC`` accumulators
    per consumer thread."""
    _, _, op, _ = gemm_shape(wl)
    bk = k_tile(ceil32(wl.in_channels))
    widths = {n for n in WGMMA_N if MIN_COLUMNS <= n <= 128 and op % n == 0}
    if op % 256 == 0:
        widths.add(256)
    if op <= 224 and op in WGMMA_N:
        widths.add(op)
    staged = wl.out_dtype == "int8"       # an int32 output (the training forward) stores directly
    found = [default_config(wl)]
    for bn in sorted(widths):
        for bm in (128, 64):
            config = Config(bm, bn, ring_stages(bm, bn, bk, staged), staged)
            if config.accumulators() <= MAX_ACC and config not in found:
                found.append(config)
    return found


def encode(configs: list[Config]) -> str:
    """``"128x128x5,64x256x4"``: BM x BN x stages of each (staged epilogue)."""
    assert all(c.staged_store for c in configs)
    return ",".join(f"{c.bm}x{c.bn}x{c.stages}" for c in configs)


def decode(text: str) -> list[Config]:
    return [Config(*map(int, item.split("x"))) for item in str(text).split(",")]


def apply_config(sch: tvm.s_tir.Schedule, wl: ConvWorkload, index: int | None = None) -> None:
    """Record in ``sch`` (the compute definition of ``wl``) the choice of config ``index`` of
    :func:`candidate_configs` (None: sampled uniformly)."""
    configs = candidate_configs(wl)
    n = len(configs)
    root = sch.get_sblock("root")
    choice = sch.sample_categorical(list(range(n)), [1.0 / n] * n, decision=index)
    sch.annotate(root, CONFIG_ANN, choice)
    sch.annotate(root, CONFIGS_ANN, encode(configs))
    sch.annotate(root, WORKLOAD_ANN, str(wl.to_dict()))


def chosen(func: tirx.PrimFunc) -> tuple[ConvWorkload, Config] | None:
    """The workload and config a traced compute definition records (:func:`apply_config`), or
    None for a function without the annotations."""
    body = func.body
    if not isinstance(body, SBlockRealize):
        return None
    ann = body.block.annotations
    if CONFIG_ANN not in ann:
        return None
    wl = ConvWorkload.from_dict(ast.literal_eval(str(ann[WORKLOAD_ANN])))
    return wl, decode(ann[CONFIGS_ANN])[int(ann[CONFIG_ANN])]


def describe(config: Config) -> str:
    return f"{config.bm}x{config.bn}, {config.stages} stages"
