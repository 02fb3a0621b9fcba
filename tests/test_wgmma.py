"""The wgmma family (``schedules/wgmma/``) on CPU: which layers it takes, its tile decisions, its
CUDA code (wgmma, TMA im2col, warp specialization) and a module mixing it with S-TIR kernels.
On an H100 / H200 (marked ``gpu``): the kernels bit-exact against NumPy."""
import dataclasses
import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tests.test_tensorcore import IDS, WORKLOADS, args_of, run_llvm
from tests.workloads import conv_wl, random_conv_args, slow_requantize_args
from tvm_qconv import registry
from tvm_qconv.schedules import border_bias
from tvm_qconv.schedules.kernel import tirx_kernel
from tvm_qconv.schedules.tensorcore.conv2d import gemm_shape
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32, ceil32
from tvm_qconv.schedules.wgmma import conv2d, space
from tvm_qconv.schedules.workload import ConvWorkload
from tvm_qconv.tuning.tasks import task_func
from tvm_qconv.target import TargetInfo, cuda_source, device_arch, make_target

SM90A = make_target("cuda", "sm_90a")
IMPL = registry.get("conv2d.nhwc32.wgmma")


def test_registry_takes_wgmma_on_sm_90a_only():
    wl = conv_wl(8, 64, 56, 56, 64)          # 196 tiles of 128 x 64: every SM busy
    pick = lambda arch, w=wl: registry.select("conv2d", w, TargetInfo.from_target(make_target("cuda", arch))).name
    assert pick("sm_90a") == "conv2d.nhwc32.wgmma"
    assert pick("sm_90") == "conv2d.nhwc32.mma"          # plain sm_90 code cannot hold wgmma
    assert pick("sm_90a", conv_wl(8, 3, 56, 56, 64)) == "conv2d.nhwc32.stem"    # 3 channels: dp4a
    assert pick("sm_90a", conv_wl(8, 64, 56, 56, 64, groups=2)) != "conv2d.nhwc32.wgmma"


def test_layers_of_fewer_tiles_than_sms_stay_on_mma():
    # VGG16 at batch 1: the 224 px layer fills the H100's 132 SMs (392 tiles), the 14 px ones
    # (8 tiles) do not (schedules/wgmma/impls.py: measured end to end, 0.318 vs 0.292 ms)
    h100 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    pick = lambda w: registry.select("conv2d", w, h100).name
    assert pick(conv_wl(1, 64, 224, 224, 64)) == "conv2d.nhwc32.wgmma"
    assert pick(conv_wl(1, 512, 14, 14, 512)) == "conv2d.nhwc32.mma"
    assert pick(conv_wl(64, 512, 14, 14, 512)) == "conv2d.nhwc32.wgmma"


def test_supports_only_what_tma_im2col_can_gather():
    assert conv2d.supports(conv_wl(1, 64, 28, 28, 64, stride=(2, 2)))
    assert not conv2d.supports(conv_wl(1, 64, 64, 64, 64, kernel=(9, 9), stride=(9, 9), padding=(0, 0, 0, 0)))
    assert not conv2d.supports(conv_wl(1, 64, 300, 300, 64, padding=(130, 130, 130, 130)))   # lower corner
    assert not conv2d.supports(conv_wl(1, 64, 300, 300, 64, kernel=(1, 1), padding=(0, 0, 130, 0)))  # upper
    # a tap offset of 128 rows, its corners in range
    assert not conv2d.supports(conv_wl(1, 64, 300, 300, 64, dilation=(64, 1), padding=(0, 1, 0, 1)))
    # the training convs' int32 accumulators, a signed input; a split reduction in whole K steps
    # of the kernel's (3 x 3 taps x one 64-channel step: 9 steps, 3 slices of 3, not 2 of 4.5)
    int32 = conv_wl(1, 64, 28, 28, 64, relu=False, out_dtype="int32")
    assert conv2d.supports(int32) and conv2d.supports(dataclasses.replace(int32, splits=3))
    assert not conv2d.supports(dataclasses.replace(int32, splits=2))


def test_the_registry_keeps_narrow_layers_on_mma():
    # O_p = 352 would get 32-column tiles (no wider wgmma N divides it); dilated and asymmetric
    # im2col passed the GPU test (2026-11-23, H100) and take wgmma
    h100 = TargetInfo.from_target(SM90A)
    pick = lambda w: registry.select("conv2d", w, h100).name
    assert pick(conv_wl(8, 64, 56, 56, 64)) == "conv2d.nhwc32.wgmma"
    assert pick(conv_wl(8, 64, 56, 56, 64, dilation=(2, 2), padding=(2, 2, 2, 2))) == "conv2d.nhwc32.wgmma"
    assert pick(conv_wl(8, 64, 56, 56, 64, padding=(1, 2, 1, 0))) == "conv2d.nhwc32.wgmma"
    assert pick(conv_wl(64, 64, 28, 28, 352)) == "conv2d.nhwc32.mma"


def test_a_database_without_wgmma_records_does_not_displace_it():
    # the measured chooser decides only where the database measured the layer's default family
    # (here wgmma) and another; an older database of mma / dp4a records leaves the registry's
    # order, which gives this layer of 196 tiles to wgmma
    from tvm_qconv.tuning.apply import measured_chooser

    class Db:  # records of every workload but the wgmma task's
        def has_workload(self, mod):
            return "qconv_task_impl" not in mod["main"].attrs

        def commit_workload(self, mod):
            return mod

        def get_top_k(self, workload, k):
            return [type("Record", (), {"run_secs": [1e-6]})()]

    wl = conv_wl(8, 64, 56, 56, 64)
    found = registry.candidates("conv2d", wl, TargetInfo.from_target(SM90A))
    assert [i.family for i in found][:2] == ["wgmma", "mma"]
    assert measured_chooser(Db(), SM90A)("conv2d", wl, found) is None
    assert registry.select("conv2d", wl, TargetInfo.from_target(SM90A)).family == "wgmma"


def test_the_measured_pick_charges_a_layout_change_its_two_relayouts():
    # ResNet-50's 64->256 1x1 at batch 1: dp4a would add a relayout in and one out (~6 us), so
    # a dp4a kernel 0.7 us faster than mma.sync does not move the layer
    from tvm_qconv.tuning.apply import measured_chooser, switch_seconds
    wl = conv_wl(1, 64, 56, 56, 256, kernel=(1, 1), padding=(0, 0, 0, 0))

    class Db:
        def __init__(self, us):
            self.us = us

        def has_workload(self, mod):
            return True

        def commit_workload(self, mod):
            return mod

        def get_top_k(self, mod, k):
            f = mod["main"]
            name = str(f.attrs.get("qconv_task_impl", "")) or ("dp4a" if len(f.params[0].shape) == 5 else "mma")
            return [type("Record", (), {"run_secs": [self.us[name.split(".")[-1]] * 1e-6]})()]

    found = registry.candidates("conv2d", wl, TargetInfo.from_target(SM90A))
    assert [i.family for i in found] == ["wgmma", "mma", "dp4a"]
    assert 5e-6 < switch_seconds(wl) < 7e-6
    pick = lambda us: measured_chooser(Db(us), SM90A)("conv2d", wl, found)
    assert pick(dict(wgmma=30.6, mma=26.5, dp4a=25.8)) == "conv2d.nhwc32.mma"
    assert pick(dict(wgmma=30.6, mma=26.5, dp4a=12.4)) == "conv2d.nchw4c.dp4a"    # saves more than it costs
    assert pick(dict(wgmma=6.4, mma=6.5, dp4a=5.8)) is None     # the default under the runner's floor: kept
    big = dict(wgmma=20.0, mma=30.0, dp4a=40.0)                   # (the 10 us floor scaled away)
    assert pick(big) == "conv2d.nhwc32.wgmma"                     # same layout: no charge


def test_the_tuners_model_time_is_the_families_the_build_picks():
    # the progress line and the table's total follow the build's rule (apply.pick), relayouts
    # charged, not the fastest family's bare time
    from tvm_qconv.tuning.apply import switch_seconds
    from tvm_qconv.tuning.progress import model_conv_us
    from tvm_qconv.tuning.tasks import KernelTask
    wl = conv_wl(1, 64, 56, 56, 256, kernel=(1, 1), padding=(0, 0, 0, 0))
    tasks = [KernelTask("l_mma", registry.get("conv2d.nhwc32.mma"), wl, None, 3, default=True),
             KernelTask("l_dp4a", registry.get("conv2d.nchw4c.dp4a"), wl, None, 3, default=False),
             KernelTask("l_wgmma", registry.get("conv2d.nhwc32.wgmma"), wl, None, 3, default=False)]
    us = lambda **t: model_conv_us(tasks, {f"l_{k}": v * 1e-6 for k, v in t.items()})  # noqa: E731
    assert us(mma=26.5, dp4a=25.8, wgmma=30.6) == pytest.approx(3 * 26.5)   # dp4a saves less than it costs
    assert us(mma=26.5, dp4a=12.4, wgmma=30.6) == pytest.approx(3 * (12.4 + switch_seconds(wl) * 1e6))
    assert us(mma=6.5, dp4a=5.8) == pytest.approx(3 * 6.5)                  # kept: under the floor, and relayouts
    assert us(dp4a=5.8) is None     # default not measured (--family dp4a): the build runs it untuned
    assert us() is None


def test_im2col_map_gets_the_corners_strides_and_box_of_the_conv(monkeypatch):
    # the host encoder's arguments reach cuTensorMapEncodeIm2col in the driver's order
    # (dims innermost first: C, W, H, N), checked against a stand-in driver
    from tvm_qconv.schedules.wgmma import tensormap
    seen = {}

    class Driver:
        def cuTensorMapEncodeIm2col(self, tmap, dtype, rank, data, dims, strides, lower, upper, channels,
                                    pixels, traversal, interleave, swizzle, l2, oob):
            seen.update(dims=list(dims), strides=list(strides), lower=list(lower), upper=list(upper),
                        channels=channels.value, pixels=pixels.value, traversal=list(traversal),
                        swizzle=swizzle, rank=rank)
            return 0

    monkeypatch.setattr(tensormap, "_driver", [Driver()])
    wl = conv_wl(2, 64, 9, 11, 64, stride=(2, 1), padding=(1, 2, 1, 0))
    lo_h, lo_w, up_h, up_w = conv2d.im2col_corners(wl)
    assert (lo_h, lo_w, up_h, up_w) == (-1, -2, 1 - 2, 0 - 2)
    tensormap.encode_im2col(0, 0, 2, 9, 11, 64, lo_h, lo_w, up_h, up_w, 64, 128, 2, 1, 2)
    assert seen == dict(dims=[64, 11, 9, 2], strides=[64, 64 * 11, 64 * 11 * 9], lower=[-2, -1], upper=[-2, -1],
                        channels=64, pixels=128, traversal=[1, 1, 2, 1], swizzle=2, rank=4)


@pytest.mark.parametrize("cin", [16, 32, 48, 64, 96, 128, 160, 256, 512, 1024])
@pytest.mark.parametrize("cout", [32, 40, 64, 96, 128, 160, 192, 256, 320, 384, 512, 1000, 2048])
def test_default_tile_is_a_legal_kernel(cin, cout):
    # every decision a kernel asserts on: N a wgmma shape dividing O_p, at most 128 accumulator
    # registers per consumer thread, the ring inside the shared-memory budget, 2+ stages
    wl = conv_wl(8, cin, 14, 14, cout)
    c = conv2d.default_config(wl)
    op = gemm_shape(wl)[2]
    assert op % c.bn == 0 and c.wn in conv2d.WGMMA_N and c.bn % c.wn == 0
    assert c.bm in (64, 128) and c.accumulators() <= conv2d.MAX_ACC
    assert 2 <= c.stages <= conv2d.MAX_STAGES
    assert c.stages * (c.bm + c.bn) * conv2d.k_tile(ceil32(cin)) <= conv2d.SMEM_BUDGET
    # with the staged epilogue's two tiles, inside the 227 KB a block may opt into
    assert c.staged_store and c.stages * (c.bm + c.bn) * conv2d.k_tile(ceil32(cin)) + c.store_bytes() <= conv2d.SMEM_LIMIT


@pytest.mark.parametrize("cin, cout", [(16, 32), (48, 96), (160, 160), (128, 352), (512, 512), (1024, 2048)])
def test_default_tile_builds(cin, cout):
    # the kernel's own asserts on its decisions, for odd channel counts and both tile shapes
    for wl in (conv_wl(8, cin, 14, 14, cout), conv_wl(8, cin, 7, 7, cout, kernel=(1, 1), padding=(0, 0, 0, 0))):
        assert conv2d.conv2d_wgmma(wl, conv2d.default_config(wl), 132) is not None


def test_long_k_layers_of_512_columns_take_the_64x256_tile():
    # measured: 1.08-1.12x over 128 x 128 on VGG16's 512->512 convs (docs/history.md); the
    # staged epilogue's tiles (35 KB) leave the 64 x 256 ring 4 stages, the 128 x 128 one 5 at
    # BK = 128 (1.02-1.06x faster than 5 and 6 stages with direct stores, measured on an H200)
    assert conv2d.default_config(conv_wl(64, 512, 14, 14, 512)) == conv2d.Config(64, 256, 4, True)
    assert conv2d.default_config(conv_wl(64, 256, 56, 56, 256)) == conv2d.Config(128, 128, 5, True)


def test_the_space_is_every_tile_that_fits_with_the_default_first():
    # VGG16's 512->512 at batch 64: BM 64 / 128 x BN 64 / 128 / 256; 128 x 256 would hold 256
    # accumulators per consumer thread (MAX_ACC 128); each with the deepest ring that fits
    wl = conv_wl(64, 512, 28, 28, 512)
    configs = space.candidate_configs(wl)
    assert configs[0] == conv2d.default_config(wl)
    assert sorted((c.bm, c.bn) for c in configs) == [(64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]
    assert IMPL.space_size(wl) == 5 and len(set(configs)) == 5
    for c in configs:
        assert c.accumulators() <= conv2d.MAX_ACC and c.stages == conv2d.ring_stages(c.bm, c.bn, 128)
        assert c.stages * (c.bm + c.bn) * 128 + c.store_bytes() <= conv2d.SMEM_LIMIT
    # 96 output channels: one 96-column block spans them (no 64- or 128-column tile divides 96)
    assert sorted((c.bm, c.bn) for c in space.candidate_configs(conv_wl(8, 64, 56, 56, 96))) == [(64, 96), (128, 96)]


def _point(wl, index):
    sch = tvm.s_tir.Schedule(task_func(IMPL.compute(wl)))
    IMPL.trace_point(sch, wl, index)
    return sch


def test_a_point_is_a_trace_that_replays_to_its_tile_and_builds_as_that_wgmma_kernel():
    from tvm_qconv.tuning.builder import _build_function
    wl = conv_wl(2, 64, 14, 14, 128)
    configs = space.candidate_configs(wl)
    index = next(i for i, c in enumerate(configs) if c.bn == 64)   # default: one 128-column block
    sch = _point(wl, index)
    # MetaSchedule's database stores the trace; a build replays it on the compute definition
    replayed = tvm.s_tir.Schedule(task_func(IMPL.compute(wl)))
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    assert space.chosen(replayed.mod["main"]) == (wl, configs[index])
    assert space.chosen(IMPL.compute(wl)) is None
    # the tuner's builder turns it into the kernel of that tile (n64 wgmma, not the default n128)
    src = cuda_source(_build_function()(replayed.mod, SM90A, None))
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8" in src and "m64n128k32" not in src


def test_wgmma_tasks_are_their_own_workloads_beside_mma():
    # one compute definition, two families: each family's measurements stay its own
    wl = conv_wl(2, 64, 14, 14, 128)
    mma = registry.get("conv2d.nhwc32.mma")
    a, b = task_func(IMPL.compute(wl)), task_func(mma.compute(wl))
    assert not tvm_ffi.structural_equal(a, b)
    assert tvm_ffi.structural_equal(a.without_attr("qconv_task_impl"), b)


@derived_object
class _TimesByCall(ms.runner.PyRunner):
    """Made-up run times, one per measured candidate in the order the tuner measures them."""

    def __init__(self, times_us):
        self.times, self.calls = list(times_us), 0

    def run(self, inputs):
        out = []
        for _ in inputs:
            us = self.times[min(self.calls, len(self.times) - 1)]
            out.append(_Done(None if us is None else us * 1e-6))  # None: the run failed
            self.calls += 1
        return out


@derived_object
class _Done(ms.runner.PyRunnerFuture):
    def __init__(self, secs):
        super().__init__()
        self.secs = secs

    def done(self):
        return True

    def result(self):
        if self.secs is None:
            return ms.runner.RunnerResult(None, "made-up failure")
        return ms.runner.RunnerResult([self.secs], None)


def _small_vgg(size=16):
    import torch
    from tvm_qconv.models import SmallVGG
    torch.manual_seed(0)
    return SmallVGG(cfg=(64, 128), image_size=size)


def test_tuning_measures_each_wgmma_tile_once_and_a_rerun_none(tmp_path):
    from tvm_qconv.tuning import tune_model
    wl = conv_wl(1, 64, 16, 16, 128)     # SmallVGG (64, 128) at 16 px: its second conv
    n = IMPL.space_size(wl)
    runner = _TimesByCall([30 - i for i in range(n)])
    rows = tune_model("small_vgg", 1, arch="sm_90a", trials_per_task=64, work_dir=str(tmp_path), image_size=16,
                      model=_small_vgg(), runner=runner, families=["wgmma"], max_workers=2)
    assert runner.calls == n and [(r["task"], r["trials"]) for r in rows] == [("64to128_3x3s1_16x16_b1_wgmma", n)]
    assert rows[0]["best_us"] == pytest.approx(31 - n)
    tune_model("small_vgg", 1, arch="sm_90a", trials_per_task=64, work_dir=str(tmp_path), image_size=16,
               model=_small_vgg(), runner=runner, families=["wgmma"], max_workers=2)
    assert runner.calls == n


def test_a_point_that_fails_counts_as_tried_and_a_rerun_or_a_prune_retries_nothing(tmp_path):
    from tvm_qconv.tuning import prune_database, tune_model
    wl = conv_wl(1, 64, 16, 16, 128)
    n = IMPL.space_size(wl)
    runner = _TimesByCall([30.0, None] + [20.0] * (n - 2))     # point 1 fails to run
    args = dict(arch="sm_90a", trials_per_task=64, work_dir=str(tmp_path), image_size=16, runner=runner,
                families=["wgmma"], max_workers=2)
    rows = tune_model("small_vgg", 1, model=_small_vgg(), **args)
    assert runner.calls == n and rows[0]["trials"] == n and rows[0]["best_us"] == pytest.approx(20.0)
    tune_model("small_vgg", 1, model=_small_vgg(), **args)
    prune_database(str(tmp_path))
    rows = tune_model("small_vgg", 1, model=_small_vgg(), **args)
    assert runner.calls == n and rows[0]["trials"] == n


def test_a_database_that_measured_wgmma_fastest_builds_it_with_its_tile(tmp_path):
    # SmallVGG's 64->128 conv at batch 1 has 2 tiles: untuned it takes mma.sync (fewer tiles
    # than SMs); a database where a wgmma tile measured fastest of the three families gives it
    # wgmma with that tile
    from tvm_qconv.build import BuildOptions, compile_model
    from tvm_qconv.config import QuantConfig
    from tvm_qconv.ranges import Calibrate
    from tvm_qconv.tuning.database import prepare_implementations
    prepare_implementations()  # the seeds' traces name tensor intrinsics
    wl = conv_wl(1, 64, 16, 16, 128)
    configs = space.candidate_configs(wl)
    index = next(i for i, c in enumerate(configs) if c.bn == 64)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    for impl_name, secs in (("conv2d.nhwc32.mma", 20e-6), ("conv2d.nchw4c.dp4a", 30e-6), (IMPL.name, 10e-6)):
        impl = registry.get(impl_name)
        func = task_func(impl.compute(wl))
        sch = tvm.s_tir.Schedule(func)
        if impl is IMPL:
            impl.trace_point(sch, wl, index)
        else:
            impl.seed(sch, SM90A, wl)
        mod = tvm.IRModule({"main": func})
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(mod), [secs], SM90A,
                                                         ms.arg_info.ArgInfo.from_prim_func(func)))
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 16, 16)).astype(np.float32)

    def build(log):
        return compile_model(_small_vgg(), str(tmp_path / "m.so"), ranges=Calibrate(x),
                             config=QuantConfig(num_calib_images=2),
                             options=BuildOptions(target="cuda", arch="sm_90a", batch=1, image_size=16, verify=False,
                                                  tuning_log=log), progress=False)
    assert [r["kernel"] for r in build(None).report["layers"] if r["kind"].startswith("conv")][1] == \
        "conv2d.nhwc32.mma"
    lib = build(str(tmp_path))
    assert [r["kernel"] for r in lib.report["layers"] if r["kind"].startswith("conv")][1] == IMPL.name
    c = configs[index]
    # (u8: the default scheme's unsigned input; the record is the symmetric twin's, tuning/apply.py)
    assert list(lib.report["tuned"].values()) == [f"64->128 3x3 s1 u8 @16x16 b1 (wgmma {c.bm}x64, {c.stages} stages)"]
    from tvm_qconv.report import format_report   # the build report names the layer tuned, with its tile
    text = format_report(lib.meta)
    assert "tuned layers (1, from 1 tuned kernels)" in text
    assert re.search(rf"conv2d.nhwc32.wgmma +int8 +tuned +64->128 3x3 s1 u8 @16x16 b1 \(wgmma {c.bm}x64", text), text


def test_a_record_of_the_symmetric_twin_builds_the_layers_own_kernel_with_its_tile():
    # an unsigned layer takes its symmetric twin's record (tuning/apply.py); the record's trace
    # names the twin's workload, but the kernel must be the layer's: its bias table, its clamp
    from tvm_qconv.tuning.apply import symmetric_twin
    u8 = ConvWorkload.with_activation("clip", -128, 127, batch=64, in_channels=256, height=28, width=28,
                                      out_channels=256, in_zero=-128)
    twin = symmetric_twin(u8)
    sch = tvm.s_tir.Schedule(task_func(IMPL.compute(twin)))
    IMPL.trace_point(sch, twin, 1)
    func = IMPL.compute(u8)
    kernel = IMPL.tuned(sch.mod["main"], func, SM90A)
    assert ConvWorkload.of(kernel) == u8
    config, num_sm = space.candidate_configs(twin)[1], TargetInfo.from_target(SM90A).num_sm
    assert tvm_ffi.structural_equal(kernel, tirx_kernel(func, conv2d.conv2d_wgmma(u8, config, num_sm)))
    assert not tvm_ffi.structural_equal(kernel, tirx_kernel(func, conv2d.conv2d_wgmma(twin, config, num_sm)))


WGMMA_WLS = WORKLOADS + [conv_wl(16, 128, 28, 28, 256), conv_wl(8, 512, 14, 14, 512)]
WGMMA_IDS = IDS + ["ping_pong_392_tiles", "64x256_tile"]
MMA = registry.get("conv2d.nhwc32.mma")
# padded convs of an unsigned input (zero point -128), which TMA pads with 0: 3x3 s2x1 with
# asymmetric padding (tests/test_tensorcore.py), a 5x5 wider than its 3-column image (every
# column its own border class), dilation 2 with stride 2
UNSIGNED_PADDED = [wl for wl in WORKLOADS if wl.pads_with_zero_point] + [
    ConvWorkload.with_activation("relu", batch=1, in_channels=32, height=5, width=3, out_channels=32, kernel=(5, 5),
                                 padding=(2, 2, 2, 2), in_zero=-128),
    ConvWorkload.with_activation("none", batch=2, in_channels=16, height=9, width=9, out_channels=40,
                                 dilation=(2, 2), padding=(2, 2, 2, 2), stride=(2, 2), in_zero=-128)]


def wgmma_args(wl, seed=0):
    x, w, bias, mult, shift = random_conv_args(wl, seed)
    return [NHWC32.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)


@pytest.mark.parametrize("wl", UNSIGNED_PADDED, ids=["3x3_s2x1_asym", "5x5_on_3_columns", "d2_s2"])
def test_the_bias_per_border_class_gives_what_padding_with_the_zero_point_gives(wl):
    # wgmma's form (pads with 0, a bias table per border class) against mma.sync's (pads with
    # -128, one bias): the same integers, in the references and in the compute definition on llvm
    args = wgmma_args(wl, seed=3)
    _, w, bias, _, _ = random_conv_args(wl, 3)
    table = border_bias.bias_table(wl, w, bias)
    assert args[2].shape == (border_bias.table_rows(wl), ceil32(wl.out_channels)) and len(np.unique(table, axis=0)) > 1
    ref = MMA.reference(wl, *args_of(wl, seed=3))
    assert 0.05 < (ref != 0).mean()
    np.testing.assert_array_equal(IMPL.reference(wl, *args), ref)
    np.testing.assert_array_equal(run_llvm(IMPL.compute(wl), args, IMPL.out_shape(wl)), ref)


@pytest.mark.parametrize("wl", WGMMA_WLS, ids=WGMMA_IDS)
def test_cuda_code_is_a_warp_specialized_wgmma_kernel_fed_by_tma(wl):
    src = cuda_source(registry.compile_kernel(IMPL, wl, SM90A))
    c = conv2d.default_config(wl)
    assert f"wgmma.mma_async.sync.aligned.m64n{c.wn}k32.s32.s8.s8" in src
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.im2col" in src       # A: TMA im2col
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in src              # B: TMA tiled
    assert "setmaxnreg.dec.sync.aligned.u32" in src and "setmaxnreg.inc.sync.aligned.u32" in src
    assert "mma.sync" not in src and "__dp4a" not in src
    # the staged epilogue: the tile to shared memory in pairs of channels, out in 16-byte
    # segments between two barriers of the consumer warpgroup (its own named barrier)
    assert "qconv_st_u16(" in src and "qconv_copy16(" in src and src.count("qconv_wg_bar(") >= 3


def test_cuda_code_compiles_for_sm_90a_without_spills(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: CUDA source built, not compiled")
    u8 = ConvWorkload.with_activation("relu", batch=64, in_channels=256, height=56, width=56, out_channels=256,
                                      in_zero=-128)   # the border-class bias table in the epilogue
    for i, wl in enumerate((conv_wl(64, 256, 56, 56, 256), conv_wl(64, 512, 14, 14, 512), u8)):
        cu = tmp_path / f"k{i}.cu"
        cu.write_text(cuda_source(registry.compile_kernel(IMPL, wl, SM90A)))
        done = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / f"k{i}.cubin"), str(cu),
                               "-Xptxas", "-v", "-diag-suppress", "177"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        # ptxas: the 128 accumulators of a consumer stay in registers.  A few address registers
        # of the 256->256 layer spill (24 bytes, at the 168-register launch bound of 384
        # threads; its measured speed includes them); an accumulator set would be >= 256 bytes.
        log = done.stdout + done.stderr
        # The border-class table's indices cost the unsigned layer 16 bytes more (40, measured).
        spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", log)]
        assert spills and max(spills) <= (64 if wl.pads_with_zero_point else 32), log[-2000:]


def test_a_module_of_wgmma_and_s_tir_kernels_compiles():
    # TVM's tirx pipeline rejects S-TIR functions and the S-TIR pipeline TIRx ones: the project
    # pipeline lowers the TIRx kernels first (schedules/tensorcore/pipeline.py)
    wl = conv_wl(2, 64, 14, 14, 64)
    wgmma = IMPL.schedule(IMPL.compute(wl), SM90A).with_attr("global_symbol", "a")
    mma_impl = registry.get("conv2d.nhwc32.mma")
    mma = mma_impl.schedule(mma_impl.compute(wl), SM90A).with_attr("global_symbol", "b")
    options = registry.compile_options([IMPL, mma_impl])
    with SM90A, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        ex = tvm.compile(tvm.IRModule({"a": wgmma, "b": mma}), target=SM90A, tir_pipeline=options["tir_pipeline"])
    src = cuda_source(ex)
    assert "wgmma.mma_async" in src and "mma.sync" in src


def test_a_model_builds_for_sm_90a_with_wgmma_and_mma_layers_side_by_side(tmp_path):
    # SmallVGG at batch 272: its 8x8 convs have 136 tiles of 128 x 64 (>= 132 SMs: wgmma), its
    # 16->32 conv 32-column tiles (mma.sync), its first conv 3 channels (the dp4a stem); one library
    import torch
    from tvm_qconv.build import BuildOptions, compile_model
    from tvm_qconv.config import QuantConfig
    from tvm_qconv.models import SmallVGG
    from tvm_qconv.ranges import Calibrate
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(0, 1, (4, 3, 32, 32)).astype(np.float32)
    lib = compile_model(SmallVGG(), str(tmp_path / "m.so"), ranges=Calibrate(x), config=QuantConfig(num_calib_images=4),
                        options=BuildOptions(target="cuda", arch="sm_90a", batch=272, image_size=32, verify=False),
                        progress=False)
    kernels = [r["kernel"] for r in lib.report["layers"] if r["kind"].startswith("conv")]
    assert kernels == ["conv2d.nhwc32.stem", "conv2d.nhwc32.mma", "conv2d.nhwc32.wgmma", "conv2d.nhwc32.wgmma"]


# ----------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("wl", WGMMA_WLS + [conv_wl(64, 512, 14, 14, 512), UNSIGNED_PADDED[2],
                                ConvWorkload.with_activation("relu", batch=64, in_channels=256, height=28, width=28,
                                                             out_channels=256, in_zero=-128)],
                         ids=WGMMA_IDS + ["512@14_b64", "u8_d2_s2", "u8_256@28_b64"])
def test_wgmma_kernel_on_gpu_is_bit_exact(wl):
    arch = device_arch()
    if arch != "sm_90":
        pytest.skip(f"wgmma needs an sm_90 GPU (H100 / H200), this one is {arch}")
    lib = registry.compile_kernel(IMPL, wl, SM90A)
    dev = tvm.cuda(0)
    args = wgmma_args(wl, seed=1)
    out = tvm.runtime.tensor(np.full(IMPL.out_shape(wl), 77, np.int8), dev)  # poisoned
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), IMPL.reference(wl, *args))
    np.testing.assert_array_equal(out.numpy(), MMA.reference(wl, *args_of(wl, seed=1)))  # the same layer


@pytest.mark.gpu
def test_wgmma_kernel_keeps_the_64_bit_requantize_where_a_channel_needs_it():
    # the epilogue takes the 32-bit requantize only when every channel allows it (shift >= 33,
    # |bias| <= 2**30); here half do not: the 64-bit form, still bit-exact
    if device_arch() != "sm_90":
        pytest.skip(f"wgmma needs an sm_90 GPU (H100 / H200), this one is {device_arch()}")
    wl = conv_wl(8, 64, 56, 56, 64)
    lib = registry.compile_kernel(IMPL, wl, SM90A)
    dev = tvm.cuda(0)
    x, w, bias, mult, shift = slow_requantize_args(wl)
    args = [NHWC32.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)
    out = tvm.runtime.tensor(np.full(IMPL.out_shape(wl), 77, np.int8), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    ref = IMPL.reference(wl, *args)
    assert 0.2 < (np.abs(ref.astype(int)) < 127).mean()           # not all clipped
    np.testing.assert_array_equal(out.numpy(), ref)
