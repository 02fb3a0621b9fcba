"""ConvNeXt's blocks in int8 (issue 34, point 2): the channels-last regions rewritten as NCHW ops
(``transform/channels_first.py``), the LayerNorm over channels as one int8 kernel
(``schedules/layer_norm_int8.py``), the token-wise Linear layers as 1x1 convs, GELU as a lookup
table between them, the layer scale folded into the second conv."""
import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
import tvm
from torch import nn
from torchvision.models.convnext import CNBlock, LayerNorm2d
from tvm import relax

from tests.cuda_vs_cpu import assert_cuda_build_equals_cpu_build
from tvm_qconv import registry
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.frontend import ExportedModel, simplify
from tvm_qconv.onnx_export import export_onnx
from tvm_qconv.ranges import Calibrate, GivenRanges
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.schedules.layer_norm_int8 import layer_norm_float_ref, layer_norm_params
from tvm_qconv.schedules.workload import ConvWorkload, LayerNormWorkload
from tvm_qconv.target import cuda_source, make_target
from tvm_qconv.transform.channels_first import channels_first

RNG = np.random.default_rng(0)
EPS = 1e-6


def _run(impl, wl, *args):
    lib = registry.compile_kernel(impl, wl, make_target("llvm"))
    out = tvm.runtime.empty(impl.out_shape(wl), "int8", tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("layout", ["NCHW4c", "NHWC32"])
@pytest.mark.parametrize("channels", [37, 96])
@pytest.mark.parametrize("zeros", [(0, 0), (-128, 0), (0, -128)], ids=["symmetric", "unsigned-in", "unsigned-out"])
def test_the_layer_norm_kernel_is_its_numpy_twin_and_float_layer_norm_rounded(layout, channels, zeros):
    packing = registry.layout(layout)
    impl = registry.get(f"layer_norm.{layout.lower()}")
    z_x, z_y = zeros
    s_x = 0.05
    real = RNG.normal(0.4, 1.5, (2, channels, 5, 3))
    real[0, :, 0, 0] = 0.3                       # a constant pixel: variance 0, epsilon alone
    real[1, :, 1, 1] = 0.0
    real[1, 3, 1, 1] = 6.0                       # one outlier channel: the largest |normalized| value
    q = np.clip(np.rint(real / s_x) + z_x, -128 if z_x else -127, 127).astype(np.int8)
    gamma = RNG.normal(1.0, 0.3, channels).astype(np.float32)
    beta = RNG.normal(0.0, 0.5, channels).astype(np.float32)
    want = layer_norm_float_ref((q.astype(np.float64) - z_x) * s_x, gamma, beta, EPS)
    s_y = float(np.abs(want).max()) / 127 if z_y == 0 else float(want.max() - want.min()) / 255
    if z_y:
        z_y = int(np.clip(np.rint(-128 - want.min() / s_y), -128, 127))
    wl = LayerNormWorkload((2, 5, 3), channels, z_y)
    params = impl.pack_params(wl, *layer_norm_params(gamma, beta, EPS, s_x, s_y, z_y, channels))
    x = packing.pack(q)
    got = _run(impl, wl, x, *params)
    assert np.array_equal(got, impl.reference(wl, x, *params))   # bit for bit, padded channels 0
    # against float LayerNorm rounded at the output scale: at most one step, where the 20-bit
    # normalized value rounds a near-tie the other way (measured: none at these sizes)
    rounded = np.clip(np.rint(want / s_y) + z_y, -128 if z_y else -127, 127)
    assert np.abs(packing.unpack(got, channels).astype(int) - rounded).max() <= 1


# ConvNeXt-T's LayerNorms at batch 64 (224 px) and at batch 1; odd sizes
CUDA_SHAPES = [((64, 56, 56), 96), ((64, 28, 28), 192), ((64, 14, 14), 384), ((64, 7, 7), 768), ((64, 1, 1), 768),
               ((1, 56, 56), 96), ((3, 5, 7), 37)]


@pytest.mark.parametrize("shape,channels", CUDA_SHAPES, ids=[f"{s}x{c}" for s, c in CUDA_SHAPES])
def test_the_cuda_schedule_compiles_for_every_layer_norm_shape(shape, channels):
    """The warp-per-pixel schedule lowers to CUDA C with its two warp reductions (a block that crossed
    image rows failed TVM's reduction check at 64 x 14 x 14: found on the GPU, kept here)."""
    impl = registry.get("layer_norm.nhwc32")
    cuda = make_target("cuda", "sm_90a")
    func = impl.schedule(impl.compute(LayerNormWorkload(shape, channels, 0)), cuda)
    with cuda:
        source = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda))
    assert source.count("__shfl_down_sync") >= 2 * 5   # two reductions of 32 lanes: 5 steps each


def test_the_nchw4c_layer_norm_is_left_to_dlight_on_cuda_and_compiles():
    """A GPU without int8 tensor cores runs the LayerNorm in NCHW4c: no own schedule, dlight's rules
    (``registry.compile_kernel`` applies the build's) give a kernel that compiles (unscheduled, CUDA
    codegen refuses it: every loop must be bound to threads)."""
    impl = registry.get("layer_norm.nchw4c")
    cuda = make_target("cuda", "sm_61")
    wl = LayerNormWorkload((2, 14, 14), 96, 0)
    assert impl.schedule(impl.compute(wl), cuda) is None
    assert "__global__" in cuda_source(registry.compile_kernel(impl, wl, cuda))   # scheduled: it lowers to CUDA


class _TinyConvNeXt(nn.Module):
    """ConvNeXt's stem, one block and its downsampling, small: the Linear layers, GELU, layer
    scale and both LayerNorm forms (``LayerNorm2d``: permute, normalize, permute back)."""

    def __init__(self, dim=24):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 4, stride=4), LayerNorm2d(dim, eps=EPS))
        self.block = CNBlock(dim, layer_scale=0.5, stochastic_depth_prob=0.0)
        with torch.no_grad():
            self.block.layer_scale.uniform_(0.2, 0.8)
        self.down = nn.Sequential(LayerNorm2d(dim, eps=EPS), nn.Conv2d(dim, 2 * dim, 2, stride=2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * dim, 10))

    def forward(self, x):
        return self.head(self.down(self.block(self.stem(x))))


def _run_float(mod, x):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))[0].numpy()


def test_the_channels_last_regions_become_nchw_ops_with_the_same_output():
    model = _TinyConvNeXt().eval()
    exported = ExportedModel(model, (1, 3, 32, 32))
    imported, names = exported.imported(1)
    before = simplify(imported)
    after, new_names = channels_first(before, names)
    ops = [getattr(getattr(b.value, "op", None), "name", None) for b in after["main"].body.blocks[0].bindings]
    assert "relax.permute_dims" not in ops and ops.count("relax.matmul") == 1   # the classifier's only
    assert ops.count("relax.nn.layer_norm") == 3 and ops.count("relax.nn.conv2d") == 5
    assert "relax.multiply" not in ops                                          # the layer scale, folded
    # the block's Linear layers are named among the convs, in graph order
    assert new_names["conv2d"] == ["stem.0", "block.block.0", "block.block.3", "block.block.5", "down.1"]
    assert new_names["dense"] == ["head.2"]
    x = RNG.normal(size=(1, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    # the same sums in another order: float32 rounding apart (measured 6e-8 on logits spanning 0.5)
    np.testing.assert_allclose(_run_float(after, x), _run_float(before, x), rtol=0, atol=1e-5)
    np.testing.assert_allclose(_run_float(after, x), ref, rtol=0, atol=1e-5)


class _Leaky(nn.Module):
    """A channels-last region whose LayerNorm output is also read outside it: not rewritten."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        y = self.norm(self.conv(x).permute(0, 2, 3, 1))
        return y.permute(0, 3, 1, 2) + y.mean()


def test_a_region_read_outside_stays_as_it_was():
    imported, names = ExportedModel(_Leaky().eval(), (1, 3, 8, 8)).imported(1)
    mod = simplify(imported)
    after, _ = channels_first(mod, names)
    assert after is mod


def _build(model, tmp_path, size=32, **options):
    photos = skimage_photos(size)
    return compile_model(model, str(tmp_path / "net.so"), options=BuildOptions(image_size=size, **options),
                         config=QuantConfig(num_calib_images=4), ranges=Calibrate(photos[:4]), progress=False)


def test_a_convnext_block_runs_in_int8_without_permutes(tmp_path):
    model = _TinyConvNeXt().eval()
    res = _build(model, tmp_path)
    rows = res.report["layers"]
    kinds = [r["kind"].split("+")[0] for r in rows if r["dtype"] == "int8"]
    # stem conv, its LayerNorm, the block's depthwise conv, LayerNorm, two 1x1 convs, GELU table, residual
    # add, the downsampling LayerNorm and conv, the global pool; the classifier's Linear reads float
    assert kinds.count("layer_norm") == 3 and kinds.count("lut") == 1 and kinds.count("conv2d") == 5
    assert all(r["dtype"] == "int8" for r in rows if r["kind"] != "dense+bias"), rows
    # the flatten (the pool's no-op [N, C, 1, 1] reshape is dropped: transform/identity_reshapes.py)
    assert res.report["float_ops"] == {"relax.reshape": 1}
    photos = skimage_photos(32)
    with torch.no_grad():
        ref = model(torch.from_numpy(photos[4:8])).numpy()
    got = np.concatenate([CompiledModel(res.lib_path)(p[None]) for p in photos[4:8]])
    # measured 32.6 dB (2026-11-27): int8 noise of a dozen layers; a wrong statistic or scale is ~0 dB
    assert sqnr_db(ref, got) > 28.0


class _NormOverAll(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.conv1(x)
        return self.conv2(nn.functional.layer_norm(y, y.shape[1:]))


def test_a_layer_norm_over_other_axes_stays_float_and_says_why(tmp_path):
    res = _build(_NormOverAll().eval(), tmp_path, size=16)
    (row,) = [r for r in res.report["layers"] if r["kind"] == "layer_norm"]
    assert row["dtype"] == "float32" and "axes [1, 2, 3]" in row["kernel"]
    assert res.report["verify"]["status"] == "ok"


def test_the_onnx_export_runs_the_layer_norm_over_channels_as_onnx_runtime_does(tmp_path):
    """The int8 LayerNorm in ONNX: DequantizeLinear -> Transpose -> LayerNormalization -> Transpose ->
    QuantizeLinear; ONNX Runtime's logits close to the library's."""
    model = _TinyConvNeXt().eval()
    photos = skimage_photos(32)
    exp = export_onnx(model, str(tmp_path / "net.onnx"), input_shape=(1, 3, 32, 32), ranges=Calibrate(photos[:4]),
                      progress=False)
    lib = compile_model(model, str(tmp_path / "net.so"), options=BuildOptions(image_size=32, verify=False),
                        ranges=GivenRanges(exp.amax), progress=False)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(tmp_path / "net.onnx"), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in __import__("onnx").load(str(tmp_path / "net.onnx")).graph.node]
    assert ops.count("LayerNormalization") == 3 and ops.count("Transpose") == 6
    onnx_logits = np.concatenate([sess.run(None, {sess.get_inputs()[0].name: p[None]})[0] for p in photos[4:8]])
    ours = np.concatenate([CompiledModel(lib.lib_path)(p[None]) for p in photos[4:8]])
    # the same integers up to float LayerNorm vs the fixed-point kernel and ONNX Runtime's float ops
    # between Q/DQ: measured 40.2 dB apart (2026-11-27)
    assert sqnr_db(onnx_logits, ours) > 30.0


@pytest.mark.gpu
def test_the_cuda_build_of_a_convnext_block_equals_its_cpu_build(tmp_path):
    """Every int8 activation, integer for integer: the LayerNorm's warp schedule (channels-last)
    against the CPU's compute definition (NCHW4c); batch 2, 48 channels after the downsampling."""
    layers = assert_cuda_build_equals_cpu_build(_TinyConvNeXt().eval(), skimage_photos(64), 64, tmp_path)
    assert [name for name in layers if name.startswith("layer_norm")]


# The depthwise conv with the LayerNorm after it in one kernel (tensorcore/depthwise_layer_norm.py):
# padded channels (40 of 64), an unsigned output, ConvNeXt's widest stage (one pixel a block)
FUSED = [(40, 7, 2, 0), (96, 9, 1, -128), (768, 5, 1, 0)]
FUSED_IDS = ["40ch-b2", "96ch-unsigned-out", "768ch"]


def _fused_case(channels, size, batch, zero, seed=0):
    """(the depthwise workload with its LayerNorm, the kernel's arguments)."""
    from tests.test_epilogue_table import _args
    wl = ConvWorkload.with_activation("none", batch=batch, in_channels=channels, height=size, width=size,
                                      out_channels=channels, groups=channels, kernel=(7, 7), padding=(3, 3, 3, 3))
    args, _ = _args(registry.get("conv2d.nhwc32.depthwise"), wl, seed)
    rng = np.random.default_rng(seed + 1)
    params = layer_norm_params(rng.uniform(0.5, 2.0, channels), rng.uniform(-1, 1, channels), EPS, 0.05, 0.02, zero,
                               channels)
    return dataclasses.replace(wl, norm=(zero,)), [*args, *params]


@pytest.mark.parametrize("channels,size,batch,zero", FUSED, ids=FUSED_IDS)
def test_a_depthwise_conv_with_its_layer_norm_is_the_two_kernels_one_after_the_other(channels, size, batch, zero):
    import re

    from tvm.script import parser as tvmscript

    from tests.test_epilogue_table import _run as run_llvm
    from tvm_qconv.schedules.kernel import written_kernel
    from tvm_qconv.schedules.layer_norm_int8 import layer_norm_int8_ref
    from tvm_qconv.schedules.tensorcore import depthwise_layer_norm
    from tvm_qconv.schedules.tensorcore.layout import LAYOUT
    impl = registry.get("conv2d.nhwc32.depthwise")
    wl, args = _fused_case(channels, size, batch, zero)
    plain = dataclasses.replace(wl, norm=())
    # the reference: the depthwise kernel's int8 output, then the LayerNorm kernel's integers on it
    conv = impl.reference(plain, *args[:5])
    want = layer_norm_int8_ref(LAYOUT, conv, *args[5:], channels, zero)
    np.testing.assert_array_equal(impl.reference(wl, *args), want)
    assert len(np.unique(want)) > 100
    shape = impl.out_shape(wl)
    np.testing.assert_array_equal(run_llvm(impl.compute(wl), args, shape), want)
    # the CUDA kernel's CPU twin: each dp4a as its products, the three thread phases one after the other
    twin = written_kernel(impl.compute(wl), depthwise_layer_norm.depthwise_layer_norm_kernel(wl, dp4a=False))
    text = re.sub(r'T\.thread_binding\((\d+), thread="[\w.]+"\)', r"range(\1)", twin.script())
    np.testing.assert_array_equal(run_llvm(tvmscript.parse(text.replace('scope="shared"', 'scope="global"')), args,
                                           shape), want)
    target = make_target("cuda", "sm_90a")
    with target:
        src = cuda_source(registry.compile_kernel(impl, wl, target))
    assert src.count("__syncthreads()") == 2 and "__dp4a(" in src and "sqrt(" in src


def test_a_layer_norm_runs_in_the_depthwise_kernel_that_feeds_it_alone():
    # ConvNeXt's blocks at 224 px on sm_90a: every depthwise conv's LayerNorm in its kernel; the
    # stem's and the downsampling LayerNorms (after a conv that is not depthwise, after an add) keep theirs
    from tvm_qconv.int8_module import quantize_module
    from tvm_qconv.target import TargetInfo
    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    rows = quantize_module(_TinyConvNeXt(dim=32).eval(), (1, 3, 64, 64), sm90, ranges=Calibrate(x),
                           progress=False).report["layers"]
    kernel = {r["layer"]: r["kernel"] for r in rows}
    kind = {r["layer"]: r["kind"] for r in rows}
    assert kernel["layer_norm_1"] == "in block.block.0's kernel" and kind["block.block.0"] == "conv2d+bias+layer_norm"
    assert kernel["layer_norm_0"] == kernel["layer_norm_2"] == "layer_norm.nhwc32"
    assert not registry.get("conv2d.nchw4c.depthwise").takes_norm     # NCHW4c (sm_75, llvm) keeps two kernels
    from tvm_qconv.schedules.tensorcore import depthwise_layer_norm
    b64 = dataclasses.replace(_fused_case(192, 28, 1, 0)[0], batch=64)
    assert not depthwise_layer_norm.takes(b64)    # 8 pixels a thread unfused: the two kernels stay
    with pytest.raises(ValueError, match="without a table or a residual"):
        dataclasses.replace(_fused_case(40, 7, 1, 0)[0], table=True)


@pytest.mark.gpu
@pytest.mark.parametrize("channels,size,batch", [(96, 56, 1), (192, 28, 1), (384, 14, 1), (768, 7, 1)],
                         ids=["stage1-b1", "stage2-b1", "stage3-b1", "stage4-b1"])
def test_a_depthwise_conv_with_its_layer_norm_on_gpu_is_bit_exact(channels, size, batch):
    from tests.test_kernels import _on_gpu
    impl = registry.get("conv2d.nhwc32.depthwise")
    wl, args = _fused_case(channels, size, batch, 0, seed=3)
    want = impl.reference(wl, *args)
    np.testing.assert_array_equal(_on_gpu(impl, wl, args, want.shape), want)


@pytest.mark.gpu
def test_a_fused_cuda_build_computes_what_the_unfused_one_does(tmp_path):
    """On the GPU, ConvNeXt's block built with its epilogues fused (the LayerNorm in the depthwise
    kernel, the GELU table and the residual add in the pointwise convs) gives the logits of the build
    that keeps every layer a kernel, exactly."""
    from tvm_qconv.target import device_arch
    photos = skimage_photos(64)
    logits = {}
    for expose in (False, True):
        res = compile_model(_TinyConvNeXt(dim=32).eval(), str(tmp_path / f"{expose}.so"),
                            config=QuantConfig(num_calib_images=4), ranges=Calibrate(photos[:4]), progress=False,
                            options=BuildOptions(target="cuda", arch=device_arch(), batch=2, image_size=64,
                                                 expose_activations=expose, verify=False))
        logits[expose] = CompiledModel(res.lib_path).outputs(photos[4:6])[0]
        if not expose:
            assert any(r["kernel"].endswith("'s kernel") for r in res.report["layers"])
    np.testing.assert_array_equal(logits[False], logits[True])
