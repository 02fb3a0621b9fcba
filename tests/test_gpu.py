"""CUDA tests: run only where there is an NVIDIA GPU (marked ``gpu``; skipped elsewhere)."""
import numpy as np
import pytest
import torch
import tvm

from tests.test_kernels import CONV_IDS, CONV_WORKLOADS, conv_args, out_shape
from tests.workloads import conv_wl
from tvm_qconv import registry
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.models import SmallVGG
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.schedules.nchw4c.conv2d import conv2d_nchw4c_int8, conv2d_nchw4c_int8_ref
from tvm_qconv.schedules.nchw4c.dp4a import schedule_dp4a
from tvm_qconv.schedules.nchw4c.layout import pack_nchw4c, quantize_pack
from tvm_qconv.schedules.quantize import quantize_ref
from tvm_qconv.target import TargetInfo, cuda_source, device_arch, make_target

pytestmark = pytest.mark.gpu
ARCH = device_arch() or "sm_90"  # the GPU's own arch (the tests are skipped where there is none)

# VGG16 layer shapes at 224 and batch 1 that the default dp4a schedule must handle, besides the odd ones
VGG_SHAPES = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (256, 256, 56), (512, 512, 28), (512, 512, 14)]


@pytest.mark.parametrize("wl", CONV_WORKLOADS, ids=CONV_IDS)
def test_dp4a_conv_on_gpu_is_bit_exact(wl):
    target = make_target("cuda", ARCH)
    with target:
        lib = tvm.compile(tvm.IRModule({"main": schedule_dp4a(conv2d_nchw4c_int8(wl), target)}), target=target)
    assert "__dp4a" in cuda_source(lib)
    dev = tvm.cuda(0)
    args = conv_args(wl)
    out = tvm.runtime.tensor(np.full(out_shape(wl), 77, np.int8), dev)  # poisoned: every element must be written
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), conv2d_nchw4c_int8_ref(wl, *args))


@pytest.mark.parametrize("cin,cout,size", VGG_SHAPES, ids=[f"{a}to{b}@{s}" for a, b, s in VGG_SHAPES])
def test_dp4a_conv_on_gpu_vgg16_shapes(cin, cout, size):
    test_dp4a_conv_on_gpu_is_bit_exact(conv_wl(1, cin, size, size, cout))


def test_cuda_build_equals_cpu_build_on_a_whole_model(tmp_path):
    torch.manual_seed(0)
    model = SmallVGG().eval()
    x = np.random.default_rng(0).normal(0, 1, (8, 3, 32, 32)).astype(np.float32)
    outs, exposed = {}, {}
    for target in ("llvm", "cuda"):
        lib = compile_model(model, str(tmp_path / f"{target}.so"), config=QuantConfig(num_calib_images=8),
                            options=BuildOptions(target=target, arch=ARCH if target == "cuda" else None, batch=8,
                                                 image_size=32, expose_activations=True),
                            ranges=Calibrate(x), progress=False)
        outs[target] = CompiledModel(lib.lib_path).outputs(x)
        exposed[target] = lib.report["exposed"]
    # each activation in its library's layout (NCHW4c on the CPU; NHWC32 after the GPU's
    # tensor-core convs): compared as NCHW, integer for integer
    if TargetInfo.from_target(make_target("cuda", ARCH)).has_int8_mma:
        assert "NHWC32" in {e["layout"] for e in exposed["cuda"]}
    for e_cpu, e_gpu, a, b in zip(exposed["llvm"], exposed["cuda"], outs["llvm"][1:], outs["cuda"][1:]):
        np.testing.assert_array_equal(registry.layout(e_cpu["layout"]).unpack(a, e_cpu["channels"]),
                                      registry.layout(e_gpu["layout"]).unpack(b, e_gpu["channels"]))
    np.testing.assert_allclose(outs["llvm"][0], outs["cuda"][0], rtol=1e-5, atol=1e-5)  # float dense epilogue


def test_cuda_input_quantizer_rounds_ties_to_even_like_the_cpu_build():
    # Exact ties (digits' pixel levels at s = float32(1 / 127): -63.5, 63.5) and one ulp either
    # side of every k + 0.5: under TVM's --use_fast_math a float32 division would move some.
    from tvm import s_tir

    s = np.float32(1.0) / np.float32(127)
    near = (np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)) * s
    x = np.concatenate([np.nextafter(near, -np.inf), near, np.nextafter(near, np.inf),
                        (np.arange(17, dtype=np.float32) / 16 - 0.5) / 0.5]).astype(np.float32)
    x = np.resize(x, (2, 3, 16, 17))
    sch = s_tir.Schedule(quantize_pack(x.shape, float(s)))
    bx, tx = sch.split(sch.fuse(*sch.get_loops(sch.get_sblock("quantize_pack"))), [None, 128])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    target = make_target("cuda", ARCH)
    with target:
        lib = tvm.compile(sch.mod, target=target)
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full((2, 1, 16, 17, 4), 77, np.int8), dev)
    lib["main"](tvm.runtime.tensor(x, dev), out)
    np.testing.assert_array_equal(out.numpy(), pack_nchw4c(quantize_ref(x, s)))
