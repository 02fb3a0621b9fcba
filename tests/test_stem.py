"""The stem conv (``schedules/stem/``): a first conv of 1-4 input channels on mma.sync, NCHW4c in,
NHWC32 out.  On CPU: which layers it takes, its weight packing, its compute definition and
reference against NumPy and against the tensor-core family's reference, its CUDA code.  On a GPU
with int8 tensor cores (marked ``gpu``): the kernel bit-exact against NumPy."""
import shutil
import subprocess

import numpy as np
import pytest
import tvm

from tests.workloads import conv_wl, random_conv_args, slow_requantize_args
from tvm_qconv import registry
from tvm_qconv.schedules.nchw4c.layout import LAYOUT as NCHW4C
from tvm_qconv.schedules.stem import conv2d as stem
from tvm_qconv.schedules.tensorcore import conv2d as tc
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32
from tvm_qconv.schedules.workload import ConvWorkload
from tvm_qconv.target import TargetInfo, cuda_source, device_arch, make_target

IMPL = registry.get("conv2d.nhwc32.stem")
SM90 = make_target("cuda", "sm_90")

# (workload, what it covers); small maps: the CPU runs the compute definition
WORKLOADS = [
    (conv_wl(2, 3, 9, 11, 64), "vgg_3x3_odd_map"),
    (conv_wl(1, 3, 17, 15, 64, kernel=(7, 7), stride=(2, 2), padding=(3, 3, 3, 3)), "resnet_7x7_s2"),
    (conv_wl(1, 3, 23, 23, 64, kernel=(11, 11), stride=(4, 4), padding=(2, 2, 2, 2)), "alexnet_11x11_s4"),
    (conv_wl(2, 1, 8, 9, 40), "one_channel_40_out"),
    (conv_wl(1, 4, 10, 7, 96, dilation=(2, 2), padding=(2, 2, 2, 2)), "four_channels_dilated"),
    (conv_wl(1, 3, 9, 10, 32, stride=(2, 1), padding=(1, 2, 0, 1)), "asymmetric_padding"),
    (ConvWorkload.with_activation("clip", 0, 96, batch=2, in_channels=3, height=8, width=8, out_channels=48),
     "relu6_clip"),
]
IDS = [i for _, i in WORKLOADS]
WLS = [w for w, _ in WORKLOADS]


def test_registry_takes_the_stem_where_tensor_cores_take_the_next_layer():
    pick = lambda arch, w: registry.select("conv2d", w, TargetInfo.from_target(make_target("cuda", arch))).name
    wl = conv_wl(1, 3, 224, 224, 64)
    assert pick("sm_80", wl) == pick("sm_90", wl) == pick("sm_90a", wl) == "conv2d.nhwc32.stem"
    assert pick("sm_75", wl) == "conv2d.nchw4c.dp4a"                    # no int8 mma: NCHW4c throughout
    assert pick("sm_90", conv_wl(1, 3, 32, 32, 8)) == "conv2d.nchw4c.dp4a"   # 8 channels out: dp4a next
    assert pick("sm_90", conv_wl(1, 8, 32, 32, 64)) == "conv2d.nchw4c.dp4a"  # 8 in: not a stem
    assert not stem.supports(conv_wl(1, 4, 32, 32, 64, groups=2))
    assert IMPL.input_layout() == "NCHW4c" and IMPL.layout == "NHWC32"


def test_weights_too_big_for_shared_memory_are_not_a_stem():
    # 11x11 = 121 taps, padded to 16 K steps of 8: 128 taps x 128 channels x 4 bytes = 64 KB > 48 KB
    # of static shared memory (64 channels: 32 KB)
    assert stem.supports(conv_wl(1, 3, 64, 64, 64, kernel=(11, 11), padding=(5, 5, 5, 5)))
    assert not stem.supports(conv_wl(1, 3, 64, 64, 128, kernel=(11, 11), padding=(5, 5, 5, 5)))


def test_weight_packing_round_trips_in_mma_fragment_order():
    w = np.random.default_rng(0).integers(-127, 128, (40, 3, 7, 5)).astype(np.int8)
    packed = stem.pack_weight(w)
    # 35 taps -> 5 K steps of 8; O_p = 64 -> one warp tile of 64 channels = 8 n8 tiles; 32 lanes
    # x 2 registers of 4 bytes
    assert packed.shape == (5, 1, 8, 32, 2, 4) and packed.dtype == np.int8
    assert np.array_equal(stem.unpack_weight(packed, 40, 3, (7, 5)), w)
    # K step 2, n8 tile 3, lane g*4 + t = 5*4 + 2, register 1: tap 8*2 + t + 4 = 22 = (4, 2) and
    # B column g = 5, which is channel (g // 2) * 16 + 2 * 3 + g % 2 = 39
    assert np.array_equal(packed[2, 0, 3, 5 * 4 + 2, 1, :3], w[39, :, 4, 2])
    assert not packed[..., 3].any()                                       # the 4th input channel: 0
    assert not packed[4, 0, :, :, 1].any()                                # taps 36-39 do not exist
    # 96 channels are three tiles of 32 (4 n8 tiles): a lane's columns cover 8 channels per row
    assert stem.pack_weight(np.ones((96, 3, 3, 3), np.int8)).shape == (2, 3, 4, 32, 2, 4)


@pytest.mark.parametrize("wl", WLS, ids=IDS)
def test_compute_and_reference_are_bit_exact_and_match_the_tensor_core_family(wl):
    x, w, bias, mult, shift = random_conv_args(wl)
    args = [NCHW4C.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)
    ref = IMPL.reference(wl, *args)
    assert ref.shape == IMPL.out_shape(wl)
    assert 0.05 < (ref != 0).mean() and wl.act_min <= ref.min() and ref.max() <= wl.act_max  # not all clamped
    # the tensor-core family's reference of the same conv: the same integers, so a stem and
    # the mma / wgmma layers after it give the dp4a build's activations bit for bit
    mma = tc.conv2d_nhwc_int8_ref(wl, NHWC32.pack(x), tc.pack_weight(w), *IMPL.pack_params(wl, w, bias, mult, shift)[1:])
    np.testing.assert_array_equal(ref, mma)
    lib = tvm.compile(tvm.IRModule({"main": IMPL.compute(wl)}), target="llvm")
    out = tvm.runtime.tensor(np.full(ref.shape, 77, np.int8))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), ref)


@pytest.mark.parametrize("wl", WLS[:3], ids=IDS[:3])
def test_cuda_code_is_mma_with_16_byte_stores(wl):
    src = cuda_source(registry.compile_kernel(IMPL, wl, SM90))
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in src and "*(uint4*)" in src
    assert "__dp4a" not in src


def test_cuda_code_of_32_channel_tiles_stores_8_bytes():
    src = cuda_source(registry.compile_kernel(IMPL, conv_wl(1, 3, 32, 32, 96), SM90))
    assert "*(uint2*)" in src and "*(uint4*)" not in src


def test_cuda_code_compiles_without_spills(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: CUDA source built, not compiled")
    for i, wl in enumerate((conv_wl(64, 3, 224, 224, 64),
                            conv_wl(64, 3, 224, 224, 64, kernel=(7, 7), stride=(2, 2), padding=(3, 3, 3, 3)))):
        cu = tmp_path / f"k{i}.cu"
        cu.write_text(cuda_source(registry.compile_kernel(IMPL, wl, SM90)))
        done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"k{i}.cubin"), str(cu),
                               "-Xptxas", "-v"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        # the 64 accumulators and the fragments stay in registers: a spill would be >= 4 bytes
        assert " 0 bytes spill stores" in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]


# ----------------------------------------------------------------------------- on the GPU

GPU_WLS = WLS + [conv_wl(8, 3, 224, 224, 64), conv_wl(4, 3, 224, 224, 64, kernel=(7, 7), stride=(2, 2),
                                                         padding=(3, 3, 3, 3))]
GPU_IDS = IDS + ["vgg16_224px_b8", "resnet_224px_b4"]


@pytest.mark.gpu
@pytest.mark.parametrize("wl", GPU_WLS, ids=GPU_IDS)
def test_stem_kernel_on_gpu_is_bit_exact(wl):
    arch = device_arch()
    if int(arch[3:]) < 80:
        pytest.skip(f"the stem conv feeds int8 tensor cores (sm_80+), this GPU is {arch}")
    lib = registry.compile_kernel(IMPL, wl, make_target("cuda", arch))
    dev = tvm.cuda(0)
    x, w, bias, mult, shift = random_conv_args(wl, seed=1)
    args = [NCHW4C.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)
    out = tvm.runtime.tensor(np.full(IMPL.out_shape(wl), 77, np.int8), dev)  # poisoned
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), IMPL.reference(wl, *args))


@pytest.mark.gpu
@pytest.mark.parametrize("wl", [conv_wl(2, 3, 32, 32, 64), conv_wl(2, 3, 40, 40, 96, kernel=(7, 7), stride=(2, 2),
                                                                  padding=(3, 3, 3, 3))], ids=["3x3_64", "7x7_96"])
def test_stem_kernel_keeps_the_64_bit_requantize_where_a_channel_needs_it(wl):
    # the kernel takes the 32-bit requantize only when every channel's shift is >= 33 (and bias
    # within 2**30); here half are not, so it must take the 64-bit form, still bit-exact
    arch = device_arch()
    if int(arch[3:]) < 80:
        pytest.skip(f"the stem conv feeds int8 tensor cores (sm_80+), this GPU is {arch}")
    lib = registry.compile_kernel(IMPL, wl, make_target("cuda", arch))
    dev = tvm.cuda(0)
    x, w, bias, mult, shift = slow_requantize_args(wl)
    args = [NCHW4C.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)
    out = tvm.runtime.tensor(np.full(IMPL.out_shape(wl), 77, np.int8), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    ref = IMPL.reference(wl, *args)
    assert 0.2 < (np.abs(ref.astype(int)) < 127).mean()           # not all clipped
    np.testing.assert_array_equal(out.numpy(), ref)
