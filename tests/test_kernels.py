"""Every int8 kernel, unscheduled on llvm, against its NumPy reference: bit-exact for int8 outputs."""
import dataclasses
import re
import shutil

import numpy as np
import pytest
import torch
import tvm

from tvm_qconv import registry
from tvm_qconv.schedules.dense_int8 import dense_int8, dense_int8_ref, quantize_rows
from tvm_qconv.schedules.add_int8 import add_int8, add_int8_ref
from tvm_qconv.schedules.nchw4c.conv2d import (conv2d_nchw4c_int8, conv2d_nchw4c_int8_ref, group_blocks,
                                               pack_channels, pack_input_groups, pack_oihw4o4i,
                                               unpack_output_groups)
from tvm_qconv.schedules.nchw4c.layout import ceil4, dequantize_unpack, pack_nchw4c, quantize_pack, unpack_nchw4c
from tvm_qconv.schedules.nchw4c.layout import LAYOUT as NCHW4C
from tvm_qconv.schedules.pool_int8 import (avg_pool2d_int8, avg_pool2d_int8_ref, max_pool2d_int8, max_pool2d_int8_ref,
                                           pool_out_size)
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32
from tvm_qconv.schedules.quantize import quantize_ref
from tvm_qconv.schedules.requantize import (QMIN, add_multipliers, affine_params, quantize_multiplier, requantize_ref,
                                            requantize_ref_i32)
from tvm_qconv.schedules.workload import ConvWorkload

RNG = np.random.default_rng(0)
CPU = tvm.cpu()

W = ConvWorkload.with_activation
# Shapes that do not divide 4 or any tile: odd channels, odd spatial, stride, dilation, 1x1, no ReLU,
# groups of 4-multiples (ResNeXt), groups that are not (each padded on its own), depthwise, a clip.
CONV_WORKLOADS = [
    W("relu", batch=1, in_channels=3, height=8, width=8, out_channels=8),
    W("relu", batch=2, in_channels=6, height=9, width=7, out_channels=10, stride=(2, 1), dilation=(1, 2)),
    W("none", batch=1, in_channels=5, height=11, width=11, out_channels=7, kernel=(1, 1), padding=(0, 0, 0, 0)),
    W("relu", batch=1, in_channels=3, height=13, width=13, out_channels=4, kernel=(7, 7), stride=(2, 2),
      padding=(3, 3, 3, 3)),
    W("none", batch=1, in_channels=8, height=6, width=5, out_channels=12, padding=(0, 1, 2, 1)),
    W("relu", batch=2, in_channels=16, height=7, width=7, out_channels=24, groups=2),
    W("none", batch=1, in_channels=9, height=7, width=6, out_channels=6, groups=3, stride=(2, 2)),
    W("clip", 0, 100, batch=1, in_channels=12, height=9, width=9, out_channels=12, groups=12, dilation=(2, 2),
      padding=(2, 2, 2, 2)),
    # an unsigned input (zero point -128): the padding reads -128, its real zero
    W("relu", batch=1, in_channels=8, height=6, width=5, out_channels=12, padding=(0, 1, 2, 1), in_zero=-128),
    W("none", batch=1, in_channels=9, height=7, width=6, out_channels=6, groups=3, stride=(2, 2), in_zero=-128),
]
CONV_IDS = ["3to8", "odd_stride_dilation", "1x1_norelu", "7x7_s2_stem", "asym_pad_norelu", "groups2_aligned",
            "groups3_padded_s2", "depthwise_d2_clip", "u8_asym_pad", "u8_groups3_s2"]


def run(func, *arrays, out_shape, out_dtype):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype), CPU)
    lib["main"](*[tvm.runtime.tensor(a, CPU) for a in arrays], out)
    return out.numpy()


def conv_args(wl):
    g = wl.groups
    a = pack_input_groups(RNG.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8), g)
    w = pack_oihw4o4i(RNG.integers(-127, 128, (wl.out_channels, wl.group_in, *wl.kernel)).astype(np.int8), g)
    bias = pack_channels(RNG.integers(-20000, 20000, wl.out_channels).astype(np.int32), groups=g)
    # Depthwise layers sum 9 products, not hundreds: a larger multiplier keeps outputs off zero.
    mult, shift = quantize_multiplier(RNG.uniform(1e-4, 1e-2, wl.out_channels) * (30 if wl.group_in < 4 else 1))
    return a, w, bias, pack_channels(mult, groups=g), pack_channels(shift, fill=1, groups=g)


def out_shape(wl):
    return (wl.batch, wl.groups * group_blocks(wl)[1], wl.out_height, wl.out_width, 4)


@pytest.mark.parametrize("wl", CONV_WORKLOADS, ids=CONV_IDS)
def test_conv_kernel_is_bit_exact_against_numpy_int32_reference(wl):
    args = conv_args(wl)
    out = run(conv2d_nchw4c_int8(wl), *args, out_shape=out_shape(wl), out_dtype="int8")
    ref = conv2d_nchw4c_int8_ref(wl, *args)
    np.testing.assert_array_equal(out, ref)
    assert 0.05 < (ref != 0).mean(), "degenerate test: almost every output is zero"
    assert wl.act_min <= ref.min() and ref.max() <= wl.act_max  # the epilogue's clamp
    # padded output channels (of each group) are exactly zero, so the next layer may read them
    real = unpack_output_groups(out, wl.out_channels, wl.groups)
    assert np.count_nonzero(out) == np.count_nonzero(real)


@pytest.mark.parametrize("wl", [w for w in CONV_WORKLOADS if w.groups > 1], ids=[i for i, w in
                         zip(CONV_IDS, CONV_WORKLOADS) if w.groups > 1])
def test_grouped_conv_reference_matches_float64_grouped_convolution(wl):
    import torch
    x = RNG.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = RNG.integers(-127, 128, (wl.out_channels, wl.group_in, *wl.kernel)).astype(np.int8)
    one = np.full(wl.out_channels, 1 << 30, np.int32)  # mult 2**30, shift 30: the identity multiplier
    got = conv2d_nchw4c_int8_ref(wl, pack_input_groups(x, wl.groups), pack_oihw4o4i(w, wl.groups),
                                 pack_channels(np.zeros(wl.out_channels, np.int32), groups=wl.groups),
                                 pack_channels(one, groups=wl.groups), pack_channels(one * 0 + 30, fill=1,
                                                                                       groups=wl.groups))
    pt, pl, pb, pr = wl.padding
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=wl.in_zero)
    acc = torch.nn.functional.conv2d(torch.from_numpy(xp), torch.from_numpy(w.astype(np.float64)), stride=wl.stride,
                                     dilation=wl.dilation, groups=wl.groups).numpy()
    np.testing.assert_array_equal(unpack_output_groups(got, wl.out_channels, wl.groups),
                                  np.clip(acc, wl.act_min, wl.act_max))


def test_int32_variant_returns_the_exact_accumulator():
    wl = ConvWorkload(1, 6, 5, 5, 6, groups=3, activation="none", act_min=QMIN, out_dtype="int32")
    a, w, *_ = conv_args(wl)
    out = run(conv2d_nchw4c_int8(wl), a, w, out_shape=out_shape(wl), out_dtype="int32")
    np.testing.assert_array_equal(out, conv2d_nchw4c_int8_ref(wl, a, w))
    assert np.abs(out).max() > 127  # really the accumulator, not a requantized value


def test_conv_reference_matches_float64_convolution():
    import torch
    wl = CONV_WORKLOADS[1]
    a, w, _, _, _ = conv_args(wl)
    x = torch.from_numpy(unpack_nchw4c(a, wl.in_channels).astype(np.float64))
    wt = np.zeros((ceil4(wl.out_channels), wl.in_channels, 3, 3))
    wt = w.transpose(0, 4, 1, 5, 2, 3).reshape(ceil4(wl.out_channels), -1, 3, 3)[:, :wl.in_channels]
    acc = torch.nn.functional.conv2d(x, torch.from_numpy(wt.astype(np.float64)), stride=wl.stride, padding=1,
                                     dilation=wl.dilation).numpy()
    one, zero = np.full((ceil4(wl.out_channels) // 4, 4), 1 << 30, np.int32), np.zeros((ceil4(wl.out_channels) // 4, 4), np.int32)
    # mult 2**30, shift 30 is the identity multiplier: the requantized output is clip(acc)
    got = conv2d_nchw4c_int8_ref(wl, a, w, zero, one, np.full_like(one, 30))
    np.testing.assert_array_equal(unpack_nchw4c(got, wl.out_channels), np.clip(acc, 0, 127)[:, :wl.out_channels])


MULTIPLIERS = [1e-7, 3.3e-4, 0.0123, 0.5, 0.99999, 1.0, 7.5, 1000.0]


@pytest.mark.parametrize("m", MULTIPLIERS, ids=[f"{m:g}" for m in MULTIPLIERS])
def test_fixed_point_multiplier_has_31_bit_precision(m):
    mult, shift = quantize_multiplier(np.array([m]))
    assert 2**30 <= mult[0] < 2**31
    assert abs(mult[0] * 2.0 ** -shift[0] - m) <= m * 2.0**-30  # relative error of a 31-bit mantissa


def test_requantize_rounds_half_up_and_clips():
    mult, shift = np.int64(1 << 30), np.int64(31)  # M = 0.5
    acc = np.array([-3, -1, 1, 3, 255, 400])
    np.testing.assert_array_equal(requantize_ref(acc, mult, shift, -128), [-1, 0, 1, 2, 127, 127])
    np.testing.assert_array_equal(requantize_ref(acc, mult, shift, 0), [0, 0, 1, 2, 127, 127])


def test_32_bit_requantize_equals_the_64_bit_one_wherever_its_shift_allows():
    # The CUDA epilogues' int32 form (__mulhi, then a shift by shift - 32) must give the same int8
    # as the int64 reference for every |acc + bias| < 2**31 and shift in [33, 62]
    rng = np.random.default_rng(7)
    n = 200_000
    acc = rng.integers(-(2**31) + 1, 2**31, n)
    mult = rng.integers(0, 2**31, n)
    shift = rng.integers(33, 63, n)
    # half the samples at multipliers that put the result inside the int8 range (clamping would
    # hide differences): acc = result * 2**shift / mult around rounding ties
    inside = np.arange(n) < n // 2
    target = rng.integers(-130, 130, n) * 2 + 1                     # odd halves: ties of the rounding
    acc_tie = (target.astype(np.float64) / 2 * 2.0 ** shift / np.maximum(mult, 1)).round()
    acc = np.where(inside & (np.abs(acc_tie) < 2**31 - 1), acc_tie, acc).astype(np.int64)
    acc[:4] = [-(2**31) + 1, 2**31 - 1, -1, 0]
    for lo in (-128, 0):
        np.testing.assert_array_equal(requantize_ref_i32(acc, mult, shift, lo), requantize_ref(acc, mult, shift, lo))
    # and where shift < 33 it would not be (7 * 2**30 / 2**32 = 1.75 rounds to 2; the high word
    # alone gives 1): the kernels check the shift per channel
    acc, mult, shift = np.array([7]), np.array([2**30]), np.array([32])
    assert requantize_ref(acc, mult, shift, -128) == 2 and requantize_ref_i32(acc, mult, shift, -128) == 1


@pytest.mark.parametrize("layout", [NCHW4C, NHWC32], ids=["nchw4c", "nhwc32"])
def test_compiled_quantizer_clips_like_the_qat_one(layout):
    # Symmetric int8 on both paths: a value below -amax becomes -127, never -128, so a QAT model
    # whose activations clip at the negative end compiles to the same integers (issue 13)
    from tvm_qconv.nn.functional import quantize_per_tensor
    x = (RNG.normal(0, 2, (2, 5, 4, 3)) + np.where(RNG.random((2, 5, 4, 3)) < 0.2, -9, 0)).astype(np.float32)
    amax = torch.tensor(1.5)
    q_qat, scale = quantize_per_tensor(torch.from_numpy(x), amax)
    out = run(layout.quantize(x.shape, float(scale)), x, out_shape=layout.packed_shape(x.shape), out_dtype="int8")
    got = layout.unpack(out, 5)
    assert (q_qat.numpy() == -127).sum() > 10 and got.min() == -127       # values do clip, at -127
    np.testing.assert_array_equal(got, q_qat.numpy())


def test_quantize_pack_and_dequantize_unpack_round_trip():
    x = RNG.normal(0, 1, (2, 5, 4, 3)).astype(np.float32)
    s = 0.02
    q = run(quantize_pack(x.shape, s), x, out_shape=(2, 2, 4, 3, 4), out_dtype="int8")
    np.testing.assert_array_equal(q, pack_nchw4c(quantize_ref(x, s)))
    back = run(dequantize_unpack(q.shape, 5, s), q, out_shape=x.shape, out_dtype="float32")
    inside = np.abs(x) < 127 * s
    assert np.abs(back - x)[inside].max() <= s / 2 + 1e-6  # round-to-nearest: half a step


def test_quantize_rows_pads_k_with_zeros():
    x = RNG.normal(0, 1, (3, 10)).astype(np.float32)
    q = run(quantize_rows(x.shape, 0.05), x, out_shape=(3, 12), out_dtype="int8")
    np.testing.assert_array_equal(q[:, :10], quantize_ref(x, 0.05))
    assert not q[:, 10:].any()


# Float -> int8 ties: x / s lands exactly on k + 0.5.  digits' pixel levels 4 and 12 at the scale
# QAT learns for them (amax 1.0: s = float32(1 / 127)) give -63.5 and 63.5; at s = 0.25 (amax 31.75)
# every product is exact; s = 2**25 takes the kernel's other branch (scales >= 2**24).
TIES = [((np.arange(17, dtype=np.float32) / 16 - 0.5) / 0.5, np.float32(1.0)),
        (np.float32([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 126.5, -126.5]) * np.float32(0.25), np.float32(31.75)),
        (np.float32([-2.5, -0.5, 0.5, 2.5]) * np.float32(2**25), np.float32(127 * 2**25))]


@pytest.mark.parametrize("x, amax", TIES, ids=["digits_levels", "scale_0.25", "scale_2^25"])
def test_float_to_int8_rounds_ties_to_even_in_kernel_reference_and_training(x, amax):
    import torch

    from tvm_qconv.nn import quantize_per_tensor

    q_train, s = quantize_per_tensor(torch.from_numpy(x), torch.tensor(float(amax)))
    s = float(s)
    quotient = x / np.float32(s)
    ties = quotient[np.floor(quotient) + 0.5 == quotient]
    assert len(ties) >= 2, "degenerate test: no exact tie"
    want = np.rint(quotient).astype(np.int8)  # half to even: -63.5 -> -64, 2.5 -> 2, 0.5 -> 0
    assert np.all(want[np.isin(quotient, ties)] % 2 == 0)
    np.testing.assert_array_equal(q_train.numpy(), want)
    np.testing.assert_array_equal(quantize_ref(x, s), want)
    nchw = x.reshape(1, -1, 1, 1)
    packed = run(quantize_pack(nchw.shape, s), nchw, out_shape=(1, ceil4(x.size) // 4, 1, 1, 4), out_dtype="int8")
    np.testing.assert_array_equal(unpack_nchw4c(packed, x.size).reshape(-1), want)
    rows = run(quantize_rows((1, x.size), s), x[None], out_shape=(1, ceil4(x.size)), out_dtype="int8")
    np.testing.assert_array_equal(rows[0, :x.size], want)


def test_quantize_kernel_divides_like_float32_numpy_near_ties():
    # x / s one float32 ulp either side of every tie k + 0.5: the kernel's quotient must be
    # NumPy's float32 quotient to the last bit, or these round the other way.
    s = np.float32(1.0) / np.float32(127)
    near = (np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)) * s
    x = np.concatenate([np.nextafter(near, -np.inf), near, np.nextafter(near, np.inf)]).astype(np.float32)
    x = np.concatenate([x, RNG.normal(0, 0.5, 4096).astype(np.float32)]).reshape(1, 1, 1, -1)
    q = run(quantize_pack(x.shape, s), x, out_shape=(1, 1, 1, x.shape[3], 4), out_dtype="int8")
    np.testing.assert_array_equal(q[..., 0].reshape(-1), quantize_ref(x, s).reshape(-1))


def test_quantize_cuda_source_rounds_half_to_even_after_an_ieee_division():
    # TVM builds CUDA with --use_fast_math: a float32 "/" would be div.approx.ftz.f32 (up to 2 ulp
    # off), so the kernel divides in float64 (always IEEE) and rounds with nearbyintf (cvt.rni).
    from tvm import s_tir

    from tvm_qconv.target import cuda_source, make_target

    sch = s_tir.Schedule(quantize_pack((1, 3, 8, 8), 1 / 127))
    bx, tx = sch.split(sch.fuse(*sch.get_loops(sch.get_sblock("quantize_pack"))), [None, 64])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    target = make_target("cuda", "sm_90")
    with target:
        src = cuda_source(tvm.compile(sch.mod, target=target))
    body = src[src.index("__global__"):]
    assert "nearbyintf(((float)((((double)X_ptr[" in body and "floor" not in body and "roundf" not in body
    assert "/ 8454660.0" in body  # float32(1 / 127) = 8454660 * 2**-30, the divisor printed exactly
    if shutil.which("nvcc") is None:
        return
    from tvm.support import nvcc

    with target:
        ptx = bytes(nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")).decode()
    assert "div.rn.f64" in ptx and "cvt.rni.f32.f32" in ptx and "div.approx" not in ptx


POOLS = [((2, 2), (2, 2), (0, 0, 0, 0), False), ((3, 3), (2, 2), (1, 1, 1, 1), False),
         ((3, 3), (2, 2), (0, 0, 0, 0), True), ((2, 2), (2, 2), (1, 1, 1, 1), True)]


# Both activation layouts, 12 real channels: NCHW4c's 3 groups of 4, NHWC32's one padded group of 32.
LAYOUTS = [NCHW4C, NHWC32]


def packed_input(layout, shape=(2, 12, 9, 7)):
    return layout.pack(RNG.integers(-128, 128, shape).astype(np.int8))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("pool,stride,pad,ceil", POOLS,
                         ids=["vgg_2x2", "resnet_3x3_s2_p1", "ceil_mode", "ceil_mode_last_window_dropped"])
def test_max_pool_int8_matches_reference(pool, stride, pad, ceil, layout):
    x = packed_input(layout)
    ref = max_pool2d_int8_ref(layout, x, pool, stride, pad, (1, 1), ceil)
    out = run(max_pool2d_int8(layout, x.shape, pool, stride, pad, (1, 1), ceil), x, out_shape=ref.shape,
              out_dtype="int8")
    np.testing.assert_array_equal(out, ref)



@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_cuda_schedule_is_one_thread_per_output_and_computes_the_reference(kind, layout):
    """The CUDA schedule (dlight's took 53 of Inception-V3's 60 ms at batch 64): built for CUDA,
    and its CPU twin -- thread loops serial, the register accumulator global -- is bit-exact."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.schedules.pool_int8 import schedule_pool
    from tvm_qconv.target import cuda_source, make_target

    x = packed_input(layout, (2, 12, 9, 7))  # 2*9*7 pixels: outputs do not divide the 256 threads
    pool, stride, pad = (3, 3), (1, 1), (1, 1, 1, 1)
    if kind == "max":
        func, ref = max_pool2d_int8(layout, x.shape, pool, stride, pad), max_pool2d_int8_ref(layout, x, pool, stride, pad)
    else:
        func = avg_pool2d_int8(layout, x.shape, pool, stride, pad, 1 << 29, 32)
        ref = avg_pool2d_int8_ref(layout, x, pool, stride, pad, 1 << 29, 32)
    target = make_target("cuda", "sm_90")
    scheduled = schedule_pool(func, target)
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": scheduled}), target=target))
    # one kernel (a declaration, then the definition), no block-wide reduction, a register accumulator
    assert len(re.findall(r"__global__[^;{]*\{", src)) == 1 and "__shared__" not in src
    assert re.search(r"\w+_local_ptr\[1\];", src)
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"T.serial(\1)", scheduled.script())
    twin = tvmscript.parse(text.replace('scope="local"', 'scope="global"'))
    np.testing.assert_array_equal(run(twin, x, out_shape=ref.shape, out_dtype="int8"), ref)

# The add and the affine on CUDA: 16 bytes per thread (schedules/elementwise_int8.py).  Shapes:
# ResNet's NHWC32 (channels a multiple of 32: full 16-byte vectors), 15 pixels of 96 channels (90
# vectors: blocks of 90 threads), NCHW4c (4-byte vectors), and 2 x 257 vectors (no divisor from 32
# to 256: the grid has a tail, stored element by element under its guard).
ELEMENTWISE_SHAPES = [(2, 9, 7, 64), (1, 3, 5, 96), (3, 11, 2, 5, 4), (1, 1, 257, 32)]


def _elementwise_case(op: str, shape, seed: int = 0):
    """(implementation, workload, inputs, NumPy reference) of the add / affine on ``shape``."""
    from tvm_qconv import registry
    from tvm_qconv.schedules.workload import AddWorkload, AffineWorkload

    layout = "nhwc32" if len(shape) == 4 else "nchw4c"
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, shape).astype(np.int8)
    if op == "add":
        ma, mb, sh = add_multipliers(0.03, 0.011, 0.05)
        wl = AddWorkload(shape, ma, mb, sh, act_min=0)
        inputs = [x, rng.integers(-128, 128, shape).astype(np.int8)]
    else:
        wl = AffineWorkload(shape, act_min=-6, act_max=100)
        impl = registry.get(f"affine.{layout}")
        c = impl.packing.logical_shape(shape)[1]
        a = rng.uniform(0.2, 2.0, c) * rng.choice([-1, 1], c)          # a BatchNorm's gamma may be negative
        mult, shift, bias = affine_params(a, rng.normal(0.0, 2.0, c), 0.03, 0.05)
        inputs = [x, mult, shift, bias]
    impl = registry.get(f"{op}.{layout}")
    return impl, wl, inputs, impl.reference(wl, *inputs)


# the affine in NHWC32 has its own CUDA kernel (test_nhwc32_affine_cuda_kernel_...); in NCHW4c the
# elementwise schedule's
ELEMENTWISE_SCHEDULED = [("add", s) for s in ELEMENTWISE_SHAPES] + [("affine", (3, 11, 2, 5, 4))]


@pytest.mark.parametrize("op,shape", ELEMENTWISE_SCHEDULED,
                         ids=["add-nhwc32", "add-nhwc32_odd_pixels", "add-nchw4c", "add-tail", "affine-nchw4c"])
def test_elementwise_cuda_schedule_loads_16_bytes_and_computes_the_reference(op, shape):
    """dlight's schedule of the add loaded one byte per operand per thread (1.2 of ResNet-50's
    3.4 ms at batch 64): built for CUDA, the vector loads and stores are in the source, and the
    CPU twin -- thread loops serial, registers global -- is bit-exact."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.target import cuda_source, make_target

    impl, wl, inputs, ref = _elementwise_case(op, shape)
    target = make_target("cuda", "sm_90")
    scheduled = impl.schedule(impl.compute(wl), target)
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": scheduled}), target=target))
    vector = "int4" if len(shape) == 4 else "int"          # 16 bytes (NHWC32) or 4 (NCHW4c) a thread
    copy = rf"\*\({vector}\*\)\((\w+?)(_local)?_ptr \+ [^;]*\) = \*\({vector}\*\)\((\w+?)(_local)?_ptr \+"
    copies = re.findall(copy, src)
    loads = [c for c in copies if c[1] and not c[3]]       # register <- global
    stores = [c for c in copies if c[3] and not c[1]]      # global <- register
    assert len(loads) == (2 if op == "add" else 1) and len(stores) == (0 if shape[2] == 257 else 1), src
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"T.serial(\1)", scheduled.script())
    twin = tvmscript.parse(text.replace('scope="local"', 'scope="global"'))
    np.testing.assert_array_equal(run(twin, *inputs, out_shape=ref.shape, out_dtype="int8"), ref)


def test_input_quantize_cuda_schedule_stores_a_pixel_per_word_and_computes_the_reference():
    """The model input's quantize to NCHW4c (the stem's input) on CUDA: a thread per pixel, its 3
    channels and the padding one stored as one 32-bit word; the CPU twin is bit-exact."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.target import cuda_source, make_target

    x = RNG.normal(0, 1, (2, 3, 9, 7)).astype(np.float32)  # 126 pixels: blocks of 126 threads
    s = 0.021
    func = quantize_pack(x.shape, s)
    target = make_target("cuda", "sm_90")
    scheduled = registry.get("quantize.nchw4c.generic").schedule(func, target)
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": scheduled}), target=target))
    assert re.search(r"\*\(int\*\)\(quantize_pack_ptr \+ [^;]*\) = \*\(int\*\)\(quantize_pack_local_ptr", src), src
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"T.serial(\1)", scheduled.script())
    twin = tvmscript.parse(text.replace('scope="local"', 'scope="global"'))
    ref = pack_nchw4c(quantize_ref(x, s))
    np.testing.assert_array_equal(run(twin, x, out_shape=ref.shape, out_dtype="int8"), ref)


def _concat_affine_case(channels, n=2, h=3, w=5, seed=0, zeros=None):
    """(implementation, workload, packed inputs, reference) of an NHWC32 affine of the concatenation
    of int8 tensors of ``channels`` (each at its own scale and zero point, as DenseNet's)."""
    from tvm_qconv.schedules.workload import AffineWorkload
    rng = np.random.default_rng(seed)
    zeros = zeros or [(-128 if i % 2 else 0) for i in range(len(channels))]
    scales = rng.uniform(0.01, 0.05, len(channels))
    total = sum(channels)
    a, b = rng.normal(0, 1, total), rng.normal(0, 0.5, total)
    offsets = np.cumsum([0, *channels])
    parts = [affine_params(a[i:j], b[i:j], s, 0.04, z) for i, j, s, z in zip(offsets, offsets[1:], scales, zeros)]
    mult, shift, bias = (np.concatenate([p[k] for p in parts]) for k in range(3))
    impl = registry.get("affine.nhwc32")
    wl = AffineWorkload(NHWC32.packed_shape((n, total, h, w)), -128, 127, -128, tuple(channels))
    qs = [rng.integers(-128 if z else -127, 128, (n, c, h, w)).astype(np.int8) for c, z in zip(channels, zeros)]
    args = [NHWC32.pack(q) for q in qs] + impl.pack_params(wl, mult, shift, bias)
    return impl, wl, args, impl.reference(wl, *args)


# (inputs' channels, pixels n x h x w, MIN_THREADS): one input (a plain BatchNorm); DenseNet's 64 + 32
# + 32; 48 + 80 + 16 (inputs padded to 64 and 96 in memory, 144 channels padded to 160: the last
# vector is the output's padding); 8 pixels a thread over 2 x 3 x 5 pixels (30: the last thread's
# pixels run past the end), by lowering the thread floor
NHWC32_AFFINES = [((), 2 * 9 * 7, None), ((64, 32, 32), 2 * 3 * 5, None), ((48, 80, 16), 2 * 3 * 5, None),
                  ((64, 32), 2 * 3 * 5, 1)]


@pytest.mark.parametrize("channels,pixels,floor", NHWC32_AFFINES, ids=["one-input", "densenet", "padded", "8px"])
def test_nhwc32_affine_cuda_kernel_loads_16_bytes_per_input_and_computes_the_reference(channels, pixels, floor,
                                                                                     monkeypatch):
    """The NHWC32 affine's CUDA kernel (schedules/tensorcore/affine.py): one 16-byte load per input
    branch and one 16-byte store, the parameters loaded 4 int32 at a time; its CPU twin (thread
    loops serial) is bit-exact against the NumPy reference, pixels a thread included."""
    from tvm_qconv.schedules.tensorcore import affine as tc_affine
    from tvm_qconv.target import cuda_source, make_target
    if floor is not None:
        monkeypatch.setattr(tc_affine, "MIN_THREADS", floor)
    if channels:
        impl, wl, args, ref = _concat_affine_case(channels)
    else:
        impl, wl, args, ref = _elementwise_case("affine", (2, 9, 7, 64))
    assert tc_affine.pixels_per_thread(wl.shape[-1] // 16 * pixels) == (8 if floor else 1)
    target = make_target("cuda", "sm_90")
    kernel = impl.schedule(impl.compute(wl), target)
    assert kernel.attrs["tvm_qconv.workload"] == impl.compute(wl).attrs["tvm_qconv.workload"]
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": kernel}), target=target))
    loads = re.findall(r"\*\(int4\*\)\(xv_ptr \+ 0\) = \*\(int4\*\)\(x\d_ptr", src)
    stores = re.findall(r"\*\(int4\*\)\(y_ptr \+ [^;]*\) = \*\(int4\*\)\(yv_ptr", src)
    unroll = 8 if floor else 1
    assert len(loads) == unroll * max(1, len(channels)) and len(stores) == unroll, src
    assert len(re.findall(r"\*\(int4\*\)\(m_ptr \+ \d+\) = \*\(int4\*\)\(Mult_ptr", src)) == 4
    np.testing.assert_array_equal(run(_gpu_twin(kernel), *args, out_shape=ref.shape, out_dtype="int8"), ref)


def test_nhwc32_affine_keeps_the_elementwise_schedule_where_a_vector_would_straddle_two_inputs():
    # 6 + 32 + 5 channels: the second input starts mid-vector (test_an_affine_of_a_concatenation_...
    # checks that schedule's numbers)
    from tvm_qconv.schedules.tensorcore.affine import affine_kernel
    from tvm_qconv.schedules.workload import AffineWorkload
    assert affine_kernel(AffineWorkload(NHWC32.packed_shape((2, 43, 3, 5)), inputs=(6, 32, 5))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [(64, 32, 32), (48, 80, 16)], ids=["densenet", "padded"])
@pytest.mark.parametrize("n,h,w", [(1, 56, 56), (64, 28, 28)], ids=["b1", "b64"])
def test_nhwc32_affine_of_a_concatenation_on_gpu_is_bit_exact(channels, n, h, w):
    impl, wl, args, ref = _concat_affine_case(channels, n, h, w, seed=2)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, ref.shape), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES + [(64, 56, 56, 256)],
                         ids=["nhwc32", "nhwc32_odd_pixels", "nchw4c", "tail", "resnet50_b64"])
@pytest.mark.parametrize("op", ["add", "affine"])
def test_elementwise_cuda_kernel_on_gpu_is_bit_exact(op, shape):
    impl, wl, inputs, ref = _elementwise_case(op, shape, seed=1)
    if op == "add" and shape == (64, 56, 56, 256):       # every pair of int8 inputs, in the first 2M
        inputs[0].reshape(-1)[:_PAIRS_A.size] = _PAIRS_A.reshape(-1)
        inputs[1].reshape(-1)[:_PAIRS_B.size] = _PAIRS_B.reshape(-1)
        ref = impl.reference(wl, *inputs)
    np.testing.assert_array_equal(_on_gpu(impl, wl, inputs, ref.shape), ref)


# (packed shape, in / out zero points): EfficientNet-B0's first squeeze at batch 1 (24 blocks share
# the image) and at 17 x 19 (one block per image), unsigned in and out; 96 channels (6 vectors: 42
# lanes, 4 idle threads) over 3 images; a 14 x 14 squeeze (672 channels: 42 vectors, 6 lanes, 8 chunks)
GLOBAL_POOLS = [((1, 112, 112, 32), 0, 0), ((2, 17, 19, 64), -128, -128), ((3, 16, 16, 96), -128, 0),
                ((1, 14, 14, 672), 0, -128), ((2, 7, 7, 1152), 0, 0)]


def _global_pool_case(shape, in_zero, out_zero, seed=0):
    """(implementation, workload, input, reference) of an NHWC32 global average pool."""
    from tvm_qconv.schedules.workload import AvgPoolWorkload
    n, h, w, cp = shape
    # the mean rescaled by 0.45 (x + 128 of an unsigned input into a signed output: 0..115)
    mult, shift = quantize_multiplier(np.array([0.45 / (h * w)]))
    wl = AvgPoolWorkload(shape, (h, w), (1, 1), (0, 0, 0, 0), int(mult[0]), int(shift[0]), in_zero, out_zero)
    rng = np.random.default_rng(seed)
    # a mean per channel (-100..100) and noise: outputs spread over the range, rounding cases included
    x = np.clip(rng.integers(-100, 101, cp) + rng.integers(-28, 29, shape), -128, 127).astype(np.int8)
    impl = registry.get("avg_pool2d.nhwc32.global")
    return impl, wl, x, impl.reference(wl, x)


def _run_global_pool(func, wl, x, dev=None):
    """The pool's result (its scratch output, the chunks' sums, poisoned first)."""
    from tvm_qconv.schedules.tensorcore.global_pool import scratch_shape
    if dev is None:
        lib, dev = tvm.compile(tvm.IRModule({"main": func}), target="llvm"), CPU
    else:
        lib = func
    n, _, _, cp = wl.shape
    partial = tvm.runtime.tensor(np.full(scratch_shape(wl), 12345, np.int32), dev)
    out = tvm.runtime.tensor(np.full((n, 1, 1, cp), 77, np.int8), dev)
    lib["main"](tvm.runtime.tensor(x, dev), partial, out)
    return out.numpy()


@pytest.mark.parametrize("shape,in_zero,out_zero", GLOBAL_POOLS,
                         ids=["se-112px-b1", "unsigned", "96ch", "se-14px-b1", "se-7px-b2"])
def test_nhwc32_global_pool_splits_images_into_chunks_and_computes_the_reference(shape, in_zero, out_zero):
    """The NHWC32 global average pool (schedules/tensorcore/global_pool.py): its compute definition
    and its CUDA kernels' CPU twin (16-byte loads; a kernel of per-chunk sums, one that
    requantizes) are bit-exact against the NumPy reference of every average pool."""
    from tvm_qconv.schedules.tensorcore.global_pool import chunking
    from tvm_qconv.target import cuda_source, make_target
    impl, wl, x, ref = _global_pool_case(shape, in_zero, out_zero)
    assert ref.shape == (shape[0], 1, 1, shape[3]) and len(np.unique(ref)) > 10
    assert chunking(wl)[0] == {(1, 112): 24, (2, 17): 1, (3, 16): 1, (1, 14): 8, (2, 7): 4}[shape[:2]]
    target = make_target("cuda", "sm_90")
    func = impl.compute(wl)
    kernel = impl.schedule(func, target)
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": kernel}), target=target))
    assert src.count("extern \"C\" __global__") == 4, src   # two kernels, each declared and defined
    assert re.search(r"\*\(int4\*\)\(xv_ptr \+ 0\) = \*\(int4\*\)\(x_ptr", src), src
    for f in (func, _gpu_twin(kernel)):
        np.testing.assert_array_equal(_run_global_pool(f, wl, x), ref)


def test_the_global_pool_takes_whole_map_pools_of_49_pixels_or_more_in_nhwc32_only():
    from tvm_qconv.schedules.workload import AvgPoolWorkload
    from tvm_qconv.target import TargetInfo, make_target
    impl, target = registry.get("avg_pool2d.nhwc32.global"), TargetInfo.from_target(make_target("cuda", "sm_90a"))

    def wl(shape, pool, padding=(0, 0, 0, 0)):
        return AvgPoolWorkload(shape, pool, (1, 1), padding, 1 << 20, 28)
    assert impl.applies(wl((1, 16, 16, 32), (16, 16)), target)
    assert not impl.applies(wl((1, 16, 16, 32), (16, 16), (1, 1, 1, 1)), target)   # padded
    assert impl.applies(wl((1, 14, 14, 672), (14, 14)), target)                    # EfficientNet's 14 x 14 squeeze
    assert impl.applies(wl((1, 7, 7, 1152), (7, 7)), target)                       # and its 7 x 7 ones
    assert not impl.applies(wl((1, 6, 6, 1280), (6, 6)), target)                   # 36 pixels: generic kernel
    assert not impl.applies(wl((1, 16, 16, 4128), (16, 16)), target)               # > 256 vectors
    assert not impl.applies(wl((1, 16, 16, 32), (8, 8)), target)                   # not the whole map
    assert registry.select("avg_pool2d", wl((1, 16, 16, 32), (16, 16)), target, layout="NHWC32") is impl


class _DenseAndSqueeze(torch.nn.Module):
    """DenseNet's BatchNorm of a concat (read in place by the affine) and a squeeze-excite's mean over
    a 16 x 16 map (the global pool with its scratch output): the two written-out kernels in a model."""

    def __init__(self):
        super().__init__()
        from torch import nn
        torch.manual_seed(0)
        self.stem, self.c1 = nn.Conv2d(3, 64, 3, padding=1), nn.Conv2d(64, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(96)
        self.fc1, self.fc2, self.head = nn.Conv2d(96, 8, 1), nn.Conv2d(8, 96, 1), nn.Conv2d(96, 10, 1)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.weight.data.uniform_(-1.5, 1.5)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.bn(torch.cat([x, self.c1(x)], 1)))
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))
        return self.head(x * gate).mean((2, 3))


def test_a_model_with_written_out_kernels_builds_for_cuda(tmp_path):
    """The kernels written out in TVMScript (thread loops, no blocks) go through Relax's CUDA pipeline,
    whose dlight rules and ``RewriteDataflowReshape`` expect a root block (``kernel.parse_written_kernel``):
    the first affine kernel had none, and a CUDA build of this model failed in dlight ("The function
    body is expected to be the root block", b64c133)."""
    from tvm_qconv.build import BuildOptions, compile_model
    from tvm_qconv.config import QuantConfig
    from tvm_qconv.data import skimage_photos
    from tvm_qconv.ranges import Calibrate
    res = compile_model(_DenseAndSqueeze().eval(), str(tmp_path / "m.so"), config=QuantConfig(num_calib_images=4),
                        options=BuildOptions(target="cuda", arch="sm_90a", batch=2, image_size=16),
                        ranges=Calibrate(skimage_photos(16)[:4]), progress=False)
    kernels = {r["kernel"] for r in res.report["layers"]}
    assert {"affine.nhwc32", "avg_pool2d.nhwc32.global"} <= kernels, kernels
    how = {label: h for label, h in res.report["schedules"].values()}
    assert how["affine.nhwc32"] == how["avg_pool2d.nhwc32.global"] == "default"


@pytest.mark.gpu
# (an NHWC32 map's channels are a multiple of 32: EfficientNet's 240 are stored as 256)
@pytest.mark.parametrize("shape", [(1, 112, 112, 32), (64, 112, 112, 32), (64, 28, 28, 256), (1, 14, 14, 672),
                                   (64, 7, 7, 1152)], ids=["b1", "b64", "b64-256ch", "b1-14px", "b64-7px"])
def test_nhwc32_global_pool_on_gpu_is_bit_exact(shape):
    from tvm_qconv.target import device_arch, make_target
    impl, wl, x, ref = _global_pool_case(shape, -128, -128, seed=3)
    lib = registry.compile_kernel(impl, wl, make_target("cuda", device_arch()))
    np.testing.assert_array_equal(_run_global_pool(lib, wl, x, tvm.cuda(0)), ref)


# (size, kernel, stride, pad, dilation): every pad PyTorch accepts (at most half the kernel).
POOL_GRID = [(size, k, s, p, d) for size in (4, 5, 6, 7) for k in (1, 2, 3) for s in (1, 2, 3)
             for p in range(k // 2 + 1) for d in (1, 2) if (k - 1) * d + 1 <= size + 2 * p]


@pytest.mark.parametrize("ceil_mode", [False, True], ids=["floor", "ceil"])
def test_max_pool_output_size_and_values_are_pytorchs(ceil_mode):
    """Output size by PyTorch's rule, including ceil_mode's: a last window that would start in
    the trailing padding is dropped (size 5, kernel 2, stride 2, pad 1: 3 outputs, not 4)."""
    assert pool_out_size(5, 5, (2, 2), (2, 2), (1, 1, 1, 1), ceil_mode=ceil_mode) == (3, 3)
    for size, k, s, p, d in POOL_GRID:
        x = RNG.integers(-128, 128, (1, 1, size, size + 1, 4)).astype(np.int8)  # H != W: both axes
        want = torch.nn.functional.max_pool2d(torch.from_numpy(unpack_nchw4c(x, 4)).float(), k, s, p, d, ceil_mode)
        case = dict(size=size, kernel=k, stride=s, pad=p, dilation=d)
        got = pool_out_size(size, size + 1, (k, k), (s, s), (p, p, p, p), (d, d), ceil_mode)
        assert got == tuple(want.shape[2:]), case
        ref = max_pool2d_int8_ref(NCHW4C, x, (k, k), (s, s), (p, p, p, p), (d, d), ceil_mode)
        # exact: max of the same integers (the -128 padding never wins: every window holds an input)
        np.testing.assert_array_equal(unpack_nchw4c(ref, 4), want.numpy().astype(np.int8), err_msg=str(case))


# One bad field each; the message names the field and the value it got.
BAD_CONV_FIELDS = [("kernel", (0, 3)), ("kernel", (3,)), ("stride", (1, 0)), ("stride", 2), ("dilation", (0, 1)),
                   ("padding", (1, 1, 1)), ("padding", (0, -1, 0, 0)), ("groups", 3), ("groups", 0)]


@pytest.mark.parametrize("field,value", BAD_CONV_FIELDS, ids=[f"{f}={v}" for f, v in BAD_CONV_FIELDS])
def test_conv_workload_rejects_bad_geometry_naming_the_field(field, value):
    good = dict(batch=1, in_channels=8, height=8, width=8, out_channels=8)
    ConvWorkload(**good)
    with pytest.raises(ValueError, match=rf"ConvWorkload\.{field}\b.*{re.escape(str(value))}"):
        ConvWorkload(**good, **{field: value})


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "norelu"])
def test_residual_add_rescales_to_output_scale(relu):
    a = RNG.integers(-128, 128, (1, 2, 5, 5, 4)).astype(np.int8)
    b = RNG.integers(-128, 128, (1, 2, 5, 5, 4)).astype(np.int8)
    s_a, s_b, s_o = 0.03, 0.011, 0.05
    ma, mb, sh = add_multipliers(s_a, s_b, s_o)
    lo = 0 if relu else QMIN
    out = run(add_int8(a.shape, ma, mb, sh, lo), a, b, out_shape=a.shape, out_dtype="int8")
    np.testing.assert_array_equal(out, add_int8_ref(a, b, ma, mb, sh, lo))
    exact = np.clip((a * s_a + b * s_b) / s_o, lo, 127)
    assert np.abs(out - exact).max() <= 0.5 + 1e-6  # one rounding, in output steps


# every pair of int8 inputs, 32 channels each
_PAIRS_A = np.repeat(np.arange(-128, 128), 256).astype(np.int8).reshape(1, 256, 256, 1).repeat(32, axis=3)
_PAIRS_B = np.tile(np.arange(-128, 128), 256).astype(np.int8).reshape(1, 256, 256, 1).repeat(32, axis=3)


@pytest.mark.parametrize("scales, lo", [((0.03, 0.011, 0.05), 0),         # ResNet-like: shift 31
                                        ((0.002, 0.09, 0.004), QMIN),     # a multiplier above 1
                                        ((0.05, 0.0004, 0.3), -6),        # one operand nearly vanishing
                                        ((1e-9, 2e-9, 1.0), QMIN)],       # shift 54: the int64 form
                         ids=["resnet", "large_mult", "tiny_b", "int64_form"])
def test_residual_add_in_32_bits_equals_the_int64_form_on_every_input_pair(scales, lo):
    """The add computes in int32 where ``split_multipliers`` finds the terms fit (schedules/add_int8.py):
    exhaustively, every (a, b) in int8 x int8 gives the int64 reference's output."""
    from tvm_qconv.schedules.add_int8 import split_multipliers

    ma, mb, sh = add_multipliers(*scales)
    assert (split_multipliers(ma, mb, sh) is None) == (sh > 52)
    out = run(add_int8(_PAIRS_A.shape, ma, mb, sh, lo), _PAIRS_A, _PAIRS_B, out_shape=_PAIRS_A.shape, out_dtype="int8")
    np.testing.assert_array_equal(out, add_int8_ref(_PAIRS_A, _PAIRS_B, ma, mb, sh, lo))


def test_dense_int8_matches_reference():
    x = RNG.integers(-128, 128, (3, 20)).astype(np.int8)
    w = RNG.integers(-127, 128, (7, 20)).astype(np.int8)
    scale = RNG.uniform(1e-5, 1e-4, 7).astype(np.float32)
    bias = RNG.normal(0, 1, 7).astype(np.float32)
    for clip in (None, (0.0, float("inf")), (0.0, 6.0)):  # none, ReLU, ReLU6
        out = run(dense_int8(3, 20, 7, clip), x, w, scale, bias, out_shape=(3, 7), out_dtype="float32")
        # float epilogue: one float32 multiply-add per output, so agreement to float32 rounding
        np.testing.assert_allclose(out, dense_int8_ref(x, w, scale, bias, clip), rtol=1e-6, atol=1e-6)



def test_dense_of_a_large_gemm_builds_for_cuda():
    """ConvNeXt's token-wise Linear at 64 px (256 tokens x 96 -> 384) failed ``tvm.compile`` for
    CUDA: dlight's int8 wmma rule, taken when every GEMM dimension exceeds 64, dies in TVM 0.27's
    InjectSoftwarePipeline.  The kernel opts out of it (``dlight.do_not_tensorize``)."""
    from tvm.s_tir import dlight as dl

    from tvm_qconv.target import cuda_source, make_target

    target = make_target("cuda", "sm_90")
    with target:  # the rules the Relax CUDA pipeline applies to unscheduled kernels
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                      dl.gpu.GeneralReduction(), dl.gpu.Fallback())(
            tvm.IRModule({"main": dense_int8(256, 96, 384)}))
        src = cuda_source(tvm.compile(mod, target=target))
    assert "__global__" in src and "wmma" not in src

SCALES = [0.02, 1 / 127, 3.7e-9, 2.5e-17, 6.0e12]


@pytest.mark.parametrize("scale", SCALES, ids=[f"{s:g}" for s in SCALES])
def test_dequantize_is_the_float32_product_at_any_scale(scale):
    q = RNG.integers(-128, 128, (1, 2, 3, 3, 4)).astype(np.int8)
    out = run(dequantize_unpack(q.shape, 7, scale), q, out_shape=(1, 7, 3, 3), out_dtype="float32")
    want = unpack_nchw4c(q, 7).astype(np.float32) * np.float32(scale)  # one float32 rounding
    np.testing.assert_array_equal(out, want)


def test_dequantize_cuda_source_prints_its_scale_exactly():
    # TVM's CUDA codegen prints float constants with 15 decimals: 3.7e-9 as a float32 literal
    # would keep 7 digits (and 2.5e-17 none); the kernel multiplies by an integer and divides by
    # a power of two instead, both printed exactly.
    from tvm import s_tir

    from tvm_qconv.target import cuda_source, make_target

    sch = s_tir.Schedule(dequantize_unpack((1, 1, 4, 4, 4), 3, 3.7e-9))
    bx, tx = sch.split(sch.fuse(*sch.get_loops(sch.get_sblock("dequantize_unpack"))), [None, 16])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    target = make_target("cuda", "sm_90")
    with target:
        body = cuda_source(tvm.compile(sch.mod, target=target))
    frac, exp = np.frexp(np.float32(3.7e-9))
    assert f"* {int(frac * (1 << 24))}.0" in body.replace("(double)", "") and f"{2.0 ** (24 - exp):.1f}"[:12] in body


DEPTHWISE = [
    W("clip", 0, 90, batch=2, in_channels=12, height=9, width=7, out_channels=12, groups=12, stride=(2, 2)),
    W("relu", batch=1, in_channels=6, height=8, width=8, out_channels=12, groups=6, dilation=(2, 2),
      padding=(2, 2, 2, 2)),
    W("none", batch=1, in_channels=5, height=7, width=7, out_channels=5, groups=5, kernel=(5, 5),
      padding=(2, 2, 2, 2)),
    W("clip", -20, 127, batch=1, in_channels=32, height=14, width=14, out_channels=32, groups=32, stride=(2, 2),
      padding=(0, 0, 1, 1)),
    # ConvNeXt's: 7 x 7, no activation; NHWC32's row tile takes the 14-wide output 7 pixels at a time
    # (at this size only where the grid-size floor is lowered: test_depthwise_row_tile_...)
    W("none", batch=2, in_channels=40, height=14, width=14, out_channels=40, groups=40, kernel=(7, 7),
      padding=(3, 3, 3, 3)),
]
DEPTHWISE_IDS = ["relu6_s2", "multiplier2_d2", "5x5_odd_channels_norelu", "asym_pad_s2_clip", "7x7_convnext"]


def _depthwise_layer(wl):
    """A depthwise layer's random int8 input [N, C, H, W], OIHW weight and int32 bias, mult, shift."""
    x = RNG.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = RNG.integers(-127, 128, (wl.out_channels, 1, *wl.kernel)).astype(np.int8)
    b = RNG.integers(-2000, 2000, wl.out_channels).astype(np.int32)
    m, s = quantize_multiplier(RNG.uniform(3e-3, 3e-2, wl.out_channels))
    return x, w, b, m, s


def _packed(wl, impl, layer):
    """``layer`` (:func:`_depthwise_layer`) as ``impl``'s arguments."""
    from tvm_qconv import registry
    x, *params = layer
    return [registry.layout(impl.layout).pack(x), *impl.pack_params(wl, *params)]


def _on_gpu(impl, wl, args, shape):
    """``impl``'s kernel for ``wl`` built for this GPU and run on ``args`` into a poisoned output."""
    from tvm_qconv.target import device_arch, make_target
    lib = registry.compile_kernel(impl, wl, make_target("cuda", device_arch(full=True)))   # sm_90a: wgmma too
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full(shape, 77, np.int8), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    return out.numpy()


def _gpu_twin(func):
    """A scheduled CUDA PrimFunc runnable on llvm: thread loops serial, local buffers global."""
    import re

    from tvm.script import parser as tvmscript
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"range(\1)", func.script())
    # shared memory: a kernel that shares it writes it in one thread loop and reads it in the next
    # (the barrier between them is TVM's), so the serial loops keep the order
    return tvmscript.parse(text.replace('scope="local"', 'scope="global"').replace("T.alloc_shared(", "T.alloc_buffer("))


def _grouped_wl(c, o, groups, size, kernel, stride, in_zero=0, batch=2):
    p = kernel // 2
    return ConvWorkload.with_activation("relu", 0, 127, batch=batch, in_channels=c, height=size, width=size + 2,
                                        out_channels=o, kernel=(kernel, kernel), stride=(stride, stride),
                                        padding=(p, p, p, p), dilation=(1, 1), in_zero=in_zero, groups=groups)


# ResNeXt's first stage (groups of 4, 128 channels scaled down to 32), RegNet-X's groups of 16 at
# stride 2 on an unsigned input (padding reads -128), 8 per group with 40 channels (padded to 64:
# the last output words are padding), ResNeXt's widest groups (32); one group of few channels, its
# input channels padded to 4 with zero weights: EfficientNet-B0's squeeze-excite conv (6 -> 144 on
# a 1 x 3 map), 10 channels at stride 2 on an unsigned input
GROUPED = [_grouped_wl(32, 32, 8, 7, 3, 1), _grouped_wl(48, 48, 3, 8, 3, 2, in_zero=-128),
           _grouped_wl(40, 40, 5, 6, 3, 1), _grouped_wl(64, 64, 2, 5, 3, 1, in_zero=-128),
           _grouped_wl(6, 144, 1, 1, 1, 1), _grouped_wl(10, 24, 1, 6, 3, 2, in_zero=-128)]
GROUPED_IDS = ["resnext-g4", "regnet-g16-s2-unsigned", "g8-padded-out", "g32", "one-group-6ch", "one-group-10ch-s2"]


def _grouped_args(wl, seed=0):
    rng = np.random.default_rng(seed)
    impl = registry.get("conv2d.nhwc32.grouped")
    # the padded channels hold garbage too: the kernel must not read them, or only times a zero weight
    x = rng.integers(-128 if wl.in_zero else -127, 128,
                     (wl.batch, wl.height, wl.width, -(-wl.in_channels // 32) * 32)).astype(np.int8)
    w = rng.integers(-127, 128, (wl.out_channels, wl.in_channels // wl.groups, *wl.kernel)).astype(np.int8)
    mult, shift = quantize_multiplier(rng.uniform(2e-3, 6e-3, wl.out_channels))
    bias = rng.integers(-3000, 3000, wl.out_channels).astype(np.int32)
    return impl, [x] + impl.pack_params(wl, w, bias, mult, shift), w


@pytest.mark.parametrize("floor", [None, 1], ids=["grid-floor", "words-and-pixels-a-thread"])
@pytest.mark.parametrize("wl", GROUPED, ids=GROUPED_IDS)
def test_grouped_nhwc32_kernel_and_its_cuda_kernel_are_bit_exact(wl, floor, monkeypatch):
    """The NHWC32 grouped conv (schedules/tensorcore/grouped.py): its compute definition and its CUDA
    kernel's CPU twin (each __dp4a written as its four products) equal the NumPy reference; the
    reference equals the dense conv of each group; the CUDA source has the dp4a and 16-byte weight loads.
    With the grid-size floor lowered, each thread takes up to 2 output words and 4 pixels (what
    batch 64 gets)."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.schedules.kernel import written_kernel
    from tvm_qconv.schedules.tensorcore import grouped
    from tvm_qconv.target import cuda_source, make_target
    if floor is not None:
        monkeypatch.setattr(grouped, "MIN_THREADS", floor)
        go_words = grouped.group_widths(wl)[1] // 4
        assert grouped.words_per_thread(wl) == max(k for k in (1, 2) if go_words % k == 0)
    impl, args, w = _grouped_args(wl)
    ref = impl.reference(wl, *args)
    assert ref.shape == impl.out_shape(wl) and len(np.unique(ref)) > 50
    # the reference against torch's grouped conv on the same integers (float64 is exact here)
    x = torch.from_numpy(args[0][..., :wl.in_channels].astype(np.float64)).permute(0, 3, 1, 2)
    p = wl.padding[0]
    acc = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (p, p, p, p), value=wl.in_zero),
                                     torch.from_numpy(w.astype(np.float64)), stride=wl.stride, groups=wl.groups)
    acc = acc.permute(0, 2, 3, 1).numpy().astype(np.int64)
    o = wl.out_channels
    np.testing.assert_array_equal(ref[..., :o], requantize_ref(acc + args[2][:o].astype(np.int64), args[3][:o],
                                                               args[4][:o], wl.act_min, wl.act_max))
    func = impl.compute(wl)
    twin = written_kernel(func, grouped.grouped_kernel(wl, emulate_dp4a=True))
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"range(\1)", twin.script())
    for f in (func, tvmscript.parse(text)):
        np.testing.assert_array_equal(run(f, *args, out_shape=ref.shape, out_dtype="int8"), ref)
    target = make_target("cuda", "sm_90")
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": impl.schedule(func, target)}), target=target))
    # one 32-bit input word (or the zero point's) per tap and input word, 16-byte weight loads
    assert "__dp4a(xw_ptr[0]" in src and re.search(r"\*\(int4\*\)\(wv_ptr \+ \d+\) = \*\(int4\*\)\(wt_ptr", src)
    per_tap = 4 * grouped.words_per_thread(wl) * grouped.row_tile(wl)    # dp4a per tap and input word
    assert src.count("__dp4a(xw_ptr[0]") == wl.kernel[0] * wl.kernel[1] * per_tap


SUPER_GROUPS = [(wl, i) for wl, i in zip(GROUPED, GROUPED_IDS) if wl.groups > 1 and wl.in_channels == wl.out_channels] \
    + [(_grouped_wl(128, 128, 2, 5, 3, 2, in_zero=-128), "g64-s2-unsigned")]   # a group of 64: its own super-group


@pytest.mark.parametrize("wl", [wl for wl, _ in SUPER_GROUPS], ids=[i for _, i in SUPER_GROUPS])
def test_grouped_convs_as_super_group_gemms_compute_the_grouped_reference(wl):
    """schedules/tensorcore/grouped_gemm.py: each 32 output channels a GEMM of their 32 input channels
    with a block-diagonal weight equals the grouped conv (its reference: the same integers as torch's
    grouped conv, test above), padded output channels and unsigned inputs included; the mma.sync
    template schedules it with 32-column blocks and CUDA builds it."""
    from tvm_qconv.schedules.tensorcore import grouped, grouped_gemm
    from tvm_qconv.target import cuda_source, make_target
    impl = registry.get("conv2d.nhwc32.grouped_mma")
    _, args, w = _grouped_args(wl)
    x, (_, *channels) = args[0], args[1:]
    ours = [x, *impl.pack_params(wl, w, *[c[:wl.out_channels] for c in channels])]
    ref = impl.reference(wl, *ours)
    np.testing.assert_array_equal(ref, grouped.grouped_nhwc32_int8_ref(wl, *args))
    np.testing.assert_array_equal(run(impl.compute(wl), *ours, out_shape=ref.shape, out_dtype="int8"), ref)
    target = make_target("cuda", "sm_90a")
    decisions, _ = grouped_gemm.default_decisions(impl.compute(wl), 132)
    assert 16 * decisions["o"][1] * decisions["o"][2] == grouped_gemm.super_width(wl)   # a block: one super-group
    with target:   # built as a model's build does (the template's pass options: cp.async copies)
        src = cuda_source(registry.compile_kernel(impl, wl, target))
    assert "mma.sync.aligned.m16n8k32" in src and "ldmatrix" in src and "cp.async" in src


def test_grouped_gemms_take_equal_group_widths_dividing_32_and_are_preferred_from_groups_of_16():
    from tvm_qconv.target import TargetInfo, make_target
    impl = registry.get("conv2d.nhwc32.grouped_mma")
    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    regnet = _grouped_wl(160, 160, 10, 14, 3, 1, batch=64)
    # groups of 16 and 32 ran faster on the tensor cores, groups of 4 and 8 on dp4a (Conv2dGroupedMma)
    assert registry.select("conv2d", regnet, sm90) is impl
    assert registry.select("conv2d", _grouped_wl(256, 256, 8, 14, 3, 1), sm90) is impl           # groups of 32
    for narrow in (_grouped_wl(128, 128, 32, 14, 3, 1), _grouped_wl(256, 256, 32, 14, 3, 1)):    # groups of 4, 8
        assert impl.applies(narrow, sm90) and not impl.preferred(narrow, sm90)
        assert registry.select("conv2d", narrow, sm90).name == "conv2d.nhwc32.grouped"
        assert registry.select("conv2d", narrow, sm90, prefer="conv2d.nhwc32.grouped_mma") is impl
    # a tuning database's or --family's pick of the dp4a kernel still holds for groups of 16
    assert registry.select("conv2d", regnet, sm90, prefer="conv2d.nhwc32.grouped").name == "conv2d.nhwc32.grouped"
    assert not impl.applies(_grouped_wl(96, 96, 4, 14, 3, 1), sm90)       # 24 a group: does not divide 32
    assert not impl.applies(_grouped_wl(192, 192, 2, 14, 3, 1), sm90)     # 96 a group: no block tile that wide
    assert impl.applies(_grouped_wl(256, 256, 2, 14, 3, 1), sm90)         # 128 a group: one a block
    assert not impl.applies(_grouped_wl(64, 128, 4, 14, 3, 1), sm90)      # 16 in, 32 out a group
    assert not impl.applies(dataclasses.replace(regnet, table=True), sm90)


def test_the_grouped_nhwc32_kernel_applies_to_groups_of_4k_and_is_preferred_to_nchw4c():
    from tvm_qconv.target import TargetInfo, make_target
    impl = registry.get("conv2d.nhwc32.grouped")
    sm90, sm75 = (TargetInfo.from_target(make_target("cuda", a)) for a in ("sm_90a", "sm_75"))
    resnext = _grouped_wl(128, 128, 32, 56, 3, 1)
    assert impl.applies(resnext, sm90) and not impl.applies(resnext, sm75)    # NHWC32: int8 tensor-core GPUs
    assert not impl.applies(_grouped_wl(24, 24, 8, 8, 3, 1), sm90)            # 3 channels a group
    assert not impl.applies(_grouped_wl(32, 32, 32, 8, 3, 1), sm90)           # depthwise
    assert not impl.applies(_grouped_wl(32, 32, 1, 8, 3, 1), sm90)            # dense
    # untuned it takes these convs (no relayouts: measured faster, Conv2dGrouped's docstring); a
    # tuning database that measured the NCHW4c dp4a kernel faster for a layer still picks that one
    assert registry.select("conv2d", resnext, sm90) is impl
    assert registry.select("conv2d", resnext, sm90, prefer="conv2d.nchw4c.dp4a").name == "conv2d.nchw4c.dp4a"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["conv2d.nhwc32.grouped", "conv2d.nhwc32.grouped_mma"], ids=["dp4a", "mma"])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("c,groups,size,stride", [(128, 32, 56, 1), (160, 10, 14, 1), (224, 7, 28, 2)],
                         ids=["resnext-g4", "regnet-g16", "g32-s2"])
def test_grouped_kernels_on_gpu_are_bit_exact(name, batch, c, groups, size, stride):
    # ResNeXt's first stage (dp4a: one output word a thread; mma: 8 groups a super-group), RegNet-X's
    # groups of 16 and groups of 32 (dp4a: 2 words a thread at batch 64; mma: 2 and 1 a super-group)
    wl = _grouped_wl(c, c, groups, size, 3, stride, in_zero=-128, batch=batch)
    impl = registry.get(name)
    _, args, w = _grouped_args(wl, seed=4)
    args = [args[0], *impl.pack_params(wl, w, *[a[:c] for a in args[2:]])]
    ref = impl.reference(wl, *args)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, ref.shape), ref)


@pytest.mark.parametrize("wl", DEPTHWISE, ids=DEPTHWISE_IDS)
@pytest.mark.parametrize("layout", ["nchw4c", "nhwc32"])
def test_depthwise_kernel_and_its_schedules_are_bit_exact(wl, layout):
    # NCHW4c: the kernel of GPUs without int8 tensor cores and of the CPU; NHWC32: the one that
    # runs between tensor-core convs (sm_80+), without a relayout on either side
    from tvm_qconv import registry
    from tvm_qconv.target import cuda_source, make_target
    impl = registry.get(f"conv2d.{layout}.depthwise")
    layer = _depthwise_layer(wl)
    args = _packed(wl, impl, layer)
    ref = impl.reference(wl, *args)
    assert 0.05 < (ref != 0).mean() and wl.act_min <= ref.min() and ref.max() <= wl.act_max
    assert ref.shape == impl.out_shape(wl)
    # the other layout's reference computes the same numbers for the same layer
    other = registry.get(f"conv2d.{'nhwc32' if layout == 'nchw4c' else 'nchw4c'}.depthwise")
    np.testing.assert_array_equal(
        registry.layout(impl.layout).unpack(ref, wl.out_channels),
        registry.layout(other.layout).unpack(other.reference(wl, *_packed(wl, other, layer)), wl.out_channels))
    func = impl.compute(wl)
    target = make_target("cuda", "sm_90")
    cuda = impl.schedule(func, target)
    written = layout == "nhwc32" and wl.dilation == (1, 1) and wl.out_channels == wl.in_channels
    # the compute, the CUDA schedule's twin (the written-out dp4a kernel's: its byte moves and dot
    # products as integer arithmetic, depthwise_dp4a.py)
    schedules = [func, _gpu_twin(_written_depthwise(wl) if written else cuda)]
    if layout == "nchw4c":
        schedules.append(impl.schedule(func, make_target("llvm")))
    for f in schedules:
        np.testing.assert_array_equal(run(f, *args, out_shape=ref.shape, out_dtype="int8"), ref)
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": cuda}), target=target))
    if written:             # one int32 word per tap of 4 channels, 4 taps of a channel per __dp4a
        assert src.count("__dp4a(") > 2 and "__byte_perm(" in src and "a_ptr[" in src
    elif wl.out_channels == wl.in_channels:  # one int8x4 word per tap, not 4 bytes
        assert "*(int*)(A_ptr" in src


def _written_depthwise(wl, dp4a: bool = False):
    """The NHWC32 depthwise conv's written-out CUDA kernel for ``wl`` (``dp4a=False``: its CPU twin)."""
    from tvm_qconv.schedules.tensorcore.depthwise_dp4a import depthwise_dp4a_kernel
    return depthwise_dp4a_kernel(wl, dp4a=dp4a).with_attr("global_symbol", "main")


@pytest.mark.parametrize("wl", [DEPTHWISE[0], DEPTHWISE[4]], ids=["relu6_s2", "7x7_convnext"])
def test_depthwise_row_tile_is_bit_exact(wl, monkeypatch):
    """NHWC32's R pixels per thread (their input words loaded once per filter row) computes the
    reference; forced on these small layers by lowering the grid-size floor."""
    from tvm_qconv import registry
    from tvm_qconv.schedules.tensorcore import depthwise
    from tvm_qconv.target import make_target
    monkeypatch.setattr(depthwise, "MIN_THREADS", 1)
    assert depthwise.row_tile(wl) == {4: 4, 14: 7}[wl.out_width]
    impl = registry.get("conv2d.nhwc32.depthwise")
    args = _packed(wl, impl, _depthwise_layer(wl))
    ref = impl.reference(wl, *args)
    # the written-out dp4a kernel (its CPU twin) and the scheduled one (where the written one does not apply)
    scheduled = depthwise.schedule_cuda(impl.compute(wl), make_target("cuda", "sm_90"), written=False)
    for kernel in (_written_depthwise(wl), scheduled):
        np.testing.assert_array_equal(run(_gpu_twin(kernel), *args, out_shape=ref.shape, out_dtype="int8"), ref)


def test_the_written_depthwise_kernel_takes_a_table_epilogue_and_an_unsigned_input():
    """The dp4a kernel's twin with the SiLU-style table after the requantization (0 on the padded
    channels: 5 real of 32) and an unsigned input (its padding words read -128, the real zero)."""
    import dataclasses
    impl = registry.get("conv2d.nhwc32.depthwise")
    wl = dataclasses.replace(DEPTHWISE[2], in_zero=-128, table=True)
    args = _packed(wl, impl, _depthwise_layer(wl))
    table = RNG.integers(-128, 128, 256).astype(np.int8)
    ref = impl.reference(wl, *args, table)
    got = run(_gpu_twin(_written_depthwise(wl)), *args, table, out_shape=ref.shape, out_dtype="int8")
    np.testing.assert_array_equal(got, ref)
    assert (NHWC32.unpack(ref, 5) != 0).mean() > 0.5 and not ref[..., 5:].any()


def test_the_written_depthwise_kernel_leaves_dilation_and_channel_multipliers_to_the_schedule():
    from tvm_qconv.schedules.tensorcore.depthwise_dp4a import depthwise_dp4a_kernel
    assert depthwise_dp4a_kernel(DEPTHWISE[1]) is None            # multiplier 2, dilation 2
    assert depthwise_dp4a_kernel(W("none", batch=1, in_channels=8, height=9, width=9, out_channels=8, groups=8,
                                   dilation=(2, 2), padding=(2, 2, 2, 2))) is None


# EfficientNet-B0's first depthwise conv (3 x 3 over 112 x 112) and a 5 x 5 at stride 2, ConvNeXt-T's
# 7 x 7, an odd channel count (40 of 64: padded words) -- at batch 1 and 64
GPU_DEPTHWISE = [
    dict(in_channels=32, height=112, width=112, kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1)),
    dict(in_channels=144, height=56, width=56, kernel=(5, 5), stride=(2, 2), padding=(1, 2, 1, 2)),
    dict(in_channels=96, height=56, width=56, kernel=(7, 7), stride=(1, 1), padding=(3, 3, 3, 3)),
    dict(in_channels=40, height=28, width=28, kernel=(3, 3), stride=(2, 2), padding=(1, 1, 1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("conv", GPU_DEPTHWISE, ids=["3x3-112px", "5x5-s2", "7x7-convnext", "40ch-s2"])
def test_the_written_depthwise_kernel_on_gpu_is_bit_exact(conv, batch):
    wl = W("relu", batch=batch, out_channels=conv["in_channels"], groups=conv["in_channels"], **conv)
    impl = registry.get("conv2d.nhwc32.depthwise")
    args = _packed(wl, impl, _depthwise_layer(wl))
    ref = impl.reference(wl, *args)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, ref.shape), ref)


def test_depthwise_row_tile_keeps_the_grid_full():
    """8 pixels a thread for ConvNeXt-T's first 7 x 7 conv at batch 64; 1 at batch 1, where 8 would
    leave 73 blocks for an H100's 132 SMs."""
    from tvm_qconv.schedules.tensorcore.depthwise import row_tile
    conv = dict(in_channels=96, height=56, width=56, out_channels=96, groups=96, kernel=(7, 7), padding=(3, 3, 3, 3))
    assert row_tile(W("none", batch=64, **conv)) == 8
    assert row_tile(W("none", batch=1, **conv)) == 1


def test_concat_requantizes_each_branch_and_handles_channels_not_a_multiple_of_4():
    from tvm_qconv.schedules.concat_int8 import concat_int8, concat_int8_ref
    from tvm_qconv.schedules.nchw4c.layout import LAYOUT
    channels = [6, 8, 3]  # offsets 0, 6, 14: two branches start mid-word
    xs = [pack_nchw4c(RNG.integers(-127, 128, (2, c, 3, 5)).astype(np.int8)) for c in channels]  # symmetric int8
    m, s = quantize_multiplier(np.array([0.7, 1.0, 0.31]))  # 1.0: a branch already at the output scale
    out = run(concat_int8(LAYOUT, (2, 3, 5), channels, m.tolist(), s.tolist()), *xs, out_shape=(2, 5, 3, 5, 4),
              out_dtype="int8")
    ref = concat_int8_ref(LAYOUT, xs, channels, m, s)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(unpack_nchw4c(ref, 17)[:, 6:14], unpack_nchw4c(xs[1], 8))  # identity branch
    assert not unpack_nchw4c(out, 20)[:, 17:].any()  # padded channels of the last word are 0


def test_nhwc32_concat_requantizes_each_branch_and_handles_channels_not_a_multiple_of_32():
    """The tensor-core layout's concat (SqueezeNet's and Inception's branches on the GPU)."""
    from tvm_qconv.schedules.concat_int8 import concat_int8, concat_int8_ref
    from tvm_qconv.schedules.tensorcore.layout import LAYOUT, pack_nhwc32, unpack_nhwc32
    channels = [48, 32, 5]  # offsets 0, 48, 80: the second branch starts mid-group of 32
    xs = [pack_nhwc32(RNG.integers(-127, 128, (2, c, 3, 5)).astype(np.int8)) for c in channels]  # symmetric int8
    m, s = quantize_multiplier(np.array([0.7, 1.0, 0.31]))  # 1.0: a branch already at the output scale
    out = run(concat_int8(LAYOUT, (2, 3, 5), channels, m.tolist(), s.tolist()), *xs, out_shape=(2, 3, 5, 96),
              out_dtype="int8")
    ref = concat_int8_ref(LAYOUT, xs, channels, m, s)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(unpack_nhwc32(ref, 85)[:, 48:80], unpack_nhwc32(xs[1], 32))  # identity branch
    assert not out[..., 85:].any()  # padded channels are 0


def _shuffle(c: int, g: int) -> np.ndarray:
    """ShuffleNet's channel shuffle as an index: output j reads (j % g) * (c / g) + j // g."""
    return np.array([(j % g) * (c // g) + j // g for j in range(c)], np.int32)


# (input channels, index): ShuffleNet's 116-channel shuffle (116 is not a multiple of 32, its
# halves of 58 not of 4), the second half of a split, and a shuffle then a split composed
GATHERS = [(116, _shuffle(116, 2)), (116, np.arange(58, 116, dtype=np.int32)), (116, _shuffle(116, 2)[58:])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("channels,index", GATHERS, ids=["shuffle", "split_second_half", "shuffle_then_split"])
def test_channel_gather_moves_int8_values_by_channel_and_zeroes_the_padding(layout, channels, index):
    from tvm_qconv.schedules.channels_int8 import gather_channels_int8, gather_channels_int8_ref
    x = RNG.integers(-128, 128, (2, channels, 3, 5)).astype(np.int8)
    packed = layout.pack(x)
    out_shape = layout.packed_shape((2, len(index), 3, 5))
    out = run(gather_channels_int8(layout, (2, 3, 5), channels, len(index)), packed, index, out_shape=out_shape,
              out_dtype="int8")
    np.testing.assert_array_equal(out, gather_channels_int8_ref(layout, packed, channels, index))
    np.testing.assert_array_equal(layout.unpack(out, len(index)), x[:, index])  # the plain NumPy meaning
    padded = layout.pack(np.ones((2, len(index), 3, 5), np.int8)) == 0  # where the layout pads (58 and 116
    assert not out[padded].any()                                      # channels in NHWC32, 58 in NCHW4c)



@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("zeros,out_zero", [(None, 0), ([-128, -128], -128)], ids=["signed", "unsigned"])
@pytest.mark.parametrize("piece", [slice(0, 58), slice(58, 116), slice(0, 116)], ids=["first_half", "second_half", "all"])
def test_a_gather_of_a_concatenation_reads_the_branches_not_the_concatenation(layout, zeros, out_zero, piece):
    # ShuffleNet-V2's concat (58 passed-through channels, 58 of the branch) -> shuffle -> split piece,
    # one kernel: the concatenation's integers (each branch requantized) at the composed channels
    from tvm_qconv.schedules.concat_int8 import concat_int8, concat_int8_ref
    channels, index = [58, 58], _shuffle(116, 2)[piece]
    lo = -128 if out_zero else -127
    xs = [layout.pack(RNG.integers(lo, 128, (2, c, 3, 5)).astype(np.int8)) for c in channels]
    m, s = quantize_multiplier(np.array([1.0, 0.62]))     # the passed-through half already at the output scale
    args = (layout, (2, 3, 5), channels, m.tolist(), s.tolist(), zeros, out_zero)
    out = run(concat_int8(*args, gather=len(index)), *xs, index,
              out_shape=layout.packed_shape((2, len(index), 3, 5)), out_dtype="int8")
    joined = concat_int8_ref(layout, xs, channels, m, s, zeros, out_zero)
    np.testing.assert_array_equal(out, concat_int8_ref(layout, xs, channels, m, s, zeros, out_zero, index))
    np.testing.assert_array_equal(layout.unpack(out, len(index)), layout.unpack(joined, 116)[:, index])
    padded = layout.pack(np.ones((2, len(index), 3, 5), np.int8)) == 0
    assert not out[padded].any()


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,w,c", [(1, 28, 28, 116), (64, 28, 28, 116), (64, 14, 14, 232)],
                         ids=["b1_stage2", "b64_stage2", "b64_stage3"])
def test_a_gathering_concatenation_on_gpu_is_bit_exact(n, h, w, c):
    # ShuffleNet-V2's split piece of its shuffled concat, as the model build schedules it (the CUDA
    # kernel by lane, schedules/tensorcore/concat.py)
    from tvm_qconv.schedules.workload import ConcatWorkload
    impl = registry.get("concat.nhwc32")
    m, s = quantize_multiplier(np.array([1.0, 0.62]))
    wl = ConcatWorkload((n, h, w), (c // 2, c // 2), tuple(map(int, m)), tuple(map(int, s)), (-128, -128), -128,
                        gather=c // 2)
    xs = [impl.packing.pack(RNG.integers(-128, 128, (n, c // 2, h, w)).astype(np.int8)) for _ in range(2)]
    args = [*xs, *impl.pack_params(wl, _shuffle(c, 2)[c // 2:])]
    ref = impl.reference(wl, *args)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, ref.shape), ref)


def _nhwc32_concat_case(shape, channels, reals, zeros, out_zero, index=None, seed=0):
    """(implementation, workload, arguments, reference) of an NHWC32 concat (``index``: a gather's)."""
    from tvm_qconv.schedules.workload import ConcatWorkload
    impl = registry.get("concat.nhwc32")
    m, s = quantize_multiplier(np.array(reals))
    wl = ConcatWorkload(shape, tuple(channels), tuple(map(int, m)), tuple(map(int, s)), tuple(zeros), out_zero,
                        gather=0 if index is None else len(index))
    rng = np.random.default_rng(seed)
    n, h, w = shape
    xs = [impl.packing.pack(rng.integers(-128, 128, (n, c, h, w)).astype(np.int8)) for c in channels]
    args = [*xs, *([] if index is None else impl.pack_params(wl, index))]
    return impl, wl, args, impl.reference(wl, *args)


# (channels, multipliers, input zero points, output zero point, index): GoogLeNet's inception 3a
# (64 + 128 + 32 + 32, each branch at its own scale, signed and unsigned inputs); 48 + 80 + 16 (144
# channels padded to 160: blocks that store the padding); ShuffleNet's 58 + 58 plain and its split
# piece of the shuffled concat (the first branch passed through: a copy); 6 + 32 + 5 (3 inputs, mid-vector)
NHWC32_CONCATS = [((64, 128, 32, 32), [0.9, 1.3, 0.41, 1.0], (0, -128, 0, -128), -128, None),
                  ((48, 80, 16), [0.7, 1.0, 0.31], (-128, 0, 0), 0, None),
                  ((58, 58), [1.0, 0.62], (-128, -128), -128, None),
                  ((58, 58), [1.0, 0.62], (-128, -128), -128, _shuffle(116, 2)[58:]),
                  ((6, 32, 5), [0.5, 2.3, 0.8], (0, -128, 0), 0, None)]
NHWC32_CONCAT_IDS = ["googlenet", "padded", "shufflenet_plain", "shufflenet_gather", "three_mid_vector"]


@pytest.mark.parametrize("floor", [None, 1], ids=["grid-floor", "pixels-a-thread"])
@pytest.mark.parametrize("channels,reals,zeros,out_zero,index", NHWC32_CONCATS, ids=NHWC32_CONCAT_IDS)
def test_nhwc32_concat_cuda_kernel_stores_16_bytes_and_its_cpu_twin_computes_the_reference(
        channels, reals, zeros, out_zero, index, floor, monkeypatch):
    """The NHWC32 concat's CUDA kernel (schedules/tensorcore/concat.py): by input where every input
    is a run of 16-byte vectors (a 16-byte load each), by lane otherwise (byte loads); one 16-byte
    store per vector and pixel either way.  Its CPU twin (thread loops serial) is bit-exact against
    the NumPy reference, with 6 pixels a thread (the largest divisor of 2 x 3 x 5 up to 8) where
    the thread floor is lowered."""
    from tvm_qconv.schedules.tensorcore import affine as tc_affine
    from tvm_qconv.schedules.tensorcore import concat as tc_concat
    from tvm_qconv.target import cuda_source, make_target
    if floor is not None:
        monkeypatch.setattr(tc_affine, "MIN_THREADS", floor)
    impl, wl, args, ref = _nhwc32_concat_case((2, 3, 5), channels, reals, zeros, out_zero, index)
    vectors = ref.shape[-1] // 16
    p = tc_concat.grid(30, vectors)[0]
    assert p == (6 if floor else 1)
    target = make_target("cuda", "sm_90a")
    kernel = impl.schedule(impl.compute(wl), target)
    assert kernel.attrs["tvm_qconv.workload"] == impl.compute(wl).attrs["tvm_qconv.workload"]
    with target:
        src = cuda_source(registry.compile_kernel(impl, wl, target))
    loads = re.findall(r"\*\(int4\*\)\(xv_ptr \+ 0\) = \*\(int4\*\)\(x\d_ptr", src)
    stores = re.findall(r"\*\(int4\*\)\(y_ptr \+ [^;]*\) = \*\(int4\*\)\(yv_ptr", src)
    by_input = index is None and all(c % 16 == 0 for c in channels)
    # by input: a store per pixel in each run of blocks (the inputs', the padding's), a load per input's
    runs = len(channels) + (sum(channels) // 16 < vectors)
    assert (len(loads), len(stores)) == ((p * len(channels), p * runs) if by_input else (0, p)), src
    np.testing.assert_array_equal(run(_gpu_twin(kernel), *args, out_shape=ref.shape, out_dtype="int8"), ref)


def test_nhwc32_concat_requantization_rewrite_is_the_compute_definitions_on_every_int8():
    """The kernel's requantization (factors of two cancelled, zero points in the addend, int32 or a
    product's high word, unreachable clamp sides dropped) equals requantize_ref for all 256 inputs,
    at multipliers from 2**-33 (mult 0) to 1.3 * 2**21 (shift 9: the largest multiplier the int64
    form takes) and each pair of signed / unsigned zero points."""
    from tvm_qconv.schedules.tensorcore.concat import requantize
    rng = np.random.default_rng(3)
    reals = [1.0, 0.5, 2.0, 0.75, 2.0 ** -20, 2.0 ** -33, 4096.0, 1.3 * 2 ** 21, *rng.uniform(0.05, 4, 5),
             *2.0 ** rng.uniform(-30, 12, 5)]
    cases = [(int(m), int(s), z, oz) for (m, s) in zip(*quantize_multiplier(np.array(reals)))
             for z in (0, -128) for oz in (0, -128)]
    body = "\n".join(f'        Y[{k}, i] = T.Cast("int8", {requantize("X[i]", *c)})' for k, c in enumerate(cases))
    func = tvm.script.from_source(f'''
@T.prim_func
def main(X: T.Buffer((256,), "int8"), Y: T.Buffer(({len(cases)}, 256), "int8")):
    for i in range(256):
{body}
''')
    x = np.arange(-128, 128).astype(np.int8)
    out = run(func, x, out_shape=(len(cases), 256), out_dtype="int8")
    for row, (m, s, z, oz) in zip(out, cases):
        ref = requantize_ref(x - np.int64(z), np.int64(m), np.int64(s), QMIN if oz == 0 else -128, 127, zero=oz)
        np.testing.assert_array_equal(row, ref, err_msg=str((m, s, z, oz)))


def test_nhwc32_concat_keeps_dlights_kernel_where_the_written_one_does_not_apply():
    from tvm_qconv.schedules.tensorcore.concat import concat_kernel
    from tvm_qconv.schedules.workload import ConcatWorkload
    from tvm_qconv.target import make_target
    impl = registry.get("concat.nhwc32")
    m, s = (int(a[0]) for a in quantize_multiplier(np.array([0.7])))

    def wl(shape, mult=m, shift=s):
        return ConcatWorkload(shape, (64, 64), (mult, m), (shift, s))
    assert concat_kernel(wl((64, 128, 128))) is not None         # 2**30 output bytes
    assert concat_kernel(wl((64, 512, 512))) is None             # 2**31: indices past int32
    assert concat_kernel(wl((2, 3, 5), 1 << 30, 3)) is None      # a multiplier of 2**27
    cuda, llvm = make_target("cuda", "sm_90a"), tvm.target.Target("llvm")
    assert impl.schedule(impl.compute(wl((64, 512, 512))), cuda) is None    # None: dlight schedules it
    assert impl.schedule(impl.compute(wl((2, 3, 5))), llvm) is None         # the CPU runs the compute
    assert registry.get("concat.nchw4c").schedule(None, cuda) is None       # NCHW4c: dlight


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,w", [(1, 29, 27), (64, 15, 13)], ids=["b1", "b64"])
@pytest.mark.parametrize("channels,reals,zeros,out_zero,index", NHWC32_CONCATS, ids=NHWC32_CONCAT_IDS)
def test_nhwc32_concat_on_gpu_is_bit_exact(channels, reals, zeros, out_zero, index, n, h, w):
    impl, wl, args, ref = _nhwc32_concat_case((n, h, w), channels, reals, zeros, out_zero, index, seed=4)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, ref.shape), ref)

AVG_POOLS = [((3, 3), (1, 1), (1, 1, 1, 1)), ((2, 2), (2, 2), (0, 0, 0, 0))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("pool,stride,pad", AVG_POOLS, ids=["inception_3x3_s1_p1", "densenet_2x2_s2"])
def test_avg_pool_int8_matches_reference_and_float_within_half_a_step(pool, stride, pad, layout):
    x = packed_input(layout)
    s_in, s_out = 0.03, 0.02
    (m,), (s,) = quantize_multiplier(np.array([s_in / (pool[0] * pool[1] * s_out)]))
    ref = avg_pool2d_int8_ref(layout, x, pool, stride, pad, int(m), int(s))
    out = run(avg_pool2d_int8(layout, x.shape, pool, stride, pad, int(m), int(s)), x, out_shape=ref.shape,
              out_dtype="int8")
    np.testing.assert_array_equal(out, ref)
    exact = torch.nn.functional.avg_pool2d(torch.from_numpy(layout.unpack(x, 12).astype(np.float64) * s_in), pool,
                                           stride, pad[:2], count_include_pad=True).numpy() / s_out
    assert np.abs(layout.unpack(ref, 12) - np.clip(exact, QMIN, 127)).max() <= 0.5 + 1e-9  # one rounding
    assert not layout.unpack(out, layout.logical_shape(out.shape)[1])[:, 12:].any()  # padded channels stay 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
def test_affine_int8_is_batchnorm_and_relu_within_half_a_step_with_negative_gammas(layout):
    from tvm_qconv.schedules.affine_int8 import affine_int8, affine_int8_ref, pack_affine
    from tvm_qconv.schedules.requantize import affine_params
    x = packed_input(layout, (2, 12, 5, 4))
    rng = np.random.default_rng(5)   # its own draws: the bound below must not depend on the tests before it
    a, b = rng.normal(0, 1, 12), rng.normal(0, 0.5, 12)
    a[3] = 0.0  # a dead channel: its output is the bias alone
    args = pack_affine(layout, x.shape, *affine_params(a, b, 0.03, 0.05))
    ref = affine_int8_ref(layout, x, *args, 0, 127)
    out = run(affine_int8(layout, x.shape, 0, 127), x, *args, out_shape=x.shape, out_dtype="int8")
    np.testing.assert_array_equal(out, ref)
    exact = np.maximum(a[None, :, None, None] * layout.unpack(x, 12) * 0.03 + b[None, :, None, None], 0) / 0.05
    # half a step, plus the 15-bit multiplier's rounding over |q| <= 128 (requantize.affine_params)
    bound = 0.5 + 128 * np.abs(a).max() * 0.03 / 0.05 * 2.0 ** -15
    assert (a < 0).any() and np.abs(layout.unpack(ref, 12) - np.clip(exact, 0, 127)).max() <= bound
    assert not layout.unpack(out, layout.logical_shape(out.shape)[1])[:, 12:].any()  # padded channels stay 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
def test_an_affine_of_a_concatenation_reads_its_inputs_in_place(layout):
    """DenseNet's BatchNorm + ReLU of a concat nothing else reads: one kernel over the inputs, each
    channel at its input's own scale and zero point; equal to the float BatchNorm of the float
    concatenation within half a step (and the 15-bit multiplier's 128 * r * 2**-15, r <= ~3 here), and
    its CUDA schedule's CPU twin bit-exact.  Inputs of 6, 32
    and 5 channels: the later ones start mid-group in both layouts."""
    from tvm_qconv import registry
    from tvm_qconv.schedules.requantize import affine_params
    from tvm_qconv.schedules.workload import AffineWorkload
    from tvm_qconv.target import make_target
    channels, scales, zeros = (6, 32, 5), (0.03, 0.05, 0.02), (0, -128, 0)
    qs = [RNG.integers(-128 if z else -127, 128, (2, c, 3, 5)).astype(np.int8) for c, z in zip(channels, zeros)]
    a, b = RNG.normal(0, 1, 43), RNG.normal(0, 0.5, 43)
    s_y, z_y = 0.04, -128
    offsets = np.cumsum([0, *channels])
    parts = [affine_params(a[i:j], b[i:j], s, s_y, z) for i, j, s, z in zip(offsets, offsets[1:], scales, zeros)]
    mult, shift, bias = (np.concatenate([p[k] for p in parts]) for k in range(3))
    impl = registry.get(f"affine.{layout.name.lower()}")
    wl = AffineWorkload(layout.packed_shape((2, 43, 3, 5)), -128, 127, z_y, channels)
    args = [layout.pack(q) for q in qs] + impl.pack_params(wl, mult, shift, bias)
    ref = impl.reference(wl, *args)
    real = np.concatenate([(q.astype(np.float64) - z) * s for q, z, s in zip(qs, zeros, scales)], axis=1)
    exact = np.maximum(a[None, :, None, None] * real + b[None, :, None, None], 0) / s_y + z_y
    ratio = np.abs(a) * np.repeat(scales, channels) / s_y
    assert np.abs(layout.unpack(ref, 43) - np.clip(exact, -128, 127)).max() <= 0.5 + 128 * ratio.max() * 2 ** -15
    for func in (impl.compute(wl), _gpu_twin(impl.schedule(impl.compute(wl), make_target("cuda", "sm_90")))):
        np.testing.assert_array_equal(run(func, *args, out_shape=ref.shape, out_dtype="int8"), ref)


@pytest.mark.parametrize("shape", [(2, 40, 9, 7), (1, 3, 1, 13), (2, 64, 4, 4)], ids=["40ch", "3ch-tail", "64ch"])
def test_nhwc32_conversions_cuda_schedule_puts_threads_on_pixels_and_computes_the_reference(shape):
    """The float NCHW <-> int8 NHWC32 conversions on CUDA (dlight's read the float side a feature
    map apart per thread; 5.0 of EfficientNet-B0's 9.6 ms at batch 64): consecutive threads on
    consecutive pixels, a thread's channels one vector access of the int8 side; the CPU twins are
    bit-exact.  40 channels: vectors of 8 on the float side's 40; 3 channels at 13 pixels: the
    quantize's grid has a tail and the dequantize's vector is one channel (no vector access);
    64: vectors of 16."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.target import cuda_source, make_target

    def twin(func):
        text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"T.serial(\1)", func.script())
        return tvmscript.parse(text.replace('scope="local"', 'scope="global"'))

    x = RNG.normal(0, 1, shape).astype(np.float32)
    s = 0.021
    target = make_target("cuda", "sm_90")
    quant = registry.get("quantize.nhwc32.generic").schedule(NHWC32.quantize(shape, s), target)
    packed_shape = NHWC32.packed_shape(shape)
    deq = registry.get("dequantize.nhwc32.generic").schedule(NHWC32.dequantize(packed_shape, shape[1], s), target)
    with target:
        src = "".join(cuda_source(tvm.compile(tvm.IRModule({"main": f}), target=target)) for f in (quant, deq))
    if shape[1] % 8 == 0:  # the int8 side as one vector per thread: int2 (8 channels) or int4 (16)
        assert re.search(r"\*\(int[24]\*\)\(quantize_pack_ptr \+ [^;]*\) = \*\(int[24]\*\)\(quantize_pack_local", src), src
        assert re.search(r"\*\(int[24]\*\)\(X_local_ptr[^;]*\) = \*\(int[24]\*\)\(X_ptr", src), src
    ref = NHWC32.pack(quantize_ref(x, s))
    q = run(twin(quant), x, out_shape=ref.shape, out_dtype="int8")
    np.testing.assert_array_equal(q, ref)
    back = run(twin(deq), q, out_shape=shape, out_dtype="float32")
    np.testing.assert_array_equal(back, NHWC32.unpack(q, shape[1]).astype(np.float32) * np.float32(s))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
def test_lut_kernel_reads_its_table_and_zeroes_padded_channels(layout):
    """``out = table[x + 128]`` on every real channel, 0 on the padded ones (a table whose entry
    for 0 is not 0, as a sigmoid's); the CUDA schedule (vectorized elementwise) has a bit-exact
    CPU twin."""
    from tvm.script import parser as tvmscript

    from tvm_qconv.schedules.workload import LutWorkload
    from tvm_qconv.target import make_target

    x = packed_input(layout, (2, 5, 3, 7))  # 5 channels: padded to 8 (NCHW4c) or 32 (NHWC32)
    table = RNG.integers(-127, 128, 256).astype(np.int8)
    table[128] = 77  # f(0) != 0: the padded channels must still come out 0
    impl = next(i for i in registry.IMPLEMENTATIONS if i.op == "lut" and i.layout == layout.name)
    wl = LutWorkload((2, 3, 7), 5)
    func = impl.compute(wl)
    want = impl.reference(wl, x, table)
    np.testing.assert_array_equal(layout.unpack(want, 5), table[layout.unpack(x, 5).astype(np.int32) + 128])
    got = run(func, x, table, out_shape=x.shape, out_dtype="int8")
    np.testing.assert_array_equal(got, want)
    assert not got[layout.pack(np.ones((2, 5, 3, 7), np.int8)) == 0].any()  # padded channels: 0
    scheduled = impl.schedule(func, make_target("cuda", "sm_90"))
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"T.serial(\1)", scheduled.script())
    twin = tvmscript.parse(text.replace('scope="local"', 'scope="global"'))
    np.testing.assert_array_equal(run(twin, x, table, out_shape=x.shape, out_dtype="int8"), want)
