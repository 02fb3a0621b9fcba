"""The training convs' measured kernels (``tvm_qconv/nn/conv_tiles.py``, its table ``conv_table.py``
and its choices ``schedules/training/conv_choices.py``): the choices the search
measures (the mma.sync template's tiles, Hopper's wgmma kernel with its int32 epilogue), the rule
that picks one, the table it keeps and how the kernels are built with it.

The measuring itself needs a GPU: ``test_qconv_cuda.py`` builds tabled convs of both families
there and checks their sums against the default kernel's bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import tvm

from tvm_qconv.errors import InputError
from tvm_qconv.nn import conv_table, conv_tiles, tvm_kernels
from tvm_qconv.schedules.tensorcore import mma
from tvm_qconv.schedules.training import conv_choices
from tvm_qconv.schedules.workload import ConvWorkload

ARCH = "sm_90"
H200_SMS = 132
# VGG16's training convs at batch 32: a forward 3x3, a dx, a split-K dw and a linear layer's dw
WORKLOADS = [
    ConvWorkload(32, 256, 56, 56, 256, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), activation="none", act_min=-127,
                 out_dtype="int32"),
    ConvWorkload(32, 512, 14, 14, 512, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), activation="none", act_min=-127,
                 out_dtype="int32"),
    ConvWorkload(256, 32, 28, 28, 512, (28, 28), (1, 1), (1, 1, 1, 1), (1, 1), activation="none", act_min=-127,
                 out_dtype="int32", splits=4),
    ConvWorkload(1, 32, 1, 25088, 4096, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), activation="none", act_min=-127,
                 out_dtype="int32"),
]


def _gemm(wl):
    return conv_choices.gemm_extents(tvm_kernels._impl("forward", wl, tvm_kernels.target_of(ARCH)).compute(wl))


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(conv_table.TABLE_ENV, str(path))
    return path


def _row(wl, choice=None, ms=1.0, default_ms=1.0):
    return {"workload": wl.to_dict(), "describe": tvm_kernels.describe(wl), "gemm": list(_gemm(wl)),
            "default": {"choice": None, "ms": default_ms},
            "best": None if choice is None else {"choice": choice, "ms": ms}}


@pytest.mark.parametrize("wl", WORKLOADS, ids=["fwd", "fwd14", "dw_split", "linear_dw"])
def test_candidates_are_valid_distinct_tiles_and_include_the_default(wl):
    mp, op, k = _gemm(wl)
    cands = conv_choices.candidates(mp, op, k)
    assert len(cands) == len({json.dumps(c, sort_keys=True) for c in cands}) >= 1
    for c in cands:
        d, stages = c["tiles"], c["stages"]
        assert c["family"] == "mma"
        bm, bn = 16 * d["m"][1] * d["m"][2], 16 * d["o"][1] * d["o"][2]
        assert mp % bm == 0 and op % bn == 0 and d["m"][0] * bm == mp and d["o"][0] * bn == op
        assert d["m"][2] <= mma.MAX_FRAGS and d["o"][2] <= mma.MAX_FRAGS
        assert d["m"][1] * d["o"][1] <= 8                       # at most 256 threads a block
        assert d["k"][0] * d["k"][1] * 32 == k and d["k"][0] >= stages - 1
        assert mma.smem_bytes({**d, "stages": stages}) <= mma.DYN_SMEM_BUDGET
    assert conv_choices.mma_choice(*mma.default_decisions(mp, op, k, H200_SMS)) in cands


def test_wgmma_is_a_choice_for_the_convs_tma_can_gather_in_one_slice():
    fwd, fwd14, dw_split, linear_dw = WORKLOADS
    assert conv_choices.wgmma_choices(fwd)[0] == {"family": "wgmma", "config": {"bm": 128, "bn": 128, "stages": 6}}
    assert all(c["config"]["bn"] >= 64 for c in conv_choices.wgmma_choices(fwd14))
    assert conv_choices.wgmma_choices(dw_split)                # dw: split-K, 4 slices of 196 K steps
    first_layer_dw = ConvWorkload(64, 32, 224, 224, 64, (224, 224), (1, 1), (1, 1, 1, 1), (1, 1), activation="none",
                                  act_min=-127, out_dtype="int32", splits=14)
    assert conv_choices.wgmma_choices(first_layer_dw) == []    # 224 x 224 taps: past TMA's 127-pixel offsets
    assert conv_choices.wgmma_choices(linear_dw)               # FC1's dw, one slice: 25,088 rows of 1 x 1 taps
    assert conv_choices.wgmma_choices(dataclasses.replace(fwd, in_channels=8)) == []   # the mma family's floor
    assert conv_choices.build_arch(conv_choices.wgmma_choices(fwd)[0], "sm_90") == "sm_90a"
    assert conv_choices.build_arch(conv_choices.candidates(*_gemm(fwd))[0], "sm_90") == "sm_90"


def test_a_candidate_replaces_the_default_only_when_three_percent_faster():
    a, b = conv_choices.mma_choice({"m": [1, 2, 2]}, 3), conv_choices.mma_choice({"m": [2, 2, 1]}, 4)
    assert conv_tiles.choose(1.0, [(a, 0.98), (b, 0.99)]) is None          # within noise: the default stays
    assert conv_tiles.choose(1.0, [(a, 0.98), (b, 0.96)]) == (b, 0.96)      # the fastest, 4 % faster
    assert conv_tiles.choose(1.0, []) is None


def test_the_table_keeps_each_workloads_choice_and_rewrites_only_the_measured_ones(table):
    fast, kept = WORKLOADS[0], WORKLOADS[1]
    choice = conv_choices.candidates(*_gemm(fast))[-1]
    meta = {"arch": ARCH, "device": "test"}
    conv_table.merge_rows(str(table), [_row(fast, choice, ms=0.5), _row(kept)], meta)
    assert conv_table.lookup(fast, ARCH) == choice
    assert conv_table.lookup(kept, ARCH) is None                              # measured: the default stays
    assert conv_table.lookup(WORKLOADS[2], ARCH) is None                      # never measured
    conv_table.merge_rows(str(table), [_row(fast)], meta)                     # measured again: default now
    assert conv_table.lookup(fast, ARCH) is None
    assert len(json.loads(table.read_text())["layers"]) == 2


def test_the_committed_table_is_readable_and_every_choice_builds_for_its_conv():
    # tuning_logs/training-convs-sm_90.json (VGG16 b32 and b128, H200): each tabled choice still
    # schedules its conv (a template change that broke one would only warn at training time)
    path = conv_table.table_path(ARCH)
    table = conv_table.read_table(path)
    assert table["layers"] and table["arch"] == ARCH
    target = tvm_kernels.target_of(ARCH)
    for row in table["layers"]:
        if row["choice"] is None:
            continue
        wl = ConvWorkload.from_dict(row["workload"])
        func = tvm_kernels.registry.get(conv_choices.IMPL).compute(wl)
        assert conv_choices.schedule(func, row["choice"], target).attrs["tir.is_scheduled"], row["describe"]


def test_a_corrupt_table_is_refused_naming_the_file_and_the_fix(table):
    table.write_text('{"layers": [{"workload": {"batch": 1}}]}')
    with pytest.raises(InputError, match=re.escape(str(table)) + ".*delete it.*tune.py --training"):
        conv_table.lookup(WORKLOADS[0], ARCH)


def test_a_tabled_conv_is_built_with_its_tiles_under_its_own_cache_key(table):
    wl = WORKLOADS[1]
    target = tvm_kernels.target_of(ARCH)
    default_key = tvm_kernels.cache_path("forward", wl, ARCH)
    four_by_two = next(c for c in conv_choices.candidates(*_gemm(wl)) if c["tiles"]["m"][1] * c["tiles"]["o"][1] == 8)
    conv_table.merge_rows(str(table), [_row(wl, four_by_two, ms=0.5)], {"arch": ARCH})
    assert tvm_kernels.cache_key("forward", wl, ARCH)["choice"] == four_by_two
    assert tvm_kernels.cache_path("forward", wl, ARCH) != default_key
    assert "choice" not in tvm_kernels.cache_key("forward", WORKLOADS[0], ARCH)   # untabled: key as before

    def threads_y(func):     # the block's warps: threadIdx.y's extent
        return int(re.search(r'T\.thread_binding\((\d+), thread="threadIdx\.y"\)', func.script()).group(1))
    assert threads_y(tvm_kernels._definition("forward", wl, target, conv_table.lookup(wl, ARCH))) == 8
    assert threads_y(tvm_kernels._definition("forward", wl, target)) == 4      # the default's 2 x 2


def test_a_table_entry_the_template_no_longer_takes_warns_and_builds_the_default(table):
    wl = WORKLOADS[1]
    tiles = {"m": [1, 2, 4], "o": [1, 2, 4], "k": [1, 144]}                    # a K step of 4,608: no longer fits
    with pytest.warns(UserWarning, match="does not fit the kernels.*default tiles"):
        func = tvm_kernels._definition("forward", wl, tvm_kernels.target_of(ARCH), conv_choices.mma_choice(tiles, 2))
    assert func.attrs["tir.is_scheduled"]


@pytest.mark.parametrize("wl", [WORKLOADS[0], WORKLOADS[2]], ids=["fwd", "dw_split"])
def test_a_wgmma_choice_builds_hoppers_kernel_with_the_int32_epilogue_for_sm_90a(wl, tmp_path):
    # the training convs on wgmma: TMA-fed, warp-specialized, the accumulators stored as int32
    # pairs (no requantize, no staged int8 tile), a split reduction's slices each to its own
    # [S, ...] plane; compiled by nvcc for sm_90a without spills
    import shutil
    import subprocess
    from tvm_qconv.target import cuda_source
    choice = conv_choices.wgmma_choices(wl)[0]
    target = tvm_kernels.target_of(conv_choices.build_arch(choice, ARCH))
    func = tvm_kernels._definition("forward", wl, target, choice).with_attr("global_symbol", "k")
    out_shape = [int(d) for d in func.params[2].shape]
    assert len(func.params) == 3 and str(func.params[2].dtype) == "int32"
    assert out_shape[:1] == ([wl.splits] if wl.splits > 1 else [wl.batch])
    options = tvm_kernels.registry.compile_options([tvm_kernels.registry.get(conv_choices.IMPL)])
    with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        src = cuda_source(tvm.compile(tvm.IRModule({"k": func}), target=target, tir_pipeline=options["tir_pipeline"]))
    assert f"m64n{min(choice['config']['bn'], 128)}k32.s32.s8.s8" in src and ".im2col" in src
    assert "qconv_st_i2(" in src and "qconv_copy16(" not in src and "qconv_st_u16(" not in src
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine: the source checks above ran, the compile did not")
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    done = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"), str(cu), "-Xptxas", "-v",
                           "-diag-suppress", "177"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.findall(r"(\d+) bytes spill stores", done.stdout + done.stderr) == ["0"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start a real search")
def test_tune_training_without_a_gpu_says_where_to_run_it(capsys):
    import tune
    assert tune.main(["--training", "--model", "vgg16", "--batch", "2"]) != 0
    assert "measures on a CUDA GPU and none is visible" in capsys.readouterr().err


def test_tune_training_refuses_a_model_it_cannot_build():
    with pytest.raises(InputError, match="vgg16, resnet50.*'alexnet'"):
        conv_tiles.training_workloads("alexnet", 2, 32, torch.device("cpu"))


def test_a_split_k_dw_may_choose_its_split_count_on_wgmma(table):
    # the dw conv's split count was chosen for mma.sync's grid; the wgmma kernel's persistent grid
    # wants ~2 or ~4 tiles per SM (two consumers a CTA), so its choices may carry their own count
    from tvm_qconv.schedules.wgmma import conv2d as wgmma_conv2d
    dw = WORKLOADS[2]
    choices = conv_choices.wgmma_split_choices(dw, H200_SMS)
    resplit = [c for c in choices if "splits" in c]
    assert resplit and all(c["splits"] != dw.splits for c in resplit)
    for c in resplit:
        wl = conv_table.choice_workload(dw, c)
        assert wgmma_conv2d.supports(wl)
        tiles = wl.splits * wgmma_conv2d.tiles(wl, wgmma_conv2d.Config(**c["config"], staged_store=False))
        assert tiles >= 2 * H200_SMS
    # the table keys the conv without its count: the caller finds the choice, then runs its count
    chosen = resplit[0]
    conv_table.merge_rows(str(table), [_row(dw, chosen, ms=0.5)], {"arch": ARCH})
    assert conv_table.lookup(dw, ARCH) == chosen
    wl = conv_table.choice_workload(dw, conv_table.lookup(dw, ARCH))
    assert wl.splits == chosen["splits"] and conv_table.lookup(wl, ARCH) == chosen
    assert tvm_kernels._choice("forward", wl, ARCH) == chosen
    assert tvm_kernels._choice("forward", dw, ARCH) is None        # the old count: the default kernel
    assert conv_table.choice_workload(dw, None) is dw


def test_choices_build_as_one_library_and_a_bad_one_alone_leaves_the_others(tmp_path):
    # the search compiles a workload's choices 8 to a library (kernel c<index> each); a choice the
    # template refuses fails that library, and then each kernel is built alone: the others are kept
    wl = WORKLOADS[1]
    cands = conv_choices.candidates(*_gemm(wl))
    good = {0: None, 1: cands[1]}
    assert conv_tiles._build_group(wl, ARCH, good, str(tmp_path / "g.so")) == {0: None, 1: None}
    assert (tmp_path / "g.so").exists()
    bad = conv_choices.mma_choice({"m": [1, 2, 4], "o": [1, 2, 4], "k": [1, 144]}, 2)     # no longer fits
    errors = conv_tiles._build_group(wl, ARCH, {**good, 2: bad}, str(tmp_path / "h.so"))
    assert errors[0] is None and errors[1] is None and "InvalidDecisions" in errors[2]
    assert (tmp_path / "h.so.0.so").exists() and (tmp_path / "h.so.1.so").exists()
    assert not (tmp_path / "h.so").exists() and not (tmp_path / "h.so.2.so").exists()


def test_search_builds_checks_times_and_picks_per_workload(monkeypatch):
    # the search's plumbing, with the GPU parts replaced: three choices of one conv (the default,
    # a template tile, a wgmma tile) built for real in a worker process, then "run" by stand-ins:
    # the tile's kernel gives other sums (dropped, said), the wgmma one is 2x faster (picked)
    wl = WORKLOADS[1]
    monkeypatch.setattr(tvm_kernels, "device_target", lambda device: (tvm_kernels.target_of(ARCH), ARCH))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(conv_choices, "candidates", lambda mp, op, k: [conv_choices.mma_choice(
        {"m": [mp // 64, 2, 2], "o": [op // 64, 2, 2], "k": [k // 64, 2]}, 3)])
    wgmma = conv_choices.wgmma_choices(wl)[:1]
    monkeypatch.setattr(conv_choices, "wgmma_split_choices", lambda wl, num_sm: wgmma)
    built = {}

    def stand_ins(groups):
        for path, indices, future in groups:
            assert all(e is None for e in future.result().values())
            built[path] = indices
        return {0: lambda *a: a[-1].fill_(7), 1: lambda *a: a[-1].fill_(8), 2: lambda *a: a[-1].fill_(7)}
    monkeypatch.setattr(conv_tiles, "_kernels_of", stand_ins)
    times = iter([1.0, 0.5])          # the default, then wgmma (the tile is dropped before timing)
    rows = conv_tiles.search([wl], torch.device("cpu"), workers=2, timer=lambda fn: next(times))
    assert len(built) == 2 and sorted(map(len, built.values())) == [1, 2]      # sm_90: default + tile; sm_90a
    (row,) = rows
    assert [m["ms"] for m in row["measured"]] == [1.0, None, 0.5]
    assert row["best"] == {"choice": wgmma[0], "ms": 0.5} and row["default"]["ms"] == 1.0
    assert row["tops_best"] == pytest.approx(2 * row["tops_default"])


def test_a_dw_choice_of_one_slice_is_timed_with_an_output_without_the_slice_axis(monkeypatch):
    # VGG16's 256 -> 512 @28 dw: 4 slices by mma.sync's count, where one wgmma slice already gives
    # ~2 tiles per SM; that choice's kernel takes [C, KH', KW', O_p], not [1, C, KH', KW', O_p], and
    # its sums must equal the 4 slices' sum (the search once handed it the 5-d tensor and stopped)
    wl = ConvWorkload(256, 32, 28, 28, 512, (28, 28), (1, 1), (1, 1, 1, 1), (1, 1), activation="none",
                      act_min=-127, out_dtype="int32", splits=4)
    one = next(c for c in conv_choices.wgmma_split_choices(wl, H200_SMS) if c.get("splits") == 1)
    monkeypatch.setattr(tvm_kernels, "device_target", lambda device: (tvm_kernels.target_of(ARCH), ARCH))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(conv_choices, "candidates", lambda mp, op, k: [])
    monkeypatch.setattr(conv_choices, "wgmma_split_choices", lambda wl, num_sm: [one])

    def slices4(*a):
        assert a[-1].dim() == 5 and a[-1].shape[0] == 4
        a[-1].fill_(7)

    def slice1(*a):
        assert a[-1].dim() == 4
        a[-1].fill_(28)
    monkeypatch.setattr(conv_tiles, "_kernels_of", lambda groups: {0: slices4, 1: slice1})
    times = iter([1.0, 0.5])
    (row,) = conv_tiles.search([wl], torch.device("cpu"), workers=1, timer=lambda fn: (fn(), next(times))[1])
    assert [m["ms"] for m in row["measured"]] == [1.0, 0.5] and row["best"]["choice"] == one


def test_a_one_slice_conv_is_timed_as_the_kernel_alone(monkeypatch):
    # what is timed is what the step runs: a one-slice conv's kernel writing its int32 sums, not
    # also the int64 copy the bit check compares (a full pass of the output: it once added
    # ~0.7 ms to VGG16 b128's 128 -> 128 @112 forward, the same to every choice)
    wl = WORKLOADS[1]
    assert wl.splits == 1
    monkeypatch.setattr(tvm_kernels, "device_target", lambda device: (tvm_kernels.target_of(ARCH), ARCH))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))     # no wgmma choices
    monkeypatch.setattr(conv_choices, "candidates", lambda mp, op, k: [])
    monkeypatch.setattr(conv_tiles, "_kernels_of", lambda groups: {0: lambda *a: a[-1].fill_(7)})
    timed = []
    (row,) = conv_tiles.search([wl], torch.device("cpu"), workers=1, timer=lambda fn: (timed.append(fn()), 1.0)[1])
    assert timed[0].dtype == torch.int32 and bool((timed[0] == 7).all())
    assert row["default"]["ms"] == 1.0


def test_a_table_measured_on_another_arch_is_not_used(table):
    wl = WORKLOADS[0]
    choice = conv_choices.candidates(*_gemm(wl))[-1]
    conv_table.merge_rows(str(table), [_row(wl, choice, ms=0.5)], {"arch": "sm_80"})
    assert conv_table.lookup(wl, "sm_80") == choice and conv_table.lookup(wl, ARCH) is None


def test_the_registry_never_picks_wgmma_for_an_int32_conv_by_itself():
    # the training convs reach the wgmma kernel only as a measured choice: its tuning space and
    # records describe int8 layers
    from tvm_qconv import registry
    from tvm_qconv.target import TargetInfo
    sm90a = TargetInfo.from_target(tvm_kernels.target_of("sm_90a"))
    assert registry.select("conv2d", WORKLOADS[0], sm90a).name == conv_choices.IMPL
    assert registry.get("conv2d.nhwc32.wgmma").applies(dataclasses.replace(WORKLOADS[0], out_dtype="int8",
                                                                           activation="relu", act_min=0), sm90a)
