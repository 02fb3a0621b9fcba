"""Squeeze-excite in int8 (issue 34): the global mean as an int8 average pool, the gated multiply
as one int8 kernel (``schedules/scale_int8.py``) reading the feature map in int8 and its float gate
per (image, channel); no float copy of the feature map."""
import numpy as np
import pytest
import torch
from torch import nn

from tests.cuda_vs_cpu import assert_cuda_build_equals_cpu_build
from tvm_qconv import registry
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.schedules import scale_int8
from tvm_qconv.schedules.workload import ScaleWorkload
from tvm_qconv.target import make_target

RNG = np.random.default_rng(0)


def _run(impl, wl, *args):
    import tvm
    lib = registry.compile_kernel(impl, wl, make_target("llvm"))
    dev = tvm.cpu()
    out = tvm.runtime.empty(impl.out_shape(wl), "int8", dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("layout", ["NCHW4c", "NHWC32"])
@pytest.mark.parametrize("zeros", [(0, 0), (-128, 0), (-128, -128)], ids=["symmetric", "unsigned-in", "unsigned"])
@pytest.mark.parametrize("gate_table", [False, True], ids=["float-gate", "gate-table"])
def test_the_scale_kernel_is_its_numpy_twin_and_the_float_product_rounded(layout, zeros, gate_table):
    packing = registry.layout(layout)
    impl = registry.get(f"scale.{layout.lower()}")
    s_x, s_y = 0.05, 0.03
    table = (1.0 / (1.0 + np.exp(-0.1 * np.arange(-128, 128)))).astype(np.float32)  # a sigmoid at scale 0.1
    shift = scale_int8.gate_shift(table, s_x / s_y) if gate_table else 0
    wl = ScaleWorkload((2, 5, 3), 7, s_x / s_y, *zeros, gate_table=gate_table, gate_shift=shift)  # 7 channels: padded
    q = RNG.integers(-128 if zeros[0] else -127, 128, (2, 7, 5, 3)).astype(np.int8)
    x = packing.pack(q)
    if gate_table:   # the gate conv's int8 output and the table of its 256 values
        logits = RNG.integers(-127, 128, (2, 7, 1, 1)).astype(np.int8)
        gate = table[logits.astype(int) + 128]
        args = (x, packing.pack(logits), *impl.pack_params(wl, table))
    else:
        gate = RNG.random((2, 7, 1, 1)).astype(np.float32)
        args = (x, gate)
    got = _run(impl, wl, *args)
    assert np.array_equal(got, impl.reference(wl, *args))   # bit for bit, padded channels 0
    # the float path it replaces: dequantize, multiply, quantize at s_y (one rounding step at most,
    # where the fixed-point rescale rounds a tie the other way)
    real = (q.astype(np.float64) - zeros[0]) * s_x * gate
    want = np.clip(np.rint(real / s_y) + zeros[1], -127 if zeros[1] == 0 else -128, 127)
    assert np.abs(packing.unpack(got, 7).astype(int) - want).max() <= 1



def test_the_gate_tables_fixed_point_keeps_every_entry_below_2_to_the_22_and_gives_up_on_huge_gates():
    """The gate table's shift (scale_int8.gate_shift) is the largest that keeps the int32 products
    (a 9-bit difference times an entry) below 2**31; a gate no shift fits stays float (None)."""
    sigmoid = (1.0 / (1.0 + np.exp(-0.1 * np.arange(-128, 128)))).astype(np.float32)
    s = scale_int8.gate_shift(sigmoid, 0.05 / 0.03)
    mult = scale_int8.gate_multipliers(sigmoid, 0.05 / 0.03, s)
    assert mult.dtype == np.int32 and 2 ** 21 <= np.abs(mult).max() < 2 ** 22    # the largest shift
    assert scale_int8.gate_shift(sigmoid, 1e-12) == scale_int8.MAX_SHIFT        # capped: the rounding term fits
    assert scale_int8.gate_shift(np.full(256, 1e9, np.float32), 1.0) is None
    with pytest.raises(ValueError, match="choose the shift with gate_shift"):
        scale_int8.gate_multipliers(sigmoid, 0.05 / 0.03, s + 1)

class SqueezeExcite(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU())
        self.fc1, self.fc2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.head = nn.Sequential(nn.Conv2d(16, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))
        return self.head(x * gate)


def test_a_squeeze_excite_block_runs_in_int8_with_only_its_gate_in_float(tmp_path):
    photos = skimage_photos(32)
    model = SqueezeExcite().eval()
    res = compile_model(model, str(tmp_path / "se.so"), options=BuildOptions(image_size=32),
                        config=QuantConfig(num_calib_images=4), ranges=Calibrate(photos[:4]), progress=False)
    kinds = {r["kind"].split("+")[0]: r["dtype"] for r in res.report["layers"]}
    assert kinds["scale"] == "int8" and kinds["avg_pool2d"] == "int8" and kinds["lut"] == "int8"
    assert all(r["dtype"] == "int8" for r in res.report["layers"])
    # what stays float: the classifier's flatten; the gate's sigmoid is a table the scale kernel reads
    # on the second 1x1 conv's int8 output
    assert res.report["float_ops"] == {"relax.reshape": 1}
    (scale,) = [r for r in res.report["layers"] if r["kind"] == "scale"]
    assert scale["shape"].endswith("by a gate table of its int8 input")
    # no feature map leaves int8: the only dequantizes are of [N, C, 1, 1] tensors (the gate's input, the pool)
    assert not any(c.startswith("quantize") and "x (" not in c for c in res.report["conversions"]), \
        res.report["conversions"]
    with torch.no_grad():
        ref = model(torch.from_numpy(photos[4:8])).numpy()
    got = np.concatenate([CompiledModel(res.lib_path)(p[None]) for p in photos[4:8]])
    # measured 53.5 dB (2026-11-27): the int8 noise of four layers; a wrong gate or rescale is noise (~0 dB)
    assert sqnr_db(ref, got) > 45.0


def test_a_gate_table_past_the_fixed_point_keeps_the_float_gate_and_says_why(tmp_path, monkeypatch):
    # no real sigmoid or hard-sigmoid gets here (their values are at most 1); a gate chain whose values
    # no shift fits would, and must not be mis-scaled
    monkeypatch.setattr(scale_int8, "gate_shift", lambda values, rescale: None)
    photos = skimage_photos(32)
    model = SqueezeExcite().eval()
    res = compile_model(model, str(tmp_path / "se.so"), options=BuildOptions(image_size=32),
                        config=QuantConfig(num_calib_images=4), ranges=Calibrate(photos[:4]), progress=False)
    (scale,) = [r for r in res.report["layers"] if r["kind"] == "scale"]
    assert scale["dtype"] == "int8" and "by a float gate (its table's largest gate" in scale["shape"], scale
    with torch.no_grad():
        ref = model(torch.from_numpy(photos[4:8])).numpy()
    got = np.concatenate([CompiledModel(res.lib_path)(p[None]) for p in photos[4:8]])
    assert sqnr_db(ref, got) > 45.0      # the float gate's path: the same accuracy as the table's


@pytest.mark.gpu
def test_the_cuda_build_of_a_squeeze_excite_net_equals_its_cpu_build(tmp_path):
    """Every int8 activation, the channel scale's and the large global pool's (its own NHWC32
    kernels, tensorcore/global_pool.py) included, integer for integer; at 48 px the first map is
    2,304 pixels."""
    layers = assert_cuda_build_equals_cpu_build(SqueezeExcite().eval(), skimage_photos(48), 48, tmp_path)
    assert "scale" in [name.split("_")[0] for name in layers]


class SpatialGate(nn.Module):
    """A gate that is not a per-channel scale: one factor per pixel ([N, 1, H, W], CBAM's spatial attention)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.gate, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 1, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.head(x * torch.sigmoid(self.gate(x)))


def test_the_report_says_why_each_float_op_stayed_float(tmp_path):
    photos = skimage_photos(32)
    # the gate's conv kept float: the scale kernel reads the float gate, its sigmoid runs in float
    se = compile_model(SqueezeExcite().eval(), str(tmp_path / "se.so"), options=BuildOptions(image_size=32),
                       config=QuantConfig(num_calib_images=4, skip=("fc2",)), ranges=Calibrate(photos[:4]),
                       progress=False)
    (scale,) = [r for r in se.report["layers"] if r["kind"] == "scale"]
    assert scale["dtype"] == "int8" and scale["shape"].endswith("by a float gate")
    why = {d["op"]: d for d in se.report["float_op_details"]}
    assert why["relax.sigmoid"]["why"].startswith("computes a channel-scale gate") and \
        why["relax.sigmoid"]["shape"] == [1, 16, 1, 1] and why["relax.sigmoid"]["dtype"] == "float32"
    assert why["relax.reshape"]["why"].startswith("a view")
    # a per-pixel gate is not a channel scale: its multiply stays float, and the report says so (never mis-fused)
    sg = compile_model(SpatialGate().eval(), str(tmp_path / "sg.so"), options=BuildOptions(image_size=32),
                       config=QuantConfig(num_calib_images=4), ranges=Calibrate(photos[:4]), progress=False)
    (mul,) = [d for d in sg.report["float_op_details"] if d["op"] == "relax.multiply"]
    assert mul["shape"] == [1, 8, 32, 32] and mul["why"].startswith("no int8 kernel for relax.multiply")
    assert "scale" not in [r["kind"] for r in sg.report["layers"]]
    assert sg.report["verify"]["status"] == "ok"


def _scale_case(n, h, w, c, zeros, gate_table, seed=0):
    """(implementation, workload, args, reference) of the NHWC32 channel scale."""
    rng = np.random.default_rng(seed)
    impl, packing = registry.get("scale.nhwc32"), registry.layout("NHWC32")
    table = (1.0 / (1.0 + np.exp(-0.1 * np.arange(-128, 128)))).astype(np.float32)
    shift = scale_int8.gate_shift(table, 0.05 / 0.03) if gate_table else 0
    wl = ScaleWorkload((n, h, w), c, 0.05 / 0.03, *zeros, gate_table=gate_table, gate_shift=shift)
    x = packing.pack(rng.integers(-128 if zeros[0] else -127, 128, (n, c, h, w)).astype(np.int8))
    if gate_table:
        args = (x, packing.pack(rng.integers(-127, 128, (n, c, 1, 1)).astype(np.int8)), *impl.pack_params(wl, table))
    else:
        args = (x, rng.random((n, c, 1, 1)).astype(np.float32))
    return impl, wl, args, impl.reference(wl, *args)


@pytest.mark.parametrize("zeros", [(0, 0), (-128, -128)], ids=["symmetric", "unsigned"])
@pytest.mark.parametrize("gate_table", [False, True], ids=["float-gate", "gate-table"])
@pytest.mark.parametrize("floor", [None, 8], ids=["pixel-a-thread", "8-pixels-a-thread"])
def test_the_nhwc32_scales_cuda_kernel_loads_16_bytes_and_computes_the_reference(zeros, gate_table, floor,
                                                                                 monkeypatch):
    """The NHWC32 scale's CUDA kernel (schedules/tensorcore/scale.py): one 16-byte load and store per
    pixel, each channel's factor formed once; its CPU twin (thread loops serial) is bit-exact against
    the reference, padded channels (40 of 64) and pixel tails (8 pixels a thread over 63) included."""
    import re

    import tvm

    from tests.test_kernels import _gpu_twin
    from tvm_qconv.schedules.tensorcore import scale as tc_scale
    from tvm_qconv.target import cuda_source
    if floor is not None:
        monkeypatch.setattr(tc_scale, "MIN_THREADS", floor)
    impl, wl, args, ref = _scale_case(2, 9, 7, 40, zeros, gate_table)
    target = make_target("cuda", "sm_90")
    kernel = impl.schedule(impl.compute(wl), target)
    assert kernel.attrs["tvm_qconv.workload"] == impl.compute(wl).attrs["tvm_qconv.workload"]
    with target:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": kernel}), target=target))
    pixels = 8 if floor else 1
    assert len(re.findall(r"\*\(int4\*\)\(xv_ptr \+ 0\) = \*\(int4\*\)\(x_ptr", src)) == pixels, src
    assert len(re.findall(r"\*\(int4\*\)\(y_ptr \+ [^;]*\) = \*\(int4\*\)\(yv_ptr", src)) == pixels, src
    lib = tvm.compile(tvm.IRModule({"main": _gpu_twin(kernel)}), target="llvm")
    out = tvm.runtime.tensor(np.full(ref.shape, 77, np.int8), tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,w,c", [(1, 112, 112, 32), (64, 56, 56, 144), (64, 7, 7, 1152)],
                         ids=["b1-112px", "b64-56px-144ch", "b64-7px"])
def test_the_nhwc32_scale_on_gpu_is_bit_exact(n, h, w, c):
    import tvm

    from tvm_qconv.target import device_arch
    impl, wl, args, ref = _scale_case(n, h, w, c, (0, 0), True, seed=3)
    lib = registry.compile_kernel(impl, wl, make_target("cuda", device_arch()))
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full(ref.shape, 77, np.int8), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_the_gates_conv_of_few_channels_reads_the_tensor_cores_layout_without_a_relayout():
    """fc2 (4 -> 16 channels, under the tensor-core template's 16) reads fc1's NHWC32 output: the NHWC32
    dp4a kernel takes it where it is (KernelImpl.follows_input), not the stem kernel (NCHW4c in) with a
    relayout before it; the image's conv keeps the stem kernel."""
    from tvm_qconv.int8_module import quantize_module
    from tvm_qconv.target import TargetInfo
    q = quantize_module(SqueezeExcite().eval(), (1, 3, 32, 32), TargetInfo.from_target(make_target("cuda", "sm_90a")),
                        ranges=Calibrate(skimage_photos(32)[:4]), progress=False)
    kernels = {r["layer"]: r["kernel"] for r in q.report["layers"]}
    assert kernels["stem.0"] == "conv2d.nhwc32.stem" and kernels["fc2"] == "conv2d.nhwc32.grouped"
    assert q.report["relayouts"] == 0, q.report["conversions"]
