"""The tensor-core family (``schedules/tensorcore/``) on CPU: compute definition bit-exact against
NumPy on llvm, the template's CUDA code (mma.sync, ldmatrix, cp.async), the NHWC32 layout and its
kernels, the search space.  On the GPU: the same kernels bit-exact (marked ``gpu``)."""
import itertools
import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

from tests.workloads import conv_wl, random_conv_args
from tvm_qconv import registry
from tvm_qconv.schedules.nchw4c.layout import LAYOUT as NCHW4C
from tvm_qconv.schedules.relayout import relayout_int8
from tvm_qconv.schedules.tensorcore import conv2d, mma, pipeline
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32
from tvm_qconv.schedules.dense_int8 import DenseWorkload
from tvm_qconv.schedules.workload import AddWorkload, ConvWorkload, PoolWorkload
from tvm_qconv.schedules.quantize import quantize_ref
from tvm_qconv.target import TargetInfo, cuda_source, device_arch, make_target

RNG = np.random.default_rng(0)
SM90 = make_target("cuda", "sm_90")
IMPL = registry.get("conv2d.nhwc32.mma")

# Channels and sizes that divide no tile: C padded to 32 (20, 40), O = 40, M not a multiple of 128
# (7x7, 9x11), stride 2, 1x1, 5x5, dilation 2, asymmetric padding, no ReLU, a clip.
WORKLOADS = [
    conv_wl(2, 20, 7, 7, 40),
    conv_wl(1, 40, 9, 11, 64, padding=(1, 2, 1, 0), relu=False),
    conv_wl(2, 16, 14, 14, 32, stride=(2, 2)),
    conv_wl(1, 64, 7, 7, 40, kernel=(1, 1), padding=(0, 0, 0, 0)),
    conv_wl(1, 32, 12, 12, 32, dilation=(2, 2), padding=(2, 2, 2, 2)),
    conv_wl(3, 24, 7, 7, 96, kernel=(5, 5), padding=(2, 2, 2, 2)),
    ConvWorkload.with_activation("clip", 0, 80, batch=1, in_channels=32, height=8, width=8, out_channels=32),
    # an unsigned input (zero point -128): the gather's padding is -128 (the copy's fill word)
    ConvWorkload.with_activation("relu", batch=2, in_channels=40, height=9, width=11, out_channels=64,
                                 padding=(1, 2, 1, 0), stride=(2, 1), in_zero=-128),
]
IDS = ["20to40_7x7_b2", "40to64_asym_pad_norelu", "s2_b2", "1x1_40out", "dilation2", "5x5_b3", "clip_0_80",
       "u8_asym_pad_s2"]

# Taps that read the padding at every output pixel: the pipeline's prologue, unrolled at a constant
# k, then stores the padding value as one int8x16 constant, which TVM prints as a make_int4 of 16
# bytes (pipeline.printable_int8_vectors).  A 3x3 conv (padding 1) on a 1-pixel-high map;
# deeplabv3's ASPP 3x3 at dilation >= the map (36 on its 32x32 map at 512 px, 8 on 8x8 here); an
# unsigned input, whose padding is -128.
ALL_PADDING_TAPS = [
    conv_wl(1, 32, 1, 1, 32),
    conv_wl(1, 64, 8, 8, 40, dilation=(8, 8), padding=(8, 8, 8, 8)),
    ConvWorkload.with_activation("relu", batch=2, in_channels=32, height=1, width=5, out_channels=32, in_zero=-128),
]
ALL_PADDING_IDS = ["3x3_on_1x1", "aspp_d8_on_8x8", "u8_3x3_on_1x5"]


def args_of(wl, seed=0):
    x, w, bias, mult, shift = random_conv_args(wl, seed)
    return [NHWC32.pack(x)] + IMPL.pack_params(wl, w, bias, mult, shift)


def out_shape(wl):
    return IMPL.out_shape(wl)


def run_llvm(func, args, shape, dtype="int8"):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.full(shape, 77, dtype))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


def test_the_gather_of_an_unsigned_input_fills_its_padding_with_minus_128():
    # the predicated copy stores 0x80808080 (four -128s) where a tap falls in the padding; the
    # marker carrying that word is gone from the CUDA source (left there, it would not compile)
    src = cuda_source(registry.compile_kernel(IMPL, WORKLOADS[-1], SM90))
    calls = re.findall(r"qconv_cp_async_ca_pred_16\(buf[^;]*;", src)
    assert calls and all(c.rstrip(");").endswith("-2139062144") for c in calls)
    assert "qconv_pred_fill" not in src
    symmetric = cuda_source(registry.compile_kernel(IMPL, WORKLOADS[0], SM90))
    assert all(c.rstrip(");").endswith(" 0") for c in re.findall(r"qconv_cp_async_ca_pred_16\(buf[^;]*;", symmetric))


@pytest.mark.parametrize("wl", WORKLOADS + ALL_PADDING_TAPS, ids=IDS + ALL_PADDING_IDS)
def test_compute_definition_is_bit_exact_against_numpy(wl):
    args = args_of(wl)
    ref = IMPL.reference(wl, *args)
    assert 0.05 < (ref != 0).mean() and wl.act_min <= ref.min() and ref.max() <= wl.act_max
    np.testing.assert_array_equal(run_llvm(IMPL.compute(wl), args, out_shape(wl)), ref)
    assert not ref[..., wl.out_channels:].any()  # padded output channels are 0: the next layer reads them


def test_reference_equals_a_float64_convolution():
    import torch
    wl = WORKLOADS[1]
    x = RNG.integers(-128, 128, (1, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = RNG.integers(-127, 128, (wl.out_channels, wl.in_channels, 3, 3)).astype(np.int8)
    one = np.full(wl.out_channels, 1 << 30, np.int32)  # mult 2**30, shift 30: the identity
    got = IMPL.reference(wl, NHWC32.pack(x), *IMPL.pack_params(wl, w, np.zeros_like(one), one, one * 0 + 30))
    pt, pl, pb, pr = wl.padding
    acc = torch.nn.functional.conv2d(torch.from_numpy(np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr))).astype(np.float64)),
                                     torch.from_numpy(w.astype(np.float64))).numpy()
    np.testing.assert_array_equal(NHWC32.unpack(got, wl.out_channels), np.clip(acc, wl.act_min, wl.act_max))


def _cuda(func) -> str:
    options = pipeline.compile_options()
    with SM90, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        return cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=SM90, tir_pipeline=options["tir_pipeline"]))


def _nvcc_errors(src: str, tmp_path) -> str | None:
    """nvcc's errors on ``src`` for sm_90 (None: it compiles); skips where nvcc is missing."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: CUDA source built, not compiled")
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(cu),
                           "-diag-suppress", "177"], capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr[-2000:]


def test_8_bit_vector_constants_are_stored_as_32_bit_words(tmp_path):
    # TVM prints an 8-bit broadcast of 8 or 16 lanes as make_int2 / make_int4 (make_uint4) of one
    # argument per byte; the pipeline's last pass repeats the byte in words instead, for any value
    from tvm.script import tirx as T

    @T.prim_func
    def fill(a: T.Buffer((64,), "int8"), b: T.Buffer((64,), "uint8"), x: T.int8):
        for t in T.thread_binding(2, thread="threadIdx.x"):
            a[t * 32:t * 32 + 16] = T.Broadcast(T.int8(-128), 16)
            a[t * 32 + 16:t * 32 + 24] = T.Broadcast(x, 8)
            b[t * 32:t * 32 + 16] = T.Broadcast(T.uint8(200), 16)

    src = _cuda(fill)
    assert "qconv_splat_int8x16(-128)" in src and "qconv_splat_uint8x16(200)" in src
    assert re.search(r"qconv_splat_int8x8\(\(\(int\)x\)\)", src)
    assert not re.search(r"make_u?int[24]\(\((signed char|uchar)\)", src)
    assert _nvcc_errors(src, tmp_path) is None


@pytest.mark.parametrize("wl", ALL_PADDING_TAPS, ids=ALL_PADDING_IDS)
def test_a_gather_wholly_in_the_padding_compiles_with_nvcc(wl, tmp_path):
    src = cuda_source(registry.compile_kernel(IMPL, wl, SM90))
    # the prologue's folded copies store the padding byte through the splat helper ...
    fill = re.findall(r"= qconv_splat_int8x16\((-?\d+)\);", src)
    assert fill and set(fill) == {str(wl.in_zero)}
    # ... and no 8-bit vector constant is left as make_int2 / make_int4 of one argument per byte
    assert not re.search(r"make_u?int[24]\(\((signed char|uchar)\)", src)
    assert _nvcc_errors(src, tmp_path) is None


def _assert_tensor_core_code(src: str) -> None:
    body = src[src.index("__global__"):]
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in body
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body
    # the PTX sits in helpers the kernel calls: weights through L2 only (cp.async.cg), the
    # predicated im2col gather through L1 (cp.async.ca: the taps re-read its rows)
    assert "cp_async_legacy_cg_16" in body and "cp.async.cg.shared.global" in src
    assert "qconv_cp_async_ca_pred_16" in body and "@p cp.async.ca.shared.global" in src
    assert "cp_async_legacy_pred_cg_16" not in body
    assert "__shfl_sync" not in body  # the epilogue reads each lane's own accumulators


def _main_loop_order(src: str) -> list[str]:
    """The ldmatrix / mma sequence of the k0 loop's body (the steady state of the pipeline)."""
    body = src[src.index("for (int k_0_0 = 0;"):]
    body = body[: body.index("cp_async_wait_group", body.index("mma.sync"))]
    return re.findall(r"ldmatrix\.sync|mma\.sync", body)


LAYERS = [conv_wl(1, 64, 56, 56, 64), conv_wl(8, 256, 28, 28, 256), conv_wl(1, 512, 14, 14, 512)]


@pytest.mark.parametrize("wl", LAYERS, ids=["64@56_b1", "256@28_b8", "512@14_b1"])
def test_default_schedule_runs_on_tensor_cores(wl):
    func = IMPL.schedule(IMPL.compute(wl), SM90)
    assert func.attrs["tir.is_scheduled"]
    _assert_tensor_core_code(_cuda(func))


def test_ldmatrix_of_the_next_k_step_is_issued_before_the_mma_of_this_one():
    # 256->256 @28, batch 8: 128 x 128 block tile, 2 x 2 warps of 4 x 4 fragments, BK = 128 (4 k1
    # steps): each k1 step loads 4 A + 4 B fragments (one ldmatrix.x4 each) and issues 4 x 4 x 2
    # mma.sync; the k1 pipeline loads step k1 + 1's fragments before step k1's mma
    wl = conv_wl(8, 256, 28, 28, 256)
    m, mp, op, k = conv2d.gemm_shape(wl)
    assert mma.default_decisions(mp, op, k, 132) == ({"m": [mp // 128, 2, 4], "o": [2, 2, 4], "k": [18, 4]}, 2)
    order = _main_loop_order(_cuda(IMPL.schedule(IMPL.compute(wl), SM90)))
    runs = [(name, len(list(group))) for name, group in itertools.groupby(order)]
    # steps 0 and 1 loaded, step 0 computed, step 2 loaded, step 1 computed, step 3 loaded,
    # steps 2 and 3 computed: unrolled, so every fragment index is a constant (registers)
    assert runs == [("ldmatrix.sync", 16), ("mma.sync", 32), ("ldmatrix.sync", 8), ("mma.sync", 32),
                    ("ldmatrix.sync", 8), ("mma.sync", 64)]


@pytest.mark.parametrize("kt, want", [
    (72, (4, 2)),   # 512->512 3x3: BK = 128 (18 K steps) with 2 stages: measured the faster
    (18, (2, 4)),   # 64-channel 3x3: 4 does not divide 18 -> BK = 64 with 4 stages
    (8, (4, 2)),    # 256-channel 1x1: 2 K steps of 128; 3 stages would need 110 KB
    (2, (2, 2)),    # 64-channel 1x1: one K step of 64 (a 2-deep pipeline needs >= 1 step)
])
def test_k_tile_is_the_largest_then_the_pipeline_the_deepest_that_fits(kt, want):
    assert mma._k_choice(kt, 128, 128) == want


def test_template_samples_are_tensor_core_kernels_that_fit_the_gpu():
    """Random points of the search space: sampled tiles, each checked by the space's postprocessors
    (VerifyGPUCode against the 96 KB dynamic shared memory budget) and compiled."""
    wl = conv_wl(2, 128, 28, 28, 128)
    func = IMPL.compute(wl)
    target = IMPL.tuning_target(SM90)
    ctx = ms.TuneContext(mod=func, target=target, task_name="t", rand_state=3,
                         space_generator=IMPL.space_generator("template", func, target))
    (sketch,) = ctx.generate_design_space()
    valid = 0
    for i in range(8):
        sch = tvm.s_tir.Schedule(ctx.mod, seed=11 + i)
        tvm.s_tir.schedule.Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        if all(p.apply(sch) for p in ctx.space_generator.postprocs):
            valid += 1
            if valid <= 2:  # compiling is the slow part: two suffice to check the code
                _assert_tensor_core_code(_cuda(sch.mod["main"]))
    assert valid >= 4  # most samples fit (the rest: too much shared memory for their pipeline)


def test_default_is_a_point_of_the_space():
    wl = conv_wl(1, 64, 56, 56, 64)
    sch = tvm.s_tir.Schedule(conv2d.conv2d_nhwc_int8(wl))
    IMPL.seed(sch, SM90)
    decisions = [[int(x) for x in d] if hasattr(d, "__len__") else int(d) for d in sch.trace.decisions.values()]
    m, mp, op, k = conv2d.gemm_shape(wl)
    default, _ = mma.default_decisions(mp, op, k, TargetInfo.from_target(SM90).num_sm)
    assert default["k"] in decisions and default["m"][1:] in decisions and default["o"][1:] in decisions


def test_nhwc32_layout_round_trips_and_converts_to_nchw4c():
    x = RNG.normal(0, 1, (2, 37, 5, 3)).astype(np.float32)
    q = run_llvm(NHWC32.quantize(x.shape, 0.02), [x], NHWC32.packed_shape(x.shape))
    np.testing.assert_array_equal(q, NHWC32.pack(quantize_ref(x, 0.02)))
    back = run_llvm(NHWC32.dequantize(q.shape, 37, 0.02), [q], x.shape, "float32")
    np.testing.assert_array_equal(back, NHWC32.unpack(q, 37).astype(np.float32) * np.float32(0.02))
    # int8 relayout both ways: the same integers, padded channels 0
    a = NCHW4C.pack(RNG.integers(-128, 128, (2, 37, 5, 3)).astype(np.int8))
    b = run_llvm(relayout_int8(NCHW4C, NHWC32, (2, 37, 5, 3)), [a], NHWC32.packed_shape((2, 37, 5, 3)))
    np.testing.assert_array_equal(b, NHWC32.pack(NCHW4C.unpack(a, 37)))
    c = run_llvm(relayout_int8(NHWC32, NCHW4C, (2, 37, 5, 3)), [b], NCHW4C.packed_shape((2, 37, 5, 3)))
    np.testing.assert_array_equal(c, a)


def test_nhwc32_add_matches_reference():
    # (its pools: tests/test_kernels.py, both layouts)
    x = RNG.integers(-128, 128, (2, 9, 7, 32)).astype(np.int8)
    y = RNG.integers(-128, 128, x.shape).astype(np.int8)
    add = registry.get("add.nhwc32")
    out = run_llvm(add.compute(AddWorkload(x.shape, 3 << 20, 5 << 19, 22, 0)), [x, y], x.shape)
    v = (x.astype(np.int64) * (3 << 20) + y.astype(np.int64) * (5 << 19) + (1 << 21)) >> 22
    np.testing.assert_array_equal(out, np.clip(v, 0, 127))


def test_tensor_core_build_compiles_with_the_pipeline_and_leaves_dp4a_kernels_alone():
    # the extra passes rewrite async copies, warp buffers and 8-bit vector constants only: a dp4a
    # kernel compiled with them is the same CUDA as with TVM's default pipeline
    from tvm_qconv.schedules.nchw4c.conv2d import conv2d_nchw4c_int8
    from tvm_qconv.schedules.nchw4c.dp4a import schedule_dp4a
    func = schedule_dp4a(conv2d_nchw4c_int8(conv_wl(1, 64, 28, 28, 64)), SM90)
    with SM90:
        plain = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=SM90))
    assert _cuda(func) == plain


DENSE = registry.get("dense.rows.mma")
# rows, K and O that divide no tile (M_p = 128, K_p and O_p padded to 32); ReLU, a clip, none;
# 2 rows (the fewest the registry gives it) and exactly 16 (one mma fragment row: its schedule
# failed TVM's region check in reverse_compute_at until the epilogue's row test was T.likely)
DENSE_WLS = [DenseWorkload(40, 100, 70, (0.0, float("inf"))), DenseWorkload(33, 64, 32, None),
             DenseWorkload(130, 96, 50, (-1.0, 2.0)), DenseWorkload(2, 64, 32, None),
             DenseWorkload(16, 4096, 4096, (0.0, float("inf")))]
DENSE_IDS = ["relu", "none", "clip_m130", "rows2", "rows16_fc7"]


def dense_args(wl, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((wl.batch, DENSE.in_features_padded(wl)), np.int8)  # quantize_rows' zero padding
    x[:, :wl.in_features] = rng.integers(-128, 128, (wl.batch, wl.in_features))
    w = rng.integers(-127, 128, (wl.out_features, wl.in_features)).astype(np.int8)
    scale = rng.uniform(1e-4, 1e-3, wl.out_features).astype(np.float32)
    return [x] + DENSE.pack_params(wl, w, scale, rng.normal(size=wl.out_features).astype(np.float32))


@pytest.mark.parametrize("wl", DENSE_WLS, ids=DENSE_IDS)
def test_dense_on_the_conv_template_equals_numpy(wl):
    # float out: int32 sums exact, then float32(acc) * scale + bias, the reference's own operations
    args = dense_args(wl)
    out = run_llvm(DENSE.compute(wl), args, (wl.batch, wl.out_features), "float32")
    np.testing.assert_array_equal(out, DENSE.reference(wl, *args))
    _assert_tensor_core_code(cuda_source(registry.compile_kernel(DENSE, wl, SM90)))


# ----------------------------------------------------------------------------- on the GPU

GPU_LAYERS = WORKLOADS + ALL_PADDING_TAPS + [conv_wl(1, 64, 224, 224, 64), conv_wl(4, 512, 14, 14, 512),
                                             conv_wl(8, 512, 7, 7, 512)]
GPU_IDS = IDS + ALL_PADDING_IDS + ["vgg_64@224", "512@14_b4", "512@7_b8_m392"]


def gpu_build(impl, wl):
    """``impl``'s default kernel for ``wl`` built for this machine's GPU (skips without int8 mma)."""
    arch = device_arch()
    target = make_target("cuda", arch)
    if not TargetInfo.from_target(target).has_int8_mma:
        pytest.skip(f"{arch} has no int8 mma.m16n8k32")
    return registry.compile_kernel(impl, wl, target)


@pytest.mark.gpu
@pytest.mark.parametrize("wl", GPU_LAYERS, ids=GPU_IDS)
def test_tensor_core_kernel_on_gpu_is_bit_exact(wl):
    lib = gpu_build(IMPL, wl)
    dev = tvm.cuda(0)
    args = args_of(wl, seed=1)
    out = tvm.runtime.tensor(np.full(out_shape(wl), 77, np.int8), dev)  # poisoned
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), IMPL.reference(wl, *args))


@pytest.mark.gpu
@pytest.mark.parametrize("wl", DENSE_WLS, ids=DENSE_IDS)
def test_dense_on_tensor_cores_on_gpu_equals_numpy(wl):
    lib = gpu_build(DENSE, wl)
    dev = tvm.cuda(0)
    args = dense_args(wl, seed=1)
    out = tvm.runtime.tensor(np.full((wl.batch, wl.out_features), np.nan, np.float32), dev)  # poisoned
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    # nvcc may contract acc * scale + bias into one fma (one rounding instead of two): within an
    # ulp of the float32 result, never more
    ref = DENSE.reference(wl, *args)
    np.testing.assert_allclose(out.numpy(), ref, rtol=2 ** -23, atol=np.abs(ref).max() * 2 ** -23)


# ----------------------------------------------------------------- the NHWC32 max-pool (pool.py)

POOL_WLS = [PoolWorkload((2, 12, 10, 64), (2, 2), (2, 2), (0, 0, 0, 0)),                 # VGG's
            PoolWorkload((2, 9, 7, 96), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True),     # ResNet's, ceil
            PoolWorkload((1, 11, 13, 32), (3, 2), (1, 2), (1, 0, 1, 1), (2, 1))]         # dilated, ragged
POOL_IDS = ["vgg_2x2", "resnet_3x3_s2_ceil", "dilated"]


@pytest.mark.parametrize("wl", POOL_WLS, ids=POOL_IDS)
def test_max_pool_cuda_kernel_is_16_channels_per_thread(wl):
    impl = registry.get("max_pool2d.nhwc32")
    src = cuda_source(registry.compile_kernel(impl, wl, make_target("cuda", "sm_90")))
    assert "__vmaxs4(" in src and src.count("*(int4*)") >= 2        # 16-byte loads and store
    # llvm: the generic definition, bit-exact against the reference
    x = np.random.default_rng(0).integers(-128, 128, wl.shape).astype(np.int8)
    got = run_llvm(impl.compute(wl), [x], impl.reference(wl, x).shape)
    np.testing.assert_array_equal(got, impl.reference(wl, x))


@pytest.mark.gpu
@pytest.mark.parametrize("wl", POOL_WLS + [PoolWorkload((8, 224, 224, 64), (2, 2), (2, 2), (0, 0, 0, 0))],
                         ids=POOL_IDS + ["vgg_224px_b8"])
def test_max_pool_cuda_kernel_on_gpu_is_bit_exact(wl):
    impl = registry.get("max_pool2d.nhwc32")
    lib = registry.compile_kernel(impl, wl, make_target("cuda", device_arch()))
    dev = tvm.cuda(0)
    x = np.random.default_rng(1).integers(-128, 128, wl.shape).astype(np.int8)
    ref = impl.reference(wl, x)
    out = tvm.runtime.tensor(np.full(ref.shape, 77, np.int8), dev)  # poisoned
    lib["main"](tvm.runtime.tensor(x, dev), out)
    np.testing.assert_array_equal(out.numpy(), ref)


# ----------------------------------------------------------------------------- the training forward

def _int32_wl(batch, cin, h, w, cout, kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1)):
    return ConvWorkload(batch, cin, h, w, cout, kernel, stride, padding, dilation, 1, activation="none",
                        act_min=-127, out_dtype="int32")


INT32_WLS = [_int32_wl(2, 40, 9, 7, 48, stride=(2, 1)), _int32_wl(1, 16, 7, 7, 20, kernel=(1, 1), padding=(0, 0, 0, 0)),
             _int32_wl(3, 32, 12, 10, 64, dilation=(2, 2), padding=(2, 2, 2, 2)),
             _int32_wl(1, 24, 8, 8, 40, kernel=(5, 5), padding=(2, 1, 2, 3))]


@pytest.mark.parametrize("wl", INT32_WLS, ids=["40to48_s2x1", "1x1_odd_out", "dilation2", "5x5_asymmetric"])
def test_the_int32_form_stores_the_exact_accumulators(wl):
    # the training path's forward: the same implicit GEMM, its int32 accumulators stored as they are
    import torch
    x = RNG.integers(-127, 128, (wl.batch, wl.in_channels, wl.height, wl.width), dtype=np.int8)
    w = RNG.integers(-127, 128, (wl.out_channels, wl.in_channels, *wl.kernel), dtype=np.int8)
    data = np.zeros((wl.batch, wl.height, wl.width, (wl.in_channels + 31) // 32 * 32), np.int8)
    data[..., :wl.in_channels] = x.transpose(0, 2, 3, 1)
    weight = conv2d.pack_weight(w)
    out = tvm.runtime.tensor(np.zeros((wl.batch, wl.out_height, wl.out_width, weight.shape[0]), np.int32))
    tvm.compile(tvm.IRModule({"main": IMPL.compute(wl)}), target="llvm")["main"](
        tvm.runtime.tensor(data), tvm.runtime.tensor(weight), out)
    pt, pl, pb, pr = wl.padding
    xp = torch.nn.functional.pad(torch.from_numpy(x).double(), (pl, pr, pt, pb))
    ref = torch.nn.functional.conv2d(xp, torch.from_numpy(w).double(), stride=wl.stride, dilation=wl.dilation)
    assert np.array_equal(out.numpy()[..., :wl.out_channels].transpose(0, 3, 1, 2), ref.numpy().astype(np.int32))
    assert np.array_equal(conv2d.conv2d_nhwc_int32_ref(wl, data, weight), out.numpy())


def test_the_training_forward_takes_the_tensor_cores_from_16_input_channels_and_dp4a_below():
    info = TargetInfo.from_target(SM90)
    assert registry.select("conv2d", INT32_WLS[0], info) is IMPL
    stem = _int32_wl(2, 3, 32, 32, 64)          # VGG's first conv: 3 channels padded to 32 would waste 10x
    grouped = ConvWorkload(2, 32, 8, 8, 32, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4, activation="none",
                           act_min=-127, out_dtype="int32")
    assert registry.select("conv2d", stem, info).layout == NCHW4C.name
    assert registry.select("conv2d", grouped, info).layout == NCHW4C.name
    with SM90:
        src = cuda_source(registry.compile_kernel(IMPL, INT32_WLS[0], SM90))
    assert "mma.sync.aligned.m16n8k32" in src and "cp.async" in src
