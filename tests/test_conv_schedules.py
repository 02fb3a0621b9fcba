"""Default schedules of the fused int8 conv kernel: llvm (``schedule_cpu``) and CUDA dp4a
(``schedule_dp4a``), against the NumPy reference ``conv2d_nchw4c_int8_ref``.

No GPU here, so the CUDA schedule is checked three ways: it builds to CUDA source that calls
``__dp4a`` (and nvcc compiles it, where nvcc exists); its *CPU twin* -- the very scheduled
PrimFunc with thread bindings turned into serial loops, shared/local scopes into global and
each ``__dp4a`` into its 4 multiply-adds -- is bit-exact on llvm, which checks the tiling,
padding, stride/dilation indexing and the tensorized region; and each thread's epilogue
covers exactly the accumulators that thread computed (a sequential twin cannot see a race on
another thread's registers).
"""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tvm
from tvm.script import parser as tvmscript

from tests.workloads import conv_wl as W
from tvm_qconv.schedules.nchw4c.conv2d import (conv2d_nchw4c_int8, conv2d_nchw4c_int8_ref, group_blocks,
                                               pack_channels, pack_input_groups, pack_oihw4o4i)
from tvm_qconv.schedules.nchw4c.cpu import schedule_cpu
from tvm_qconv.schedules.nchw4c.dp4a import schedule_dp4a
from tvm_qconv.schedules.requantize import quantize_multiplier
from tvm_qconv.target import cuda_source

CUDA_TARGET = tvm.target.Target(
    {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
     "max_shared_memory_per_block": 49152, "thread_warp_size": 32}, host="llvm")
LLVM_TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})

# Shapes chosen so tiles do not divide them: odd channel counts (padded to 4), odd and prime
# spatial sizes, stride / dilation / asymmetric padding, 1x1 and 7x7 kernels, ReLU on and off.
WORKLOADS = [
    W(1, 6, 9, 7, 10, stride=(2, 1), dilation=(1, 2)),
    W(1, 6, 9, 7, 10, stride=(2, 1), dilation=(1, 2), relu=False),
    W(2, 3, 17, 17, 8, (7, 7), (2, 2), (3, 3, 3, 3)),
    W(1, 16, 14, 14, 32, (1, 1), padding=(0, 0, 0, 0)),
    W(2, 32, 15, 15, 16, (1, 1), (2, 2), (0, 0, 0, 0), relu=False),
    W(1, 20, 13, 11, 36, stride=(2, 2)),
    W(1, 12, 10, 9, 8, padding=(0, 1, 2, 1)),
    W(1, 8, 7, 113, 12),                       # prime width > the CPU ow tile: predicated tile
    W(1, 64, 28, 28, 64, relu=False),
    W(1, 4, 1, 1, 4, (1, 1), padding=(0, 0, 0, 0)),  # one word in, one out: single-vector copies
    W(2, 32, 9, 9, 64, groups=4),              # ResNeXt-like groups of 8 -> 16 channels
    W(1, 6, 7, 7, 9, groups=3, relu=False),    # groups of 2 -> 3 channels, each padded to 4 on its own
]
WORKLOAD_IDS = [
    "odd_6to10_9x7_s2x1_d1x2", "odd_6to10_9x7_s2x1_d1x2_norelu", "stem_3to8_7x7s2p3_17x17_b2",
    "1x1_16to32_14", "1x1s2_32to16_15_b2_norelu", "3x3s2_20to36_13x11", "3x3_asym_pad_12to8_10x9",
    "3x3_8to12_7x113", "3x3_64to64_28_norelu", "1x1_4to4_1x1", "groups4_32to64_9x9_b2",
    "groups3_6to9_7x7_padded_norelu",
]
# For the dp4a twin, add workloads whose plan uses every register / thread / rc split.
DP4A_WORKLOADS = WORKLOADS + [
    W(48, 64, 14, 14, 64),   # 4 oc blocks x 2 rows per thread, 2 oc threads, 2 rc tiles
    W(4, 256, 8, 8, 64),     # 1 oc block per thread, 2 rc tiles of 32
]
DP4A_IDS = WORKLOAD_IDS + ["3x3_64to64_14_b48", "3x3_256to64_8_b4"]


def _random_args(wl: W, seed: int = 0):
    """Random int8 data/weights, int32 bias and realistic requant multipliers, packed."""
    rng = np.random.default_rng(seed)
    g = wl.groups
    a = rng.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width), dtype=np.int8)
    w = rng.integers(-128, 128, (wl.out_channels, wl.group_in) + tuple(wl.kernel), dtype=np.int8)
    bias = rng.integers(-2 ** 15, 2 ** 15, wl.out_channels).astype(np.int32)
    mult, shift = quantize_multiplier(rng.uniform(1e-4, 1e-2, wl.out_channels))
    return (pack_input_groups(a, g), pack_oihw4o4i(w, g), pack_channels(bias, groups=g),
            pack_channels(mult, groups=g), pack_channels(shift, fill=1, groups=g))


def _run_llvm(func, wl: W, args) -> np.ndarray:
    ex = tvm.compile(tvm.IRModule({"main": func}), target=LLVM_TARGET)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((wl.batch, wl.groups * group_blocks(wl)[1], wl.out_height,
                                       wl.out_width, 4), np.int8), dev)
    ex["main"](*[tvm.runtime.tensor(x, dev) for x in args], out)
    return out.numpy()


_DP4A_CALL = re.compile(
    r'T\.call_pure_extern\("int32", "__dp4a", (\w+)\[T\.Ramp\(0, 1, 4\)\], (\w+)\[T\.Ramp\(0, 1, 4\)\], 0\)')


def _cpu_twin(func):
    """The scheduled CUDA PrimFunc made runnable on llvm, loop structure unchanged."""
    text = func.script()
    text, n_bind = re.subn(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"range(\1)", text)
    text, n_dp4a = _DP4A_CALL.subn(lambda m: "(" + " + ".join(
        f'T.Cast("int32", {m[1]}[{i}]) * T.Cast("int32", {m[2]}[{i}])' for i in range(4)) + ")", text)
    text = text.replace('scope="shared"', 'scope="global"').replace('scope="local"', 'scope="global"')
    assert n_bind > 0 and n_dp4a == 1, (n_bind, n_dp4a)
    return tvmscript.parse(text)


def _per_thread_instances(sch, block_name: str) -> int:
    """How many instances of a block one thread runs: product of its loops under threadIdx.x."""
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(block_name))]
    tx = [i for i, lp in enumerate(loops)
          if lp.thread_binding is not None and lp.thread_binding.thread_tag == "threadIdx.x"][-1]
    return int(np.prod([int(lp.extent) for lp in loops[tx + 1:]]))


def _cuda_source(func) -> str:
    return cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=CUDA_TARGET))


@pytest.mark.parametrize("wl", WORKLOADS, ids=WORKLOAD_IDS)
def test_cpu_schedule_is_bit_exact_against_numpy_reference(wl):
    args = _random_args(wl)
    func = schedule_cpu(conv2d_nchw4c_int8(wl))
    assert func.attrs["tir.is_scheduled"]
    np.testing.assert_array_equal(_run_llvm(func, wl, args), conv2d_nchw4c_int8_ref(wl, *args))


def test_cpu_schedule_parallelizes_rows_and_vectorizes_32_output_channels():
    text = schedule_cpu(conv2d_nchw4c_int8(W(2, 64, 28, 28, 64))).script()
    assert "T.parallel(112)" in text  # n * (16 oc blocks / 8) * 28 rows
    assert "T.vectorized(32)" in text  # 8 oc blocks x 4 channels


@pytest.mark.parametrize("wl", DP4A_WORKLOADS, ids=DP4A_IDS)
def test_dp4a_schedule_cpu_twin_is_bit_exact(wl):
    args = _random_args(wl, seed=1)
    func = schedule_dp4a(conv2d_nchw4c_int8(wl), CUDA_TARGET)
    assert func.attrs["tir.is_scheduled"]
    np.testing.assert_array_equal(_run_llvm(_cpu_twin(func), wl, args), conv2d_nchw4c_int8_ref(wl, *args))


@pytest.mark.parametrize("wl", DP4A_WORKLOADS, ids=DP4A_IDS)
def test_dp4a_epilogue_reads_only_the_threads_own_accumulators(wl):
    sch = tvm.s_tir.Schedule(schedule_dp4a(conv2d_nchw4c_int8(wl), CUDA_TARGET))
    # conv_init zeroes exactly the thread's accumulators (oc blocks x rows x 4 lanes)
    assert _per_thread_instances(sch, "requant") == _per_thread_instances(sch, "conv_init")


_BUILD = [0, 2, 3, 9, 10]  # odd shape, 7x7 stride-2 stem, 1x1, single word, big register tile


@pytest.mark.parametrize("wl", [DP4A_WORKLOADS[i] for i in _BUILD], ids=[DP4A_IDS[i] for i in _BUILD])
def test_dp4a_schedule_builds_cuda_source_calling_dp4a(wl):
    src = _cuda_source(schedule_dp4a(conv2d_nchw4c_int8(wl), CUDA_TARGET))
    body = src[src.index("__global__"):]
    assert "__dp4a(" in body and "__shared__" in body
    bounds = re.search(r"__launch_bounds__\((\d+)\)", body)  # absent for a 1-thread block
    assert 1 <= (int(bounds[1]) if bounds else 1) <= 1024
    smem = sum(int(n) * (4 if t == "int" else 1) for t, n in
               re.findall(r"__shared__ alignas\(\d+\) (int|signed char) \w+\[(\d+)\]", body))
    assert 0 < smem <= 48 * 1024


# ResNeXt-50's and RegNetX-400MF's grouped 3x3 convs at batch 1 (32 groups of 32 channels, 25
# of 16): their default blocks once took part of a group over several threads, and TVM sized the
# shared input tile for every group (241 KB and 93 KB: ptxas refused the library).
_GROUPED_B1 = [W(1, 1024, 14, 14, 1024, stride=(2, 2), groups=32), W(1, 1024, 7, 7, 1024, groups=32),
               W(1, 400, 14, 14, 400, stride=(2, 2), groups=25), W(1, 400, 7, 7, 400, groups=25)]


@pytest.mark.parametrize("wl", _GROUPED_B1, ids=["resnext_1024_s2", "resnext_1024", "regnet_400_s2", "regnet_400"])
def test_dp4a_default_of_a_grouped_conv_stays_in_static_shared_memory(wl):
    body = _cuda_source(schedule_dp4a(conv2d_nchw4c_int8(wl), CUDA_TARGET))
    smem = sum(int(n) * (4 if t == "int" else 1) for t, n in
               re.findall(r"__shared__ alignas\(\d+\) (int|signed char) \w+\[(\d+)\]", body))
    assert 0 < smem <= 48 * 1024  # CUDA's static shared memory per block


def test_dp4a_cuda_source_compiles_with_nvcc():
    src = _cuda_source(schedule_dp4a(conv2d_nchw4c_int8(DP4A_WORKLOADS[-2]), CUDA_TARGET))
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: CUDA source built, not compiled")
    from tvm.support import nvcc

    with CUDA_TARGET:
        cubin = nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    assert bytes(cubin[:4]) == b"\x7fELF"
