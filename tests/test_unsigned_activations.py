"""``QuantConfig.unsigned_activations``: never-negative tensors stored 0..255 at zero point -128
(``tvm_qconv/quantization/zero_points.py``), the kernels that read and write them, and what it buys."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import tvm
from torch import nn

from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.ranges import Calibrate
from tvm_qconv.schedules.dense_int8 import quantize_rows
from tvm_qconv.schedules.nchw4c.depthwise import depthwise_acc_nhwc
from tvm_qconv.schedules.nchw4c.layout import LAYOUT as NCHW4C
from tvm_qconv.schedules.pool_int8 import avg_pool2d_int8, avg_pool2d_int8_ref
from tvm_qconv.schedules.quantize import quantize_clamp, quantize_ref
from tvm_qconv.schedules.requantize import UNSIGNED_ZERO, quantize_multiplier
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32
from tvm_qconv.schedules.workload import ConvWorkload

RNG = np.random.default_rng(0)
CPU = tvm.cpu()
LAYOUTS = [NCHW4C, NHWC32]
Z = UNSIGNED_ZERO


def run(func, *arrays, out_shape, out_dtype):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype), CPU)
    lib["main"](*[tvm.runtime.tensor(a, CPU) for a in arrays], out)
    return out.numpy()


# ---- conversions -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
def test_unsigned_quantize_uses_all_256_levels_and_dequantizes_back_within_half_a_step(layout):
    s = 0.01
    x = RNG.uniform(-0.5, 3.0, (2, 5, 4, 3)).astype(np.float32)   # some below 0, some above 255 * s
    q = layout.unpack(run(layout.quantize(x.shape, s, Z), x, out_shape=layout.packed_shape(x.shape), out_dtype="int8"), 5)
    np.testing.assert_array_equal(q, quantize_ref(x, s, *quantize_clamp(Z)))
    assert q.min() == -128 and q.max() == 127          # 0 and 255 * s: the two ends of uint8
    np.testing.assert_array_equal(q[x < 0], -128)      # a negative value clamps to the real zero
    back = run(layout.dequantize(layout.packed_shape(x.shape), 5, s, Z), layout.pack(q), out_shape=x.shape,
               out_dtype="float32")
    inside = (x >= 0) & (x <= 255 * s)
    assert np.abs(back - x)[inside].max() <= s / 2 + 1e-6   # half of the unsigned step, half the symmetric one


def test_zero_points_other_than_0_and_minus_128_are_refused():
    with pytest.raises(ValueError, match="zero point must be 0"):
        quantize_clamp(-3)
    with pytest.raises(ValueError, match="in_zero must be 0 or -128"):
        ConvWorkload(1, 8, 4, 4, 8, kernel=(1, 1), padding=(0, 0, 0, 0), in_zero=5)


def test_quantize_rows_of_an_unsigned_input_pads_k_with_zeros():
    x = RNG.uniform(0, 2, (3, 10)).astype(np.float32)
    q = run(quantize_rows(x.shape, 0.01, 12, Z), x, out_shape=(3, 12), out_dtype="int8")
    np.testing.assert_array_equal(q[:, :10], quantize_ref(x, 0.01, *quantize_clamp(Z)))
    assert not q[:, 10:].any()   # the padded K reads zero weights whatever it holds


# ---- kernels -----------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 3])
def test_a_padded_conv_reads_the_zero_point_in_its_padding_so_the_bias_fold_is_exact(groups):
    # every conv family pads an unsigned input with -128 (v = 0): the kernel's sum of q = v - 128
    # plus 128 * sum(w) is the conv of v with zero padding at every pixel, border included
    from tvm_qconv.schedules.nchw4c.conv2d import (conv2d_nchw4c_int8_ref, pack_channels, pack_input_groups,
                                                   pack_oihw4o4i)
    wl = ConvWorkload.with_activation("none", batch=1, in_channels=6, height=7, width=5, out_channels=9,
                                      stride=(2, 1), padding=(1, 2, 0, 1), groups=groups, out_dtype="int32",
                                      in_zero=Z)
    v = RNG.integers(0, 256, (1, 6, 7, 5))
    w = RNG.integers(-127, 128, (9, 6 // groups, 3, 3))
    acc = conv2d_nchw4c_int8_ref(wl, pack_input_groups(v - 128, groups), pack_oihw4o4i(w, groups))
    acc_v = conv2d_nchw4c_int8_ref(dataclasses.replace(wl, in_zero=0), pack_input_groups(v, groups),
                                   pack_oihw4o4i(w, groups))
    fold = pack_channels(128 * w.reshape(9, -1).sum(axis=1), groups=groups)
    np.testing.assert_array_equal(acc + fold[None, :, None, None, :], acc_v)


def test_a_padded_conv_of_an_unsigned_input_keeps_the_family_a_symmetric_one_gets():
    # mma.sync's gather pads with -128; wgmma's TMA pads with 0, so its bias becomes a table per
    # border class (schedules/border_bias.py): 9 rows for a 3x3 conv with padding 1
    from tvm_qconv import registry
    from tvm_qconv.target import TargetInfo, make_target
    target = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    for batch, family in ((64, "conv2d.nhwc32.wgmma"), (1, "conv2d.nhwc32.mma")):
        wl = ConvWorkload.with_activation("relu", batch=batch, in_channels=256, height=56, width=56, out_channels=256)
        unsigned = dataclasses.replace(wl, in_zero=Z)
        assert registry.select("conv2d", wl, target).name == registry.select("conv2d", unsigned, target).name == family
        w = RNG.integers(-127, 128, (256, 256, 3, 3)).astype(np.int8)
        bias = registry.get(family).pack_params(unsigned, w, np.zeros(256, np.int32), np.ones(256, np.int32),
                                                np.ones(256, np.int32))[1]
        assert bias.shape == ((9, 256) if family.endswith("wgmma") else (256,))


@pytest.mark.parametrize("padding,stride", [((1, 1, 1, 1), (1, 1)), ((0, 0, 1, 1), (2, 2))], ids=["p1", "asym_s2"])
def test_depthwise_padding_reads_the_zero_point_so_the_bias_fold_is_exact(padding, stride):
    # the kernel sums q = v - 128 (v: the uint8 value); padded taps read -128 (v = 0), so
    # acc(q) + 128 * sum(w) is the conv of v with zero padding at every pixel, border included
    wl = ConvWorkload.with_activation("relu", batch=1, in_channels=8, height=7, width=6, out_channels=8, groups=8,
                                      padding=padding, stride=stride, in_zero=Z)
    v = RNG.integers(0, 256, (1, 7, 6, 8))
    taps = RNG.integers(-127, 128, (3, 3, 8))
    acc = depthwise_acc_nhwc(wl, v - 128, taps) + 128 * taps.sum(axis=(0, 1))
    np.testing.assert_array_equal(acc, depthwise_acc_nhwc(dataclasses.replace(wl, in_zero=0), v, taps))


@pytest.mark.parametrize("layout", ["nchw4c", "nhwc32"])
def test_depthwise_kernel_with_an_unsigned_input_is_bit_exact_against_its_reference(layout):
    from tvm_qconv import registry
    wl = ConvWorkload.with_activation("clip", -128, 60, batch=1, in_channels=12, height=9, width=9, out_channels=12,
                                      groups=12, stride=(2, 2), padding=(1, 1, 1, 1), in_zero=Z)
    impl = registry.get(f"conv2d.{layout}.depthwise")
    x = RNG.integers(-128, 128, (1, 12, 9, 9)).astype(np.int8)
    w = RNG.integers(-127, 128, (12, 1, 3, 3)).astype(np.int8)
    b = RNG.integers(-2000, 2000, 12).astype(np.int32)
    m, s = quantize_multiplier(RNG.uniform(3e-3, 3e-2, 12))
    args = [registry.layout(impl.layout).pack(x), *impl.pack_params(wl, w, b, m, s)]
    ref = impl.reference(wl, *args)
    assert ref.min() == -128 and ref.max() == 60   # the unsigned output's clamp: [real 0, ReLU6's bound]
    np.testing.assert_array_equal(run(impl.compute(wl), *args, out_shape=ref.shape, out_dtype="int8"), ref)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ly: ly.name)
@pytest.mark.parametrize("out_zero", [Z, 0], ids=["to_unsigned", "to_signed"])
def test_avg_pool_of_an_unsigned_tensor_is_the_float_average_within_half_a_step(layout, out_zero):
    v = RNG.integers(0, 256, (2, 12, 9, 7))               # the uint8 values; stored minus 128
    x = layout.pack((v - 128).astype(np.int8))
    pool, stride, pad = (3, 3), (1, 1), (1, 1, 1, 1)      # Inception's: the padding counts as zeros
    s_in, s_out = 0.02, 0.01 if out_zero else 0.025
    (m,), (s,) = quantize_multiplier(np.array([s_in / (9 * s_out)]))
    ref = avg_pool2d_int8_ref(layout, x, pool, stride, pad, int(m), int(s), Z, out_zero)
    out = run(avg_pool2d_int8(layout, x.shape, pool, stride, pad, int(m), int(s), Z, out_zero), x,
              out_shape=ref.shape, out_dtype="int8")
    np.testing.assert_array_equal(out, ref)
    exact = torch.nn.functional.avg_pool2d(torch.from_numpy(v * s_in), pool, stride, pad[:2],
                                           count_include_pad=True).numpy() / s_out + out_zero
    got = layout.unpack(ref, 12).astype(np.float64)
    assert np.abs(got - np.clip(exact, -128, 127)).max() <= 0.5 + 1e-9   # one rounding


def test_add_concat_and_affine_subtract_their_inputs_zero_points_exactly():
    # each kernel against its reference, and the reference against the real-valued definition:
    # (q_a + 128) * s_a + q_b * s_b requantized at s_y, then stored minus 128 (an unsigned output)
    from tvm_qconv.schedules.add_int8 import add_int8, add_int8_ref
    from tvm_qconv.schedules.affine_int8 import affine_int8, affine_int8_ref, pack_affine
    from tvm_qconv.schedules.concat_int8 import concat_int8, concat_int8_ref
    from tvm_qconv.schedules.requantize import add_multipliers, affine_params
    shape = (2, 8, 5, 5)
    qa = RNG.integers(-128, 128, shape).astype(np.int8)         # unsigned: v = q + 128
    qb = RNG.integers(-127, 128, shape).astype(np.int8)         # symmetric
    s_a, s_b, s_y = 0.01, 0.02, 0.015
    ma, mb, sh = add_multipliers(s_a, s_b, s_y)
    for zeros in [(Z, 0, Z), (Z, Z, 0), (0, 0, Z), (Z, Z, Z)]:
        qa_in = qa if zeros[0] else qb[::-1].copy()
        qb_in = qb if zeros[1] == 0 else RNG.integers(-128, 128, shape).astype(np.int8)
        lo = -128 if zeros[2] else 0                            # ReLU at the output's zero
        ref = add_int8_ref(qa_in, qb_in, ma, mb, sh, lo, 127, zeros)
        np.testing.assert_array_equal(run(add_int8(shape, ma, mb, sh, lo, 127, zeros=zeros), qa_in, qb_in,
                                          out_shape=shape, out_dtype="int8"), ref)
        real = np.maximum((qa_in.astype(np.float64) - zeros[0]) * s_a + (qb_in.astype(np.float64) - zeros[1]) * s_b, 0)
        assert np.abs(ref - np.clip(real / s_y + zeros[2], lo, 127)).max() <= 0.5 + 1e-6  # one rounding
    from tvm_qconv.schedules.add_int8 import split_multipliers
    assert split_multipliers(ma, mb, sh, span=256) is not None      # the 32-bit form above; the int64 one:
    assert split_multipliers(3, 5, 1, span=256) is None
    np.testing.assert_array_equal(run(add_int8(shape, 3, 5, 1, -128, 127, zeros=(Z, Z, Z)), qa, qa[::-1].copy(),
                                      out_shape=shape, out_dtype="int8"),
                                  add_int8_ref(qa, qa[::-1].copy(), 3, 5, 1, -128, 127, (Z, Z, Z)))
    layout = NHWC32
    xs = [layout.pack(qa), layout.pack(qb)]
    (m1, m2), (h1, h2) = quantize_multiplier(np.array([s_a / s_y, s_b / s_y]))
    ref = concat_int8_ref(layout, xs, [8, 8], [m1, m2], [h1, h2], [Z, 0], Z)
    out = run(concat_int8(layout, (2, 5, 5), [8, 8], [int(m1), int(m2)], [int(h1), int(h2)], [Z, 0], Z), *xs,
              out_shape=ref.shape, out_dtype="int8")
    np.testing.assert_array_equal(out, ref)
    real = np.concatenate([(qa + 128.0) * s_a, qb * s_b], axis=1) / s_y - 128
    assert np.abs(layout.unpack(ref, 16) - np.clip(real, -128, 127)).max() <= 0.5 + 1e-6
    gamma, beta = RNG.uniform(-2, 2, 8), RNG.uniform(-1, 1, 8)
    mult, shift, bias = affine_params(gamma, beta, s_a, s_y, Z)
    args = [layout.pack(qa), *pack_affine(layout, layout.packed_shape(shape), mult, shift, bias)]
    ref = affine_int8_ref(layout, *args, -128, 127, Z)                  # BatchNorm + ReLU, unsigned in and out
    np.testing.assert_array_equal(run(affine_int8(layout, args[0].shape, -128, 127, Z), *args,
                                      out_shape=args[0].shape, out_dtype="int8"), ref)
    real = np.maximum(gamma[None, :, None, None] * (qa + 128.0) * s_a + beta[None, :, None, None], 0) / s_y - 128
    # one rounding, and the 15-bit multiplier's 128 * r * 2**-15 (requantize.affine_params)
    r = np.abs(gamma).max() * s_a / s_y
    assert np.abs(layout.unpack(ref, 8) - np.clip(real, -128, 127)).max() <= 0.5 + 128 * r * 2 ** -15


# ---- the pass ----------------------------------------------------------------------------

class MobileBlock(nn.Module):
    """A stem, a MobileNet-V2 block (1x1 expand, ReLU6 depthwise, 1x1 project), a max pool into a
    padded 3x3 conv, global average pool, linear: every kind of reader the plan decides on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.expand = nn.Conv2d(16, 32, 1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.project = nn.Conv2d(32, 16, 1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        a = torch.relu(self.stem(x))
        b = nn.functional.relu6(self.expand(a))
        c = nn.functional.relu6(self.dw(b))
        d = nn.functional.max_pool2d(torch.relu(self.project(c)), 2)
        f = torch.relu(self.conv(d))
        return self.fc(nn.functional.adaptive_avg_pool2d(f, 1).flatten(1))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    photos = skimage_photos(32)[:4]
    out = {}
    for unsigned in (False, True):
        res = compile_model(MobileBlock().eval(), str(tmp_path_factory.mktemp("u") / "m.so"), name="block",
                            options=BuildOptions(image_size=32, accuracy_target_db=99),  # 99: per-layer SQNR
                            config=QuantConfig(num_calib_images=4, unsigned_activations=unsigned),
                            ranges=Calibrate(photos), progress=False)
        out[unsigned] = res.report
    return out


def test_the_plan_makes_unsigned_what_every_reader_can_take(builds):
    # stem, expand, dw outputs: read by 1x1 / depthwise convs; project's: by a max pool whose output
    # (the same integers, conv.in0) a padded 3x3 conv reads, its padding -128; conv's: by the
    # average pool, whose output reaches the linear layer through a flatten
    assert builds[True]["unsigned"] == ["avg_pool2d_0.out", "conv.in0", "conv.out", "dw.out", "expand.out", "fc.in0",
                                        "project.out", "stem.out"]
    assert builds[False]["unsigned"] == []
    kinds = {r["layer"]: r for r in builds[True]["layers"]}
    assert kinds["stem"]["kind"] == "conv2d+bias+clip[-128,127]"      # ReLU at zero point -128
    assert kinds["project"]["kind"] == "conv2d+bias+clip[-128,127]" and kinds["project"]["shape"].endswith("u8 @32x32 b1")
    assert kinds["conv"]["shape"].endswith("u8 @16x16 b1")              # the padded 3x3 conv reads it


def test_unsigned_tensors_halve_the_rounding_step_and_the_logits_gain(builds):
    # the stem's output is rounded at amax / 255 instead of amax / 127; its noise also holds the
    # (identical) input's, so it gains less than 6 dB; the logits gain what every tensor gains
    # (measured: stem 37.9 -> 40.6 dB, logits 57.6 -> 61.0 dB)
    layer = {u: {r["layer"]: r["sqnr_db"] for r in builds[u]["verify"]["layers"]} for u in (False, True)}
    assert layer[True]["stem"] > layer[False]["stem"] + 2.0
    assert builds[True]["verify"]["logits_sqnr_db"] > builds[False]["verify"]["logits_sqnr_db"] + 2.0


def test_onnx_export_writes_zero_point_minus_128_where_the_library_keeps_a_tensor_unsigned(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    from tvm_qconv.evaluate import sqnr_db
    from tvm_qconv.onnx_export import export_onnx
    from tvm_qconv.ranges import GivenRanges
    from tvm_qconv.runtime import CompiledModel
    photos = skimage_photos(32)
    # bias correction off: the library below is built from the export's ranges alone (no channel means)
    config = QuantConfig(num_calib_images=4, unsigned_activations=True, bias_correction=False)
    res = export_onnx(MobileBlock().eval(), str(tmp_path / "m.onnx"), input_shape=(1, 3, 32, 32), config=config,
                      ranges=Calibrate(photos[:4]), progress=False)
    lib = compile_model(MobileBlock().eval(), str(tmp_path / "m.so"), options=BuildOptions(image_size=32, verify=False),
                        config=config, ranges=GivenRanges(res.amax), progress=False)
    model = onnx.load(str(tmp_path / "m.onnx"))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    zeros = [int(init[n.input[2]]) for n in model.graph.node if n.op_type == "QuantizeLinear"]
    # stem, expand, dw, project, max pool and conv outputs, the average pool's and the linear layer's
    # input: the eight of the plan
    assert zeros.count(-128) == len(lib.report["unsigned"]) == 8
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # without it ONNX Runtime's x86 path rewrites the int8 Q/DQ pairs to uint8 and, at zero
    # point -128, computes other numbers: 23.7 dB from the library and from float (measured)
    so.add_session_config_entry("session.qdqisint8allowed", "1")
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"]).run(
        None, {"input": photos})[0]
    library = CompiledModel(lib.lib_path)
    ref = np.concatenate([library(photos[i:i + 1]) for i in range(len(photos))])
    # rounding differences only (ONNX: half to even, float requantize; the library: fixed point):
    # measured 80.6 dB (77.7 with ONNX Runtime's optimizations off), the library 59.8 dB from float
    assert sqnr_db(ref, got) >= 65.0


@pytest.mark.gpu
# Joins: 5 unsigned outputs (stem, left, right, the affine, the add) since cc4bf6f, where the BatchNorm
# reads its concat in place (graph._concats_into_affines) and the concat is no output of its own; 6 before
@pytest.mark.parametrize("model,unsigned_outputs", [("MobileBlock", 7), ("Joins", 5)])
def test_cuda_build_of_unsigned_tensors_equals_the_cpu_build_integer_for_integer(model, unsigned_outputs, tmp_path):
    # MobileBlock: the tensor-core 1x1 convs reading u8 (bias fold), the NHWC32 depthwise padding
    # with -128, the padded 3x3 conv's gather filling -128, the average pool's zero points; Joins: the concat, affine, add and table kernels
    # with zero points under their CUDA schedules; each against the llvm build
    from tvm_qconv import registry
    from tvm_qconv.runtime import CompiledModel
    from tvm_qconv.target import device_arch
    x = np.random.default_rng(0).normal(0, 1, (8, 3, 32, 32)).astype(np.float32)
    outs, exposed = {}, {}
    for target in ("llvm", "cuda"):
        lib = compile_model(globals()[model]().eval(), str(tmp_path / f"{target}.so"),
                            config=QuantConfig(num_calib_images=8, unsigned_activations=True),
                            options=BuildOptions(target=target, arch=device_arch() if target == "cuda" else None,
                                                 batch=8, image_size=32, expose_activations=True),
                            ranges=Calibrate(x), progress=False)
        outs[target] = CompiledModel(lib.lib_path).outputs(x)
        exposed[target] = lib.report["exposed"]
    assert [e["zero"] for e in exposed["cuda"]] == [e["zero"] for e in exposed["llvm"]]
    assert sum(e["zero"] == Z for e in exposed["cuda"]) == unsigned_outputs
    for e_cpu, e_gpu, a, b in zip(exposed["llvm"], exposed["cuda"], outs["llvm"][1:], outs["cuda"][1:]):
        np.testing.assert_array_equal(registry.layout(e_cpu["layout"]).unpack(a, e_cpu["channels"]),
                                      registry.layout(e_gpu["layout"]).unpack(b, e_gpu["channels"]))
    np.testing.assert_allclose(outs["llvm"][0], outs["cuda"][0], rtol=1e-5, atol=1e-5)  # float dense epilogue


def test_the_cli_flag_turns_it_on_and_a_qat_checkpoint_refuses_it(capsys):
    import deploy
    args = deploy.build_parser().parse_args(["build", "--model", "resnet18", "--unsigned-activations", "-o", "x.so"])
    assert deploy.quant_config(args).unsigned_activations
    assert not deploy.quant_config(deploy.build_parser().parse_args(["build", "--model", "resnet18", "-o", "x.so"])
                                   ).unsigned_activations
    # a QAT checkpoint's ranges were learned for the symmetric grid its fake quantizers use
    assert deploy.main(["build", "--checkpoint", "ckpt.pt", "--unsigned-activations", "-o", "x.so"]) == 2
    assert "--unsigned-activations cannot be used with --checkpoint" in capsys.readouterr().err


class DeadChannel(nn.Module):
    """A 1x1 conv + ReLU whose first filter is ~1e-9 of the others (a dead channel: its
    requantize multiplier M underflows), read by another 1x1 conv: -128 / M fits no int32 bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 1)
        self.c2 = nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.c1.weight[0] *= 1e-9
            self.c1.bias[0] = 0.0

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x))).mean((2, 3))


def test_an_output_whose_zero_point_fits_no_int32_bias_stays_symmetric(tmp_path):
    # folded as -128 / M, the zero point of the dead channel would saturate the bias and read 0.5
    # of the range there instead of 0; the layer's output is made symmetric instead, and says so
    photos = skimage_photos(16)[:4]
    res = compile_model(DeadChannel().eval(), str(tmp_path / "d.so"), name="dead", options=BuildOptions(image_size=16),
                        config=QuantConfig(num_calib_images=4, unsigned_activations=True), ranges=Calibrate(photos),
                        progress=False)
    assert res.report["unsigned_fallback"] == ["c1.out"] and "c1.out" not in res.report["unsigned"]
    assert not any(r.get("bias_saturated") for r in res.report["layers"])
    assert res.report["verify"]["logits_sqnr_db"] > 35.0   # measured 41.0 (the symmetric build: 41.0); -2.3 dB saturated


class FloatGroupedReader(nn.Module):
    """A ReLU output read by a grouped conv whose weight is computed at run time (kept float)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 1)
        self.w = nn.Parameter(torch.randn(8, 4, 3, 3))

    def forward(self, x):
        h = torch.relu(self.c1(x))
        return nn.functional.conv2d(h, self.w * h.mean(), padding=1, groups=2).mean((2, 3))


def test_a_float_conv_reads_an_unsigned_tensor_dequantized(tmp_path):
    # the plan asked such a conv for its groups' input channels from a weight it does not have
    photos = skimage_photos(16)[:4]
    sqnr = {}
    for unsigned in (False, True):
        res = compile_model(FloatGroupedReader().eval(), str(tmp_path / f"f{unsigned}.so"), name="f",
                            options=BuildOptions(image_size=16), ranges=Calibrate(photos), progress=False,
                            config=QuantConfig(num_calib_images=4, unsigned_activations=unsigned))
        sqnr[unsigned] = res.report["verify"]["logits_sqnr_db"]
    assert res.report["unsigned"] == ["c1.out"]   # its readers: the float conv and the mean, both float
    # this network amplifies c1's rounding (its conv weight scales with mean(h)): 14.2 dB both ways
    assert sqnr[True] > sqnr[False] - 1.0


class Joins(nn.Module):
    """Branches concatenated, a pre-activation BatchNorm (an affine layer), a residual add with
    ReLU, a SiLU (a lookup table): the joins that read and make unsigned tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.left, self.right = nn.Conv2d(16, 8, 1), nn.Conv2d(16, 8, 1)
        self.bn = nn.BatchNorm2d(16)
        self.proj = nn.Conv2d(16, 16, 1)
        self.head = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16, 10)
        with torch.no_grad():
            self.bn.running_mean.uniform_(0.1, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        a = torch.relu(self.stem(x))
        c = torch.cat([torch.relu(self.left(a)), torch.relu(self.right(a))], 1)
        f = torch.relu(self.proj(torch.relu(self.bn(c))) + a)
        h = self.head(nn.functional.silu(f))
        return self.fc(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def test_joins_read_and_make_unsigned_tensors(tmp_path):
    photos = skimage_photos(32)[:4]
    reports = {}
    for unsigned in (False, True):
        reports[unsigned] = compile_model(
            Joins().eval(), str(tmp_path / f"j{unsigned}.so"), name="joins", ranges=Calibrate(photos), progress=False,
            options=BuildOptions(image_size=32, accuracy_target_db=99),   # 99: the per-layer SQNR
            config=QuantConfig(num_calib_images=4, unsigned_activations=unsigned)).report
    # the stem's output (read by the 1x1 convs and the add), the branches' (the BatchNorm reads their
    # concat in place), the BatchNorm's (an affine layer) and the add's (read by the SiLU table); the
    # head has no ReLU
    assert reports[True]["unsigned"] == ["add_0.out", "affine_0.out", "left.out", "right.out", "stem.out"]
    assert [r["kind"] for r in reports[True]["layers"] if r["layer"] in ("affine_0", "add_0")] == [
        "concat x2+batch_norm+clip[-128,127]", "add+clip[-128,127]"]
    layer = {u: {r["layer"]: r["sqnr_db"] for r in reports[u]["verify"]["layers"]} for u in (False, True)}
    # every unsigned tensor is closer to float (measured +2.7 to +4.1 dB), and so are the table
    # and the head that read them (+1.8, +1.1).  The logits, 40 numbers here, moved 49.4 -> 47.7 dB:
    # at this level their SQNR swings with single roundings of the classifier's input.
    for name in ("stem", "left", "right", "affine_0", "add_0"):
        assert layer[True][name] > layer[False][name] + 1.5, name
    assert layer[True]["lut_0"] > layer[False]["lut_0"] and layer[True]["head"] > layer[False]["head"]
    assert reports[True]["verify"]["logits_sqnr_db"] > 40.0


def test_a_non_boolean_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="unsigned_activations must be True, False or None .where calibrated., got 'yes'"):
        QuantConfig(unsigned_activations="yes")
