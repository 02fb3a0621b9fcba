"""MetaSchedule tuning on CPU: the dp4a design space, task extraction, the database round trip.

No GPU here, so nothing is measured.  Random schedules from the design space are checked the
way the default dp4a schedule is (test_conv_schedules.py): they build to CUDA source that calls
``__dp4a``, and their CPU twin (thread loops serial, dp4a as 4 multiply-adds) is bit-exact
against NumPy.  The database tests store real traces with made-up run times.
"""
import json
import lzma
import os
import re
import sys
import types

import numpy as np
import pytest
import torch
import tvm
from tvm.ir.utils import derived_object

import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.script import parser as tvmscript

import tune
from tests.workloads import conv_wl as W
from tvm_qconv import registry
from tvm_qconv.config import QuantConfig
from tvm_qconv.errors import InputError
from tvm_qconv.models import SmallVGG
from tvm_qconv.int8_module import quantize_module
from tvm_qconv.ranges import Calibrate
from tvm_qconv.schedules.nchw4c.conv2d import (conv2d_nchw4c_int8, conv2d_nchw4c_int8_ref, group_blocks,
                                               pack_channels, pack_oihw4o4i)
from tvm_qconv.schedules.nchw4c.dp4a import (UNROLL_STEPS, _ensure_dp4a_registered, apply_dp4a_schedule,
                                             default_tiles, schedule_dp4a)
from tvm_qconv.schedules.nchw4c.dp4a_space import SPACES, schedule_rules, space_generator
from tvm_qconv.schedules.nchw4c.layout import ceil4, pack_nchw4c
from tvm_qconv.schedules.requantize import quantize_multiplier
from tvm_qconv.schedules.workload import ConvWorkload
from tvm_qconv.target import TargetInfo, device_arch, make_target
from tvm_qconv.target import cuda_source as build_cuda_source
from tvm_qconv.transform import LiftConstantsToParams, ScheduleInt8Kernels
from tvm_qconv.tuning import apply_tuning_database, extract_tasks, prune_database, read_peaks, task_func, tune_model
from tvm_qconv.tuning.database import (RECORD_FILE, WORKLOAD_FILE, canonicalize_database, load_database, repair_database,
                                       tune_command, unpack_database)
from tvm_qconv.tuning.driver import CONFIG_FILE, int8_module

# sm_75 (Turing): the dp4a family only (no mma.m16n8k32 on s8), so the small model's kernels are
# the dp4a template's; the tensor-core family's tuning is tested in test_tensorcore.py.
ARCH = "sm_75"
CUDA = make_target("cuda", ARCH)
CUDA_INFO = TargetInfo.from_target(CUDA)
SM90 = make_target("cuda", "sm_90")
SIZE = 32
# 6 convs, 4 tasks: 16->16 at 32x32 and 32->32 at 16x16 twice each.
CFG = (16, 16, 16, "M", 32, 32, 32)


@pytest.fixture(scope="module", autouse=True)
def dp4a_only_tensor_intrin():
    """Let TuneContext's ``import tvm.s_tir.tensor_intrin`` find a package with dp4a only.

    The real package builds every intrinsic through TVMScript, whose parser walks
    inspect.stack() for each of ~500 of them: 30 s to minutes here (it grows with the stack
    depth and the modules loaded).  These tests need only dp4a, so while they run the package
    is an empty module over the real folder, and dp4a is registered the way the default
    schedule does it.
    """
    name = "tvm.s_tir.tensor_intrin"
    _ensure_dp4a_registered()
    if name in sys.modules:
        yield
        return
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, name, package)
        yield


def sample_schedules(func, count: int, tries: int = 100, seed: int = 1, space: str = "mlt") -> list:
    """Up to ``count`` random schedules of a dp4a space that pass every postprocessor."""
    ctx = ms.TuneContext(mod=func, target=CUDA, task_name="t", rand_state=seed, space_generator=space_generator(space))
    sketches = ctx.generate_design_space()
    found = []
    for i in range(tries):
        sch = tvm.s_tir.Schedule(ctx.mod, seed=seed + i)
        trace = tvm.s_tir.schedule.Trace(sketches[i % len(sketches)].trace.insts, {})  # no decisions: resample
        trace.apply_to_schedule(sch, remove_postproc=True)
        if all(p.apply(sch) for p in ctx.space_generator.postprocs):
            found.append(sch)
            if len(found) == count:
                break
    return found


def cuda_source(mod) -> str:
    with CUDA:
        return build_cuda_source(tvm.compile(mod, target=CUDA))


_DP4A_CALL = re.compile(
    r'T\.call_pure_extern\("int32", "__dp4a", (\w+)\[T\.Ramp\(0, 1, 4\)\], (\w+)\[T\.Ramp\(0, 1, 4\)\], 0\)')


def cpu_twin(func):
    """The scheduled CUDA PrimFunc made runnable on llvm: thread loops serial (annotations kept),
    shared/local buffers global, each __dp4a its 4 multiply-adds.  The software-pipeline
    annotations go: pipelining reorders copies for overlap, not the arithmetic, and its async
    copies need a GPU."""
    text = func.script()
    text, n_bind = re.subn(r'T\.thread_binding\((\d+), thread="[\w.]+"(, annotations=\{[^}]*\})?\)',
                           r"T.serial(\1\2)", text)
    text = re.sub(r'"software_pipeline_\w+": \[[\d, ]*\](, )?', "", text)
    text, n_dp4a = _DP4A_CALL.subn(lambda m: "(" + " + ".join(
        f'T.Cast("int32", {m[1]}[{i}]) * T.Cast("int32", {m[2]}[{i}])' for i in range(4)) + ")", text)
    text = text.replace('scope="shared"', 'scope="global"').replace('scope="local"', 'scope="global"')
    assert n_bind > 0 and n_dp4a == 1, (n_bind, n_dp4a)
    return tvmscript.parse(text)


def run_twin(func, wl: W, seed: int = 0, twin=True) -> tuple[np.ndarray, np.ndarray]:
    """(twin output, NumPy reference) on random int8 data and realistic requant multipliers;
    ``twin=False``: ``func`` is already an llvm schedule, run as it is."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width), dtype=np.int8)
    w = rng.integers(-128, 128, (wl.out_channels, wl.in_channels) + tuple(wl.kernel), dtype=np.int8)
    bias = rng.integers(-2 ** 15, 2 ** 15, wl.out_channels).astype(np.int32)
    mult, shift = quantize_multiplier(rng.uniform(1e-4, 1e-2, wl.out_channels))
    args = (pack_nchw4c(a), pack_oihw4o4i(w), pack_channels(bias), pack_channels(mult), pack_channels(shift, fill=1))
    ex = tvm.compile(tvm.IRModule({"main": cpu_twin(func) if twin else func}), target=tvm.target.Target("llvm"))
    out = tvm.runtime.tensor(np.zeros((wl.batch, ceil4(wl.out_channels) // 4, wl.out_height, wl.out_width, 4),
                                      np.int8), tvm.cpu())
    ex["main"](*[tvm.runtime.tensor(x, tvm.cpu()) for x in args], out)
    return out.numpy(), conv2d_nchw4c_int8_ref(wl, *args)


def test_space_tiles_only_with_dp4a():
    assert [type(r).__name__ for r in schedule_rules()] == [
        "MultiLevelTilingWithIntrin", "AutoInline", "ParallelizeVectorizeUnroll", "AutoBind"]
    ctx = ms.TuneContext(mod=conv2d_nchw4c_int8(W(1, 64, 28, 28, 64)), target=SM90, task_name="t",
                         space_generator=space_generator("mlt"))
    sketches = ctx.generate_design_space()
    assert len(sketches) == 3  # plain + two software-pipelined variants (sm_90)
    assert all('ann_val="dp4a_s8s8s32"' in str(s.trace) for s in sketches)


# VGG16 layer shapes at batch 1 and 64 (the tuned ones), and an odd one.
TEMPLATE_WORKLOADS = [W(1, 64, 56, 56, 64), W(1, 512, 14, 14, 512), W(64, 3, 224, 224, 64), W(1, 20, 13, 11, 36)]


@pytest.mark.parametrize("wl", TEMPLATE_WORKLOADS, ids=lambda wl: wl.describe().replace(" ", "_"))
def test_template_space_samples_mostly_valid_dp4a_schedules(wl):
    """The template space is the default schedule with sampled decisions: far more of its
    samples pass the GPU checks than the generic space's ~6 % (measured 47-78 % on VGG16 shapes;
    30 % leaves room for the random draw), and each one is tensorized the same way."""
    schedules = sample_schedules(conv2d_nchw4c_int8(wl), count=100, tries=40, space="template")
    assert len(schedules) >= 12
    for sch in schedules[:3]:
        assert 'tensor_intrin="dp4a_s8s8s32"' in str(sch.trace)
    body = cuda_source(schedules[0].mod)
    assert "__dp4a(" in body and "__shared__" in body


def test_default_schedule_is_the_template_with_the_heuristic_decisions():
    """So the default can seed the search (tune_model commits it as a measured record)."""
    func = conv2d_nchw4c_int8(W(1, 64, 56, 56, 64))
    tiles = default_tiles(func, CUDA)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    apply_dp4a_schedule(sch, tiles)
    decisions = [sch.trace.decisions[i] for i in sch.trace.insts if i in sch.trace.decisions]
    decisions = [[int(v) for v in d] if hasattr(d, "__len__") else int(d) for d in decisions]
    assert decisions == [[16 // (tiles.oct * tiles.ocr), tiles.oct, tiles.ocr],
                             [56 // (tiles.yt * tiles.yr), tiles.yt, tiles.yr],
                             [56 // (tiles.xt * tiles.xr), tiles.xt, tiles.xr], [16 // tiles.rc, tiles.rc],
                             UNROLL_STEPS.index(tiles.unroll)]
    assert tvm_ffi.structural_equal(schedule_dp4a(func, CUDA).without_attr("tir.is_scheduled"),
                                    _postprocessed(sch)["main"])


def _postprocessed(sch):
    ms.postproc.RewriteParallelVectorizeUnroll().apply(sch)
    return sch.mod


def test_seed_of_a_grouped_task_keeps_each_block_inside_one_group():
    """The tuner's function has no workload attribute (task_func strips it), so the seed takes the
    task's workload: a grouped conv's default block covers one group's output channels, as its
    default schedule's does, and passes the space's GPU checks."""
    wl = W(32, 32, 16, 16, 32, groups=2)  # 2 groups x 4 oc blocks; planned as one group, a block spans both
    impl = registry.get("conv2d.nchw4c.dp4a")
    func = task_func(impl.compute(wl))
    ctx = ms.TuneContext(mod=func, target=CUDA, task_name="seed",
                         space_generator=impl.space_generator(impl.spaces[0], func, CUDA))
    sch = tvm.s_tir.Schedule(ctx.mod)
    impl.seed(sch, CUDA, wl)
    oc_tile = [int(v) for v in next(sch.trace.decisions[i] for i in sch.trace.insts
                                    if i.kind.name == "SamplePerfectTile")]  # the first tiled axis: oc
    ogb = group_blocks(wl)[1]
    assert ogb % (oc_tile[1] * oc_tile[2]) == 0, oc_tile
    tiles = default_tiles(impl.compute(wl), CUDA)  # the build's default, read off the attribute
    assert oc_tile == [2 * ogb // (tiles.oct * tiles.ocr), tiles.oct, tiles.ocr]
    assert all(p.apply(sch) for p in ctx.space_generator.postprocs)


# The first VGG16 conv (3 channels, padded to 4) and a 3x3 64->64 layer, at test sizes.
@pytest.mark.parametrize("wl", [W(1, 3, 32, 32, 64), W(1, 64, 28, 28, 64)], ids=["stem_3to64", "3x3_64to64"])
def test_sampled_schedules_tensorize_fuse_pad_and_requant_and_build(wl):
    schedules = sample_schedules(conv2d_nchw4c_int8(wl), count=3)
    assert len(schedules) == 3
    for sch in schedules:
        trace = str(sch.trace)
        assert 'tensor_intrin="dp4a_s8s8s32"' in trace
        # pad inlined into the shared-memory copy, requant into the register write-back
        assert re.search(r"sch\.compute_inline\(block=(b\d+)\)", trace)[1] == \
            re.search(r'(b\d+) = sch\.get_sblock\(name="pad"', trace)[1]
        assert re.search(r"sch\.reverse_compute_inline\(block=(b\d+)\)", trace)[1] == \
            re.search(r'(b\d+) = sch\.get_sblock\(name="requant"', trace)[1]
        script = sch.mod.script()
        assert 'T.sblock("pad")' not in script and 'T.sblock("requant")' not in script
        write_back = script[script.index('T.sblock("conv_local")'):]
        assert "requant[v0, v1, v2, v3, v4] = " in write_back and "conv_local[v0, v1, v2, v3, v4]" in write_back
        body = cuda_source(sch.mod)
        body = body[body.index("__global__"):]
        assert "__dp4a(" in body and "__shared__" in body


# Stride, dilation, a 7x7 stem with batch 2 and no ReLU, odd channel counts.
@pytest.mark.parametrize("wl", [W(1, 16, 8, 8, 16), W(1, 20, 13, 11, 36, stride=(2, 2), dilation=(1, 2)),
                                W(2, 3, 17, 17, 8, (7, 7), (2, 2), (3, 3, 3, 3), relu=False)],
                         ids=["3x3_16to16_8", "3x3s2d1x2_20to36", "stem_7x7s2_b2_norelu"])
@pytest.mark.parametrize("space", SPACES)
def test_sampled_schedules_are_bit_exact_on_the_cpu_twin(wl, space):
    schedules = sample_schedules(conv2d_nchw4c_int8(wl), count=2, tries=200, space=space)
    assert schedules
    for sch in schedules:
        out, ref = run_twin(sch.mod["main"], wl)
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("wl", [W(1, 16, 8, 8, 16), W(1, 20, 13, 11, 36, stride=(2, 2), dilation=(1, 2))],
                         ids=["3x3_16to16_8", "3x3s2d1x2_20to36"])
def test_every_point_of_the_cpu_space_is_bit_exact(wl):
    """The llvm conv's search space (cpu_space.py): each oc tile x column tile it can sample
    builds and gives the reference's integers (odd sizes, stride 2, dilation)."""
    from tvm_qconv.schedules.nchw4c.cpu import apply_cpu_schedule, default_tiles, tile_choices
    func = conv2d_nchw4c_int8(wl)
    octs, owts = tile_choices(func)
    assert default_tiles(func)[0] in octs and default_tiles(func)[1] in owts  # the default is a point of it
    for octile in octs:
        for owt in owts:
            sch = tvm.s_tir.Schedule(func)
            apply_cpu_schedule(sch, octile, owt)
            out, ref = run_twin(sch.mod["main"], wl, twin=False)
            np.testing.assert_array_equal(out, ref, err_msg=f"oc tile {octile}, ow tile {owt}")


@pytest.fixture(scope="module")
def small_int8():
    """(model, int8 module as compile_model builds it under the symmetric scheme, tasks of the module
    tune_model builds).  The tuner's tasks are the symmetric build's; the default's unsigned kernels
    take their schedules through the symmetric twin
    (``test_an_unsigned_activations_kernel_takes_its_symmetric_twins_schedule``)."""
    torch.manual_seed(0)
    model = SmallVGG(cfg=CFG)
    images = np.random.default_rng(0).normal(size=(4, 3, SIZE, SIZE)).astype(np.float32)
    config = QuantConfig(calibration="max", unsigned_activations=False, bias_correction=False)
    q = quantize_module(model, (1, 3, SIZE, SIZE), CUDA_INFO, config=config, ranges=Calibrate(images), progress=False)
    return model, LiftConstantsToParams()(q.mod), extract_tasks(int8_module(model, 1, SIZE, CUDA))


def test_extract_tasks_dedupes_and_counts(small_int8):
    _, _, tasks = small_int8
    assert [(t.name, t.weight) for t in tasks] == [
        ("3to16_3x3s1_32x32_b1", 1), ("16to16_3x3s1_32x32_b1", 2), ("16to32_3x3s1_16x16_b1", 1),
        ("32to32_3x3s1_16x16_b1", 2)]
    assert tasks[1].workload == W(1, 16, 32, 32, 16)
    assert tasks[1].func.attrs["global_symbol"] == "main" and "op_pattern" not in tasks[1].func.attrs
    assert not [k for k in tasks[1].func.attrs.keys() if k.startswith("tvm_qconv.")]  # the computation only
    assert {t.impl.name for t in tasks} == {"conv2d.nchw4c.dp4a"}


def test_tuning_and_building_present_the_same_workloads(small_int8):
    """tune_model calibrates on 2 photos, compile_model on other images with another observer:
    the database must still find every kernel."""
    _, qmod, tasks = small_int8
    built = extract_tasks(qmod)
    assert [t.name for t in built] == [t.name for t in tasks]
    assert all(tvm_ffi.structural_equal(a.func, b.func) for a, b in zip(built, tasks))


def commit(work_dir, task, secs_list) -> None:
    """Commit one random valid schedule of ``task`` per entry of ``secs_list`` (run times in s),
    as the task scheduler would: workload = the TuneContext's module."""
    db = ms.database.JSONDatabase(work_dir=str(work_dir))
    mod = ms.TuneContext(mod=task.func).mod
    wk = db.commit_workload(mod)
    schedules = sample_schedules(task.func, count=len(secs_list))
    for sch, secs in zip(schedules, secs_list):
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wk, [secs], CUDA,
                                                         ms.arg_info.ArgInfo.from_prim_func(mod["main"])))


@pytest.fixture(scope="module")
def tuned_db(small_int8, tmp_path_factory):
    """A database with two valid records for the twice-used 16->16 conv (best 5 us) and a failed
    one for the first conv."""
    _, _, tasks = small_int8
    work_dir = tmp_path_factory.mktemp("tuned")
    commit(work_dir, tasks[1], [8e-6, 5e-6])
    commit(work_dir, tasks[0], [1e10])
    return work_dir


def test_apply_schedules_exactly_the_tuned_kernel_and_the_model_builds(small_int8, tuned_db):
    _, qmod, tasks = small_int8
    mod, tuned = apply_tuning_database(qmod, str(tuned_db), CUDA)
    shapes = {gv.name_hint: ConvWorkload.of(f) for gv, f in qmod.functions.items()
              if registry.of_func(f) is not None and registry.of_func(f).op == "conv2d"}
    (name,) = [n for n, wl in shapes.items() if wl == tasks[1].workload]
    assert tuned == {name: "16->16 3x3 s1 @32x32 b1"}  # the failed record of tasks[0] is not applied
    func = mod[name]
    assert func.attrs["tir.is_scheduled"] and "global_symbol" not in func.attrs
    assert func.attrs["tvm_qconv.kernel"] == "conv2d_nchw4c_int8" and func.attrs["op_pattern"] == 8
    assert not qmod[name].attrs.get("tir.is_scheduled", False)  # the input module is left alone
    sched = ScheduleInt8Kernels(CUDA)
    mod = sched(mod)
    convs = {k: v[1] for k, v in sched.applied.items() if v[0] == "conv2d.nchw4c.dp4a"}
    assert convs == {n: "tuned" if n == name else "default" for n in shapes}
    with CUDA:
        tvm.compile(mod, target=CUDA)


def test_an_unsigned_activations_kernel_takes_its_symmetric_twins_schedule(small_int8, tmp_path):
    # tune.py tunes the symmetric build; in the unsigned build the 32->32 conv (used twice) reads and
    # writes unsigned tensors (zero point -128: its padding reads it, its clamp is [-128, 127]),
    # which changes those constants alone, so it takes the same record (tuning/apply.py: symmetric_twin)
    from tvm_qconv.tuning.apply import symmetric_twin
    model, _, tasks = small_int8
    commit(tmp_path, tasks[3], [5e-6])                     # 32->32 3x3 @16x16, used twice
    images = np.random.default_rng(0).normal(size=(4, 3, SIZE, SIZE)).astype(np.float32)
    q = quantize_module(model, (1, 3, SIZE, SIZE), CUDA_INFO,
                        config=QuantConfig(calibration="max", unsigned_activations=True),
                        ranges=Calibrate(images), progress=False)
    qmod = LiftConstantsToParams()(q.mod)
    convs = {gv.name_hint: ConvWorkload.of(f) for gv, f in qmod.functions.items()
             if registry.of_func(f) is not None and registry.of_func(f).op == "conv2d"}
    (same,) = [n for n, wl in convs.items() if wl.in_channels == wl.out_channels == 32]   # one kernel, twice
    assert (convs[same].in_zero, convs[same].act_min) == (-128, -128)
    assert tvm_ffi.structural_equal(tasks[3].func, task_func(registry.get("conv2d.nchw4c.dp4a").compute(
        symmetric_twin(convs[same]))))
    mod, tuned = apply_tuning_database(qmod, str(tmp_path), CUDA)
    assert {same} == set(tuned) and mod[same].attrs["tir.is_scheduled"]
    with CUDA:
        tvm.compile(ScheduleInt8Kernels(CUDA)(mod), target=CUDA)


def test_apply_warns_about_another_arch_and_no_match(small_int8, tuned_db, capsys):
    _, qmod, _ = small_int8
    _, tuned = apply_tuning_database(qmod, str(tuned_db), make_target("cuda", "sm_80"))
    assert len(tuned) == 1 and "was tuned for sm_75, building for sm_80" in capsys.readouterr().err
    torch.manual_seed(0)
    other = quantize_module(SmallVGG(cfg=(8, "M", 8)), (1, 3, SIZE, SIZE), CUDA_INFO,
                            config=QuantConfig(calibration="max"),
                            ranges=Calibrate(np.ones((1, 3, SIZE, SIZE), np.float32)), progress=False).mod
    _, tuned = apply_tuning_database(other, str(tuned_db), CUDA)
    assert tuned == {} and "covers none of this model's 2 tunable kernels" in capsys.readouterr().err


def test_interrupted_write_is_repaired_with_a_backup(small_int8, tuned_db, tmp_path, capsys):
    _, qmod, _ = small_int8
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (tmp_path / name).write_bytes((tuned_db / name).read_bytes())
    records = (tmp_path / RECORD_FILE).read_bytes()
    (tmp_path / RECORD_FILE).write_bytes(records + records.split(b"\n")[1][:300])  # killed mid-line
    _, tuned = apply_tuning_database(qmod, str(tmp_path), CUDA)  # in memory: skips the line, writes nothing
    assert len(tuned) == 1 and len(os.listdir(tmp_path)) == 2
    with pytest.raises(Exception):
        ms.database.JSONDatabase(work_dir=str(tmp_path))  # MetaSchedule itself cannot load it
    assert repair_database(str(tmp_path)) == 2
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().err
    backup = [f for f in os.listdir(tmp_path) if f.startswith(RECORD_FILE + ".bak-")]
    assert len(backup) == 1 and (tmp_path / RECORD_FILE).read_bytes() == records
    assert len(ms.database.JSONDatabase(work_dir=str(tmp_path))) == 3


def test_prune_keeps_the_best_valid_record_per_workload_packed(small_int8, tuned_db, tmp_path):
    _, qmod, _ = small_int8
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (tmp_path / name).write_bytes((tuned_db / name).read_bytes())
    assert prune_database(str(tmp_path)) == (3, 1)
    # Packed to commit: only the .xz files are left (no backup either: nothing to repair).
    assert sorted(os.listdir(tmp_path)) == [RECORD_FILE + ".xz", WORKLOAD_FILE + ".xz"]
    (line,) = lzma.decompress((tmp_path / (RECORD_FILE + ".xz")).read_bytes()).decode().splitlines()
    assert json.loads(line)[1][1] == [5e-6]
    _, tuned = apply_tuning_database(qmod, str(tmp_path), CUDA)  # builds read the packed form
    assert list(tuned.values()) == ["16->16 3x3 s1 @32x32 b1"]
    unpack_database(str(tmp_path))  # what tune_model does before tuning on
    assert sorted(os.listdir(tmp_path)) == [RECORD_FILE, WORKLOAD_FILE]
    assert len(ms.database.JSONDatabase(work_dir=str(tmp_path))) == 1


def test_apply_without_usable_records_says_how_to_tune(small_int8, tuned_db, tmp_path):
    _, qmod, _ = small_int8
    with pytest.raises(InputError, match=r"tuning log folder .*/nope does not exist: create it with "
                                         r"`python tune.py --model MODEL --batch N"):
        apply_tuning_database(qmod, str(tmp_path / "nope"), CUDA)
    with pytest.raises(InputError, match="has no MetaSchedule database"):
        apply_tuning_database(qmod, str(tmp_path), CUDA)
    (tmp_path / WORKLOAD_FILE).write_bytes((tuned_db / WORKLOAD_FILE).read_bytes())
    (failed,) = [line for line in (tuned_db / RECORD_FILE).read_text().splitlines() if json.loads(line)[1][1] == [1e10]]
    (tmp_path / RECORD_FILE).write_text(failed + "\n")
    with pytest.raises(InputError, match="has no successfully measured schedule"):
        apply_tuning_database(qmod, str(tmp_path), CUDA)


def test_tune_model_resumes_from_the_database(small_int8, tuned_db, tmp_path, capsys):
    model, _, tasks = small_int8
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (tmp_path / name).write_bytes((tuned_db / name).read_bytes())
    # 2 valid records = 2 trials done: nothing is tuned (no builder or runner is even created)
    rows = tune_model("small_vgg", 1, arch=ARCH, trials_per_task=2, work_dir=str(tmp_path), image_size=SIZE, model=model,
                      only=[tasks[1].name], peaks={"dp4a": 100.0})
    out = capsys.readouterr().out
    assert "nothing to tune" in out and "16->16 3x3 s1 @32x32 b1" in out
    assert rows == [dict(task=tasks[1].name, shape="16->16 3x3 s1 @32x32 b1", layer=str(tasks[1].workload),
                         occurrences=2, trials=2,
                         best_us=pytest.approx(5.0), tops=pytest.approx(tasks[1].workload.ops / 5e-6 / 1e12),
                         pct_peak=pytest.approx(tasks[1].workload.ops / 5e-6 / 1e12))]  # of dp4a's 100 TOPS
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["model"], cfg["batch"], cfg["arch"], cfg["image_size"], len(cfg["runs"])) == ("small_vgg", 1, ARCH,
                                                                                              SIZE, 1)
    assert cfg["tvm_version"] == tvm.__version__
    with pytest.raises(InputError, match="holds tuning logs for batch=1, not 2"):
        tune_model("small_vgg", 2, arch=ARCH, work_dir=str(tmp_path), image_size=SIZE, model=model)
    with pytest.raises(InputError, match="unknown task.*has 3to16_3x3s1_32x32_b1"):
        tune_model("small_vgg", 1, arch=ARCH, work_dir=str(tmp_path), image_size=SIZE, model=model, only=["64to64"])
    # a misspelt family is named before any work (it used to leave no task: "has no tunable kernel")
    with pytest.raises(InputError, match="unknown kernel family 'tensorcore': the tunable families are cpu, dp4a, mma"):
        tune_model("small_vgg", 1, arch=ARCH, work_dir=str(tmp_path / "f"), model=model, families=["tensorcore"])
    assert not (tmp_path / "f").exists()
    # a --work-dir that is a file, or lies under one, is refused before quantizing (it used to
    # fail in os.makedirs after a minute of work, with a traceback)
    (tmp_path / "afile").write_text("x")
    for work_dir in (tmp_path / "afile", tmp_path / "afile" / "db"):
        with pytest.raises(InputError, match=f"--work-dir.* cannot be written: {tmp_path / 'afile'} is a file"):
            tune_model("small_vgg", 1, arch=ARCH, work_dir=str(work_dir), image_size=SIZE, model=model)
    # on sm_90 each 16+ channel conv has a tensor-core task too, which has no "mlt" space: the
    # space is checked on the tasks --only leaves, and the message says how to leave them out
    with pytest.raises(InputError, match="'mlt' is not one of 16to16_3x3s1_32x32_b1_mma.*--family or --only"):
        tune_model("small_vgg", 1, arch="sm_90", work_dir=str(tmp_path / "s"), image_size=SIZE, model=model,
                   space="mlt", only=["16to16_3x3s1_32x32_b1_mma"], runner=_FakeRunner())  # no GPU check


def test_cli_errors_are_one_line_and_help_lists_every_flag(capsys, tmp_path):
    assert tune.main(["--model", "vgg17", "--work-dir", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown model 'vgg17'") and "\n" not in err
    assert not (tmp_path / "t").exists()
    for bad in (["--batch", "0"], ["--arch", "90"]):
        with pytest.raises(SystemExit) as exc:
            tune.main(["--model", "vgg16", *bad])
        assert exc.value.code == 2
    capsys.readouterr()
    (tmp_path / "peaks.json").write_text('{"device": "x"}')  # not int8_peaks.py's JSON: refused before any work
    for peaks, message in ((tmp_path / "none.json", "cannot read the peaks file"),
                           (tmp_path / "peaks.json", "is not the JSON of benchmarks/int8_peaks.py")):
        assert tune.main(["--model", "vgg16", "--peaks", str(peaks), "--work-dir", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err
        assert not (tmp_path / "t").exists()
    with pytest.raises(SystemExit) as exc:
        tune.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--batch", "--target", "--arch", "--trials", "--work-dir", "--image-size", "--workers",
                 "--trials-per-iter", "--seed", "--only", "--peaks", "--prune", "--space", "--no-seed-default",
                 "--family"):
        assert flag in text


@derived_object
class _FakeFuture(ms.runner.PyRunnerFuture):
    def __init__(self, secs: float):
        self.secs = secs

    def done(self) -> bool:
        return True

    def result(self) -> ms.runner.RunnerResult:
        return ms.runner.RunnerResult([self.secs], None)


@derived_object
class _FakeRunner(ms.runner.PyRunner):
    """Measures nothing: the first candidate (the seeded default) takes 20 us, the others 10 us."""

    def __init__(self):
        self.calls = 0

    def run(self, runner_inputs: list) -> list:
        self.calls += 1
        return [_FakeFuture(20e-6 if self.calls == 1 else 10e-6) for _ in runner_inputs]


def test_tune_model_starts_from_the_default_schedule_and_logs_progress(small_int8, tmp_path):
    """The real builder (CUDA source, no GPU) and search; only the run times are made up."""
    model, _, tasks = small_int8
    task = tasks[1]
    rows = tune_model("small_vgg", 1, arch=ARCH, trials_per_task=2, num_trials_per_iter=1, work_dir=str(tmp_path),
                      image_size=SIZE, model=model, only=[task.name], runner=_FakeRunner(), max_workers=1)
    assert rows[0]["trials"] == 2 and rows[0]["best_us"] == pytest.approx(10.0)
    records = [json.loads(line) for line in (tmp_path / RECORD_FILE).read_text().splitlines()]
    assert [r[1][1] for r in records] == [[20e-6], [10e-6]]
    # The first record is the default schedule: its trace holds the heuristic tile decisions.
    tiles = default_tiles(task.func, CUDA)
    occ = ceil4(task.workload.out_channels) // 4
    assert f"[{occ // (tiles.oct * tiles.ocr)}, {tiles.oct}, {tiles.ocr}]" in json.dumps(records[0][1][0])
    progress = [json.loads(line) for line in (tmp_path / "logs" / "progress.jsonl").read_text().splitlines()]
    assert [p["valid"] for p in progress] == [1, 2]
    assert [p["model_conv_us"] for p in progress] == [pytest.approx(40.0), pytest.approx(20.0)]  # x2 occurrences


def test_rerunning_a_pruned_tuning_command_tunes_nothing_more(small_int8, tmp_path, capsys):
    """tune.py --prune keeps one record per workload; the trials it dropped still count, so the
    same command run again (docs/usage.md's resume) finds every task finished, not 1 of 2 trials."""
    model, _, tasks = small_int8
    task = tasks[1]
    args = dict(arch=ARCH, trials_per_task=2, num_trials_per_iter=1, work_dir=str(tmp_path), image_size=SIZE,
                model=model, only=[task.name], runner=_FakeRunner(), max_workers=1)
    tune_model("small_vgg", 1, **args)
    assert prune_database(str(tmp_path)) == (2, 1)
    capsys.readouterr()
    rows = tune_model("small_vgg", 1, **args)
    out = capsys.readouterr().out
    assert "2/2 valid trials in the database" in out and "task(s) to tune" not in out
    assert rows[0]["trials"] == 2 and rows[0]["best_us"] == pytest.approx(10.0)


def test_tuning_without_a_gpu_is_refused_before_it_records_itself(small_int8, tmp_path):
    # every candidate is measured on the local GPU: none here, so no run, and no config.json
    # (a finished database resumes without one: test_tune_model_resumes_from_the_database)
    if device_arch() is not None:
        pytest.skip("this machine has a GPU")
    model, _, tasks = small_int8
    with pytest.raises(InputError, match="no CUDA GPU on this machine: tuning measures every candidate on the "
                                         "sm_.* GPU it tunes for; tune through a GPU machine's RPC "
                                         "servers"):
        tune_model("small_vgg", 1, arch=ARCH, trials_per_task=2, work_dir=str(tmp_path), image_size=SIZE,
                   model=model, only=[tasks[1].name])
    assert CONFIG_FILE not in os.listdir(tmp_path)


def test_a_truncated_packed_database_is_reported_not_unpacked(small_int8, tuned_db, tmp_path):
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (tmp_path / name).write_bytes((tuned_db / name).read_bytes())
    prune_database(str(tmp_path))
    packed = tmp_path / (WORKLOAD_FILE + ".xz")
    packed.write_bytes(packed.read_bytes()[:200])  # a cut-off download or checkout
    with pytest.raises(InputError, match=r"is corrupt \(EOFError.*restore it .*or delete it and tune again"):
        load_database(str(tmp_path))
    with pytest.raises(InputError, match="is corrupt"):
        unpack_database(str(tmp_path))
    # a tuning run on it is refused before it records itself in config.json
    with pytest.raises(InputError, match="is corrupt"):
        tune_model("small_vgg", 1, arch=ARCH, work_dir=str(tmp_path), image_size=SIZE, model=small_int8[0])
    assert sorted(os.listdir(tmp_path)) == [RECORD_FILE + ".xz", WORKLOAD_FILE + ".xz"]  # left as it was


VGG16_CONVS = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
               (256, 512, 28), (512, 512, 28), (512, 512, 14)]
COMMITTED = os.path.join(os.path.dirname(__file__), "..", "tuning_logs")


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_committed_vgg16_databases_measured_every_family_of_every_conv(batch):
    """tuning_logs/vgg16-b<N>-sm_90a: each conv's kernel of every tunable family that runs it on
    sm_90a (wgmma, mma.sync, dp4a) has a record, so the build's choice per layer is measured."""
    db = load_database(os.path.join(COMMITTED, f"vgg16-b{batch}-sm_90a"))
    sm90a = make_target("cuda", "sm_90a")
    for cin, cout, size in VGG16_CONVS[1:]:  # the first conv runs on the stem kernel: nothing to tune
        wl = W(batch, cin, size, size, cout)
        impls = [i for i in registry.candidates("conv2d", wl, TargetInfo.from_target(sm90a)) if i.spaces]
        assert {i.family for i in impls} == {"wgmma", "mma", "dp4a"}, (cin, impls)
        for impl in impls:
            func = tvm.IRModule({"main": task_func(impl.compute(wl))})
            assert db.has_workload(func), (impl.name, cin, cout, size)
            assert db.query_schedule(func, sm90a, "main") is not None


@pytest.mark.parametrize("model", ["vgg16", "resnet50"])
def test_committed_databases_say_what_they_were_tuned_for(model):
    for batch in (1, 16, 64):
        with open(os.path.join(COMMITTED, f"{model}-b{batch}-sm_90a", CONFIG_FILE)) as f:
            cfg = json.load(f)
        assert (cfg["model"], cfg["batch"], cfg["arch"], cfg["image_size"]) == (model, batch, "sm_90a", 224)


def test_a_database_covering_some_kernels_names_those_left_on_their_default(capsys):
    """A database covers the shapes it was tuned for: a kernel of another shape keeps its
    default schedule, and the build says so, by implementation."""
    from tvm_qconv.tuning.apply import apply_tuning_database
    wgmma, mma = registry.get("conv2d.nhwc32.wgmma"), registry.get("conv2d.nhwc32.mma")
    mod = tvm.IRModule({"conv1": wgmma.compute(W(1, 64, 224, 224, 64)), "conv2": mma.compute(W(1, 64, 100, 100, 64))})
    mod, tuned = apply_tuning_database(mod, os.path.join(COMMITTED, "vgg16-b1-sm_90a"), make_target("cuda", "sm_90a"))
    assert list(tuned) == ["conv1"] and tuned["conv1"].startswith("64->64 3x3 s1 @224x224 b1 (wgmma ")
    assert mod["conv1"].attrs["tvm_qconv.impl"] == wgmma.name and mod["conv1"].attrs["tir.is_scheduled"]
    err = capsys.readouterr().err
    assert "covers 1 of this model's 2 tunable kernels; 1 conv2d.nhwc32.mma get the default schedule" in err


def test_resuming_an_old_database_rewrites_its_workloads_in_canonical_form(tmp_path):
    import shutil
    work_dir = tmp_path / "db"
    # a database tune.py wrote before the canonical form (2026-11-22), kept as it was
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "vgg16-b1-sm_90-before-canonical-form"), work_dir)
    unpack_database(str(work_dir))
    impl = registry.get("conv2d.nchw4c.dp4a")
    func = tvm.IRModule({"main": task_func(impl.compute(W(1, 64, 224, 224, 64)))})
    _ensure_dp4a_registered()
    # written before the canonical form: MetaSchedule itself would not find the kernel in it
    assert not ms.database.JSONDatabase(work_dir=str(work_dir)).has_workload(func)
    canonicalize_database(str(work_dir))
    db = ms.database.JSONDatabase(work_dir=str(work_dir))  # what tune_model opens to resume
    assert len(db) == 9 and db.has_workload(func) and db.get_top_k(db.commit_workload(func), 1)


def test_the_suggested_tune_command_recreates_the_folder_with_its_settings(tmp_path):
    # error messages tell the user this command; it must tune what the folder held
    (tmp_path / "config.json").write_text(json.dumps(dict(model="resnet50", batch=16, arch="sm_80", image_size=96,
                                                          families=["mma"], space="template")))
    assert tune_command(str(tmp_path)) == (f"python tune.py --model resnet50 --batch 16 --arch sm_80 --image-size 96 "
                                           f"--family mma --space template --work-dir {tmp_path}")
    new = tmp_path / "new"  # no config.json: placeholders
    assert tune_command(str(new)) == f"python tune.py --model MODEL --batch N --arch sm_90 --work-dir {new}"


def test_peaks_are_read_per_instruction_and_bad_files_refused(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    peaks = read_peaks(os.path.join(root, "docs", "results", "int8_peaks_h100.json"))  # the committed H100 run
    assert set(peaks) == {"dp4a", "mma.sync", "wgmma"} and 100 < peaks["dp4a"] < peaks["mma.sync"] < peaks["wgmma"]
    # every tuned GPU family finds its peak (the CPU conv's has none measured)
    assert {impl.instruction for impl in registry.tunable() if impl.family != "cpu"} <= set(peaks)
    for text in ('{"peaks": []}', '{"peaks": [{"path": "dp4a", "tops": 0}]}'):
        (tmp_path / "p.json").write_text(text)
        with pytest.raises(InputError, match="holds no usable peak"):
            read_peaks(str(tmp_path / "p.json"))


def test_ctrl_c_stops_tuning_after_the_round_in_flight_and_the_run_resumes(tmp_path, monkeypatch):
    """The first Ctrl-C ends the run cleanly (KeyboardInterrupt out of tune_model, which the CLI
    turns into one line and exit 130) with the measured rounds committed; the same call resumes."""
    import signal

    from tvm_qconv.tuning import progress
    valid_secs = progress.valid_secs
    sent = []

    def valid_secs_then_ctrl_c(builder_results, runner_results):
        if not sent:  # the first search round (the defaults' seeds are counted elsewhere)
            sent.append(len(runner_results))
            os.kill(os.getpid(), signal.SIGINT)
        return valid_secs(builder_results, runner_results)
    monkeypatch.setattr(progress, "valid_secs", valid_secs_then_ctrl_c)
    torch.manual_seed(0)
    args = dict(target="llvm", trials_per_task=3, work_dir=str(tmp_path), image_size=SIZE, model=SmallVGG(cfg=CFG),
                num_trials_per_iter=2, max_workers=1)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    with pytest.raises(KeyboardInterrupt):
        tune_model("small_vgg", 1, **args)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
    load_database(str(tmp_path))  # whole
    monkeypatch.setattr(progress, "valid_secs", valid_secs)
    rows = tune_model("small_vgg", 1, **args)
    assert all(r["trials"] >= 3 for r in rows)


def test_a_schedule_of_an_older_template_is_named_stale_not_corrupt(small_int8, tuned_db, tmp_path, capsys):
    """A record whose trace no longer replays (here: the template's block renamed since) is
    reported as such, with the re-tune command; --ignore-stale builds the kernel's default."""
    _, qmod, tasks = small_int8
    for name in os.listdir(tuned_db):
        data = (tuned_db / name).read_bytes()
        if name.startswith("database_tuning_record"):
            assert b'"conv"' in data
            data = data.replace(b'"conv"', b'"conv_v0"')  # the block the old template's trace names
        (tmp_path / name).write_bytes(data)
    with pytest.raises(InputError, match=r"holds schedules of an older kernel template: they no longer apply to "
                                         r"their kernels .*re-tune with `python tune.py .*`, or build with "
                                         r"--ignore-stale"):
        apply_tuning_database(qmod, str(tmp_path), CUDA)
    mod, tuned = apply_tuning_database(qmod, str(tmp_path), CUDA, ignore_stale=True)
    assert tuned == {}  # no record left: the kernel keeps its default
    err = capsys.readouterr().err
    assert "2 record(s) of an older kernel template left out (--ignore-stale)" in err


def test_the_runner_gives_a_layer_the_requantize_constants_of_a_calibrated_model():
    # random int32 shifts would send the wgmma / stem kernels down their 64-bit requantize,
    # which a model never takes (schedules/requantize.py: the 32-bit form needs shift >= 33)
    from tvm_qconv.tuning.driver import _alloc_layer_args
    func = registry.get("conv2d.nhwc32.mma").compute(W(1, 64, 8, 8, 64))
    info = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(func)]
    (args,) = _alloc_layer_args(tvm.cpu(), info, 1)
    bias, mult, shift = (a.numpy() for a in args[2:5])
    assert np.abs(bias).max() < 4096 and mult.min() >= 2 ** 30 and 33 <= shift.min() and shift.max() <= 62
    other = [["TENSOR", "float32", [4]], ["TENSOR", "float32", [4]]]   # not a fused layer: left random
    assert len(_alloc_layer_args(tvm.cpu(), other, 1)[0]) == 2


def test_the_table_totals_each_layer_once_with_its_fastest_family():
    from tvm_qconv.tuning.progress import format_table
    row = lambda task, layer, us: dict(task=task, shape="64->64 3x3 s1 @56x56 b1", layer=layer, occurrences=2,
                                       trials=1, best_us=us, tops=1.0)
    # one layer's three families, and a layer of the same shape but other padding (its own row)
    text = format_table([row("a_wgmma", "L1", 10.0), row("a_mma", "L1", 12.0), row("a_dp4a", "L1", 40.0),
                         row("a_mma_2", "L2", 15.0)])
    assert text.splitlines()[-1].split()[-1] == "50.0"   # 2 x 10 + 2 x 15


def test_a_family_that_runs_no_layer_for_the_arch_is_named_with_what_it_needs(small_int8, tmp_path):
    model, _, _ = small_int8
    with pytest.raises(InputError, match=r"no layer of small_vgg runs on kernel family wgmma for sm_90 \(wgmma "
                                         r"runs on --arch sm_90a"):
        tune_model("small_vgg", 1, arch="sm_90", work_dir=str(tmp_path), image_size=SIZE, model=model,
                   families=["wgmma"], runner=_FakeRunner())


def test_a_kernel_with_a_table_epilogue_takes_the_plain_convs_schedule(tmp_path):
    # a SiLU table fused into the conv before it (quantization/epilogues.py) adds a table argument
    # and a lookup in the epilogue's expression, no block: a record tuned on the plain conv (a
    # database from before fusion) schedules it (tuning/apply.py: tuning_twin)
    from tvm_qconv.tuning.apply import tuning_twin
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.SiLU(),
                                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * SIZE * SIZE, 10)).eval()
    images = np.random.default_rng(0).normal(size=(4, 3, SIZE, SIZE)).astype(np.float32)
    q = quantize_module(model, (1, 3, SIZE, SIZE), CUDA_INFO, config=QuantConfig(calibration="max"),
                        ranges=Calibrate(images), progress=False)
    qmod = LiftConstantsToParams()(q.mod)
    convs = {gv.name_hint: ConvWorkload.of(f) for gv, f in qmod.functions.items()
             if registry.of_func(f) is not None and registry.of_func(f).op == "conv2d"}
    (fused,) = [n for n, wl in convs.items() if wl.table]
    plain = tuning_twin(convs[fused])
    assert not plain.table and tuning_twin(plain) is None
    commit(tmp_path, types.SimpleNamespace(func=task_func(registry.get("conv2d.nchw4c.dp4a").compute(plain))), [5e-6])
    mod, tuned = apply_tuning_database(qmod, str(tmp_path), CUDA)
    assert set(tuned) == {fused} and mod[fused].attrs["tir.is_scheduled"]
    with CUDA:
        assert "Table" in build_cuda_source(tvm.compile(ScheduleInt8Kernels(CUDA)(mod), target=CUDA))
