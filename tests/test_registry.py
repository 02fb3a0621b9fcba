"""The kernel registry: which implementation runs what, layouts as a property of the chosen
kernel, and the scheme's config round trip."""
import dataclasses

import numpy as np
import pytest
import torch
from tvm import relax

from tests.workloads import conv_wl
from tvm_qconv import registry
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import CONFIG_VERSION, PRESETS, QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.errors import InputError
from tvm_qconv.frontend import load_model
from tvm_qconv.models import SmallVGG
from tvm_qconv.int8_module import quantize_module
from tvm_qconv.ranges import Calibrate
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.schedules import conversion_kernels
from tvm_qconv.schedules.nchw4c import impls as nchw4c
from tvm_qconv.schedules.nchw4c.layout import NCHW4c, dequantize_unpack, quantize_pack
from tvm_qconv.target import TargetInfo, make_target

LLVM = TargetInfo.from_target(make_target("llvm"))
SM90 = TargetInfo.from_target(make_target("cuda", "sm_90"))
SM75 = TargetInfo.from_target(make_target("cuda", "sm_75"))  # Turing: dp4a, no mma.m16n8k32 on s8
SM52 = TargetInfo.from_target(make_target("cuda", "sm_52"))  # Maxwell: no __dp4a, no int8 tensor cores


def test_every_implementation_names_its_op_layout_and_family():
    for impl in registry.IMPLEMENTATIONS:
        assert impl.name and impl.op and impl.layout and impl.family, impl
        assert registry.get(impl.name) is impl
        assert impl.name.startswith(impl.op + ".")
    with pytest.raises(KeyError, match="no kernel implementation 'conv2d.nope'"):
        registry.get("conv2d.nope")


TARGETS = {"llvm": (LLVM, "conv2d.nchw4c.cpu"), "sm_90": (SM90, "conv2d.nhwc32.mma"),
           "sm_75": (SM75, "conv2d.nchw4c.dp4a"), "sm_52": (SM52, None)}


@pytest.mark.parametrize("target", list(TARGETS), ids=list(TARGETS))
def test_select_picks_the_family_the_target_has(target):
    info, expected = TARGETS[target]
    impl = registry.select("conv2d", conv_wl(1, 64, 56, 56, 64), info)
    assert (impl.name if impl else None) == expected


def test_few_input_channels_go_to_dp4a_and_the_training_conv_to_tensor_cores_from_16():
    # VGG's first conv (3 channels) would pad to 32 for the mma K step: 10x the work of dp4a's 4.
    # Where tensor cores take the next layer (16+ channels), the stem conv (mma.sync, NHWC32 out);
    # before a layer of fewer channels (dp4a's, NCHW4c) or without int8 mma, the dp4a family.
    # The training forward (int32 out): mma.sync from 16 input channels, dp4a below (no stem form).
    assert registry.select("conv2d", conv_wl(1, 3, 224, 224, 64), SM90).name == "conv2d.nhwc32.stem"
    assert registry.select("conv2d", conv_wl(1, 3, 224, 224, 8), SM90).name == "conv2d.nchw4c.dp4a"
    assert registry.select("conv2d", conv_wl(1, 3, 224, 224, 64), SM75).name == "conv2d.nchw4c.dp4a"
    assert registry.select("conv2d", conv_wl(1, 64, 56, 56, 64, out_dtype="int32"), SM90).name == "conv2d.nhwc32.mma"
    assert registry.select("conv2d", conv_wl(1, 3, 56, 56, 64, out_dtype="int32"), SM90).name == "conv2d.nchw4c.dp4a"
    assert registry.select("conv2d", conv_wl(1, 64, 56, 56, 64, out_dtype="int32"), SM75).name == "conv2d.nchw4c.dp4a"
    assert [i.name for i in registry.candidates("conv2d", conv_wl(1, 64, 56, 56, 64), SM90)] == [
        "conv2d.nhwc32.mma", "conv2d.nchw4c.dp4a"]


def test_a_depthwise_conv_runs_in_the_layout_of_the_conv_before_it():
    # A depthwise conv has a kernel in each layout; it takes its int8 input's, so it costs no
    # relayout whichever family ran the conv before it.  Untuned on sm_80+ the registry's first
    # is NHWC32 (the tensor cores' layout); on sm_75 and the CPU only NCHW4c exists.
    dw = conv_wl(1, 96, 28, 28, 96, groups=96)
    assert registry.select("conv2d", dw, SM90).name == "conv2d.nhwc32.depthwise"
    assert registry.select("conv2d", dw, SM75).name == "conv2d.nchw4c.depthwise"
    assert registry.select("conv2d", dw, LLVM).name == "conv2d.nchw4c.depthwise"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU()).eval()
    x = np.random.default_rng(0).normal(0, 1, (4, 32, 12, 12)).astype(np.float32)
    for family, depthwise in (("conv2d.nhwc32.mma", "conv2d.nhwc32.depthwise"),
                              ("conv2d.nchw4c.dp4a", "conv2d.nchw4c.depthwise")):
        choices = {"0": family, "4": family}  # the two 1x1 convs; the depthwise conv is left to the pass
        q = quantize_module(model, (1, 32, 12, 12), SM90, ranges=Calibrate(x), choices=choices, progress=False)
        assert [r["kernel"] for r in q.report["layers"]] == [family, depthwise, family]
        assert q.report["relayouts"] == 0, q.report["conversions"]


def test_a_grouped_conv_between_tensor_core_convs_takes_the_registry_pick_in_their_layout():
    # Both grouped kernels read NHWC32; the planner takes the registry's pick (the tensor-core GEMM
    # for groups of 16 and more, dp4a for narrower groups), not merely the first that follows its
    # input: measured, the GEMM ran RegNet-X's groups of 16 in 0.33 ms against 0.57 (Conv2dGroupedMma)
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(0, 1, (4, 32, 12, 12)).astype(np.float32)
    for groups, grouped in ((2, "conv2d.nhwc32.grouped_mma"), (8, "conv2d.nhwc32.grouped")):   # 16, 4 a group
        model = torch.nn.Sequential(torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(32, 32, 3, padding=1, groups=groups), torch.nn.ReLU(),
                                    torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU()).eval()
        q = quantize_module(model, (1, 32, 12, 12), SM90, ranges=Calibrate(x), progress=False)
        assert [r["kernel"] for r in q.report["layers"]] == ["conv2d.nhwc32.mma", grouped, "conv2d.nhwc32.mma"]
        assert q.report["relayouts"] == 0, q.report["conversions"]


def test_target_info_comes_from_the_target_not_from_constants():
    assert SM90.has_dp4a and SM90.has_int8_mma and not SM90.has_wgmma and SM90.num_sm == 132
    assert TargetInfo.from_target(make_target("cuda", "sm_90a")).has_wgmma
    assert TargetInfo.from_target(make_target("cuda", "sm_80")).num_sm == 108
    assert not SM52.has_dp4a and SM52.max_shared_memory_per_block == 49152


def test_grouped_conv_runs_in_int8_where_the_groups_fit_the_layout_and_falls_back_otherwise():
    aligned = conv_wl(1, 32, 8, 8, 64, groups=4)      # groups of 8 -> 16 channels
    ragged = conv_wl(1, 6, 8, 8, 6, groups=3)         # groups of 2 channels
    # in the tensor cores' layout on sm_80+ (no relayout around it), on NCHW4c where there are none
    assert registry.select("conv2d", aligned, SM90).name == "conv2d.nhwc32.grouped"
    assert registry.select("conv2d", aligned, TargetInfo.from_target(make_target("cuda", "sm_75"))).name == \
        "conv2d.nchw4c.dp4a"
    assert registry.select("conv2d", ragged, SM90) is None
    # the training path packs each group on its own, so any grouping runs there
    assert registry.select("conv2d", dataclasses.replace(ragged, out_dtype="int32"), SM90) is not None


def test_a_conv_with_no_kernel_on_the_target_stays_float_with_the_reason():
    torch.manual_seed(0)
    photos = skimage_photos(16)
    report = quantize_module(SmallVGG(cfg=(8, "M", 8), image_size=16), (1, 3, 16, 16), SM52, ranges=Calibrate(photos),
                             progress=False).report
    convs = [r for r in report["layers"] if r["kind"].startswith("conv2d")]
    assert convs and all(r["dtype"] == "float32" and "no int8 conv2d kernel" in r["kernel"] and "sm_52" in r["kernel"]
                         for r in convs)


@pytest.mark.parametrize("target", ["llvm", "sm_75"])
def test_no_conversion_between_consecutive_int8_layers_of_one_family(target):
    torch.manual_seed(0)
    info = TARGETS[target][0]
    q = quantize_module(load_model("vgg16"), (1, 3, 32, 32), info, ranges=Calibrate(skimage_photos(32)),
                        progress=False)
    convs = [r for r in q.report["layers"] if r["kind"].startswith("conv2d")]
    assert len(convs) == 13 and {r["kernel"] for r in convs} == {TARGETS[target][1]}
    # one quantize at the input, one dequantize before the classifier, nothing between
    assert [c.split()[0] for c in q.report["conversions"]] == ["quantize", "dequantize"]
    assert q.report["relayouts"] == 0 and "relax.layout_transform" not in q.mod["main"].script()


def test_vgg16_on_hopper_runs_in_one_layout_from_the_stem_on():
    # the first conv (3 channels) on the stem kernel (mma.sync, NCHW4c in, NHWC32 out), the 12
    # others and the pools on tensor cores in NHWC32: no relayout (the dp4a family's NCHW4c output
    # cost a 0.78 ms conversion at batch 64 on an H100).  48 px: the last stage's maps are 3x3
    # (at 32 px they would be 4x4, a GEMM of one 16-row fragment, which stays on dp4a)
    torch.manual_seed(0)
    q = quantize_module(load_model("vgg16"), (1, 3, 48, 48), SM90, ranges=Calibrate(skimage_photos(48)),
                        progress=False)
    kernels = [r["kernel"] for r in q.report["layers"]]
    assert kernels[0] == "conv2d.nhwc32.stem" and kernels.count("conv2d.nhwc32.mma") == 12
    assert kernels.count("max_pool2d.nhwc32") == 5
    assert [c.split()[0] for c in q.report["conversions"]] == ["quantize", "dequantize"]
    assert q.report["relayouts"] == 0


@pytest.mark.parametrize("batch, kernel", [(1, "dense.rows.generic"), (2, "dense.rows.mma"), (32, "dense.rows.mma")])
def test_linear_layers_go_to_tensor_cores_from_2_rows(batch, kernel):
    # one row is a weight-streaming GEMV (dlight's); from 2 rows a GEMM on the tensor cores
    # (MIN_DENSE_ROWS: dlight's SIMT matmul was 8x slower at 16 rows).  On a GPU without int8 mma
    # (sm_75's m16n8k32 is sm_80+) always generic.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))
    x = np.random.default_rng(0).normal(size=(4, 3, 4, 4)).astype(np.float32)
    for target, want in ((SM90, kernel), (TargetInfo.from_target(make_target("cuda", "sm_75")), "dense.rows.generic")):
        q = quantize_module(model, (batch, 3, 4, 4), target, ranges=Calibrate(x), progress=False)
        assert [r["kernel"] for r in q.report["layers"] if r["kind"].startswith("dense")] == [want, want]



class _DenseBlock(torch.nn.Module):
    """DenseNet's structure: every layer reads the concat of all earlier features through
    BatchNorm -> ReLU -> 1x1 conv -> 3x3 conv; the stem (3 channels, 16 out) on the stem
    kernel, the layers on tensor cores, all in NHWC32."""

    def __init__(self, layers=3, growth=32):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.BatchNorm2d(16 + i * growth), torch.nn.ReLU(),
                                torch.nn.Conv2d(16 + i * growth, 64, 1), torch.nn.Conv2d(64, growth, 3, padding=1))
            for i in range(layers))

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


def test_a_dense_block_concatenates_in_the_layout_most_of_its_channels_are_in():
    # Concatenating in the first input's layout cost two relayouts per layer when the stem wrote
    # NCHW4c (the new features to NCHW4c, the batch-normed concat back to NHWC32); in the layout
    # of most channels, two in all.  The stem kernel writes NHWC32: none.
    torch.manual_seed(0)
    model = _DenseBlock().eval()
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 12, 12)).astype(np.float32)
    q = quantize_module(model, (1, 3, 12, 12), SM90, ranges=Calibrate(x), progress=False)
    kernels = [r["kernel"] for r in q.report["layers"]]
    assert all(r["dtype"] == "int8" for r in q.report["layers"])
    assert kernels[0] == "conv2d.nhwc32.stem" and kernels.count("conv2d.nhwc32.mma") == 6
    # the three concats a BatchNorm reads are read in place by it (graph._concats_into_affines); the
    # block's output concat is the one written
    assert kernels.count("affine.nhwc32") == 3 and kernels.count("concat.nhwc32") == 1
    assert q.report["relayouts"] == 0, q.report["conversions"]

class _AltLayout(NCHW4c):
    """NCHW4c under another name: a stand-in for a second family's layout."""

    name = "NCHW4c_alt"


class _AltConv(nchw4c.Conv2dCpu):
    name = "conv2d.nchw4c_alt.cpu"
    layout = "NCHW4c_alt"


@pytest.fixture
def second_family(monkeypatch):
    """The alternative conv, its layout, and the conversions a layout registers with it: relayouts
    to and from NCHW4c, a quantize and a dequantize."""
    alt, layout = _AltConv(), _AltLayout()
    nchw4c_layout = registry.layout("NCHW4c")
    extra = (alt, *conversion_kernels.relayout_kernels([nchw4c_layout, layout]),
             conversion_kernels.Quantize(layout, "quantize_pack", quantize_pack),
             conversion_kernels.Dequantize(layout, "dequantize_unpack", dequantize_unpack))
    monkeypatch.setattr(registry, "IMPLEMENTATIONS", registry.IMPLEMENTATIONS + extra)
    for impl in extra:
        monkeypatch.setitem(registry._BY_NAME, impl.name, impl)
    monkeypatch.setitem(registry.LAYOUTS, "NCHW4c_alt", layout)
    return alt


def test_a_relayout_is_inserted_exactly_where_neighbouring_kernels_differ_in_layout(second_family, tmp_path):
    torch.manual_seed(0)
    model = SmallVGG(cfg=(8, 8, 8, "M", 16), image_size=16)  # conv, conv, conv, pool, conv
    x = np.random.default_rng(0).normal(0, 1, (4, 3, 16, 16)).astype(np.float32)
    graph_names = quantize_module(model, (1, 3, 16, 16), LLVM, ranges=Calibrate(x), progress=False).names
    convs = graph_names["conv2d"]
    # family of each conv: A A B B (the pool follows its input's layout: B)
    choices = {convs[2]: second_family.name, convs[3]: second_family.name}
    q = quantize_module(model, (1, 3, 16, 16), LLVM, ranges=Calibrate(x), choices=choices, progress=False)
    rows = {r["layer"]: r["kernel"] for r in q.report["layers"]}
    assert [rows[c] for c in convs] == ["conv2d.nchw4c.cpu"] * 2 + [second_family.name] * 2
    assert q.report["relayouts"] == 1, q.report["conversions"]
    (relayout,) = [c for c in q.report["conversions"] if c.startswith("relayout")]
    assert "NCHW4c->NCHW4c_alt" in relayout
    # and the model computes the same integers as the one-family build (the two layouts pack alike)
    one = compile_model(model, str(tmp_path / "one.so"), options=BuildOptions(image_size=16), ranges=Calibrate(x),
                        progress=False)
    assert one.report["relayouts"] == 0
    two = compile_model(model, str(tmp_path / "two.so"), options=BuildOptions(image_size=16, kernels=choices),
                        ranges=Calibrate(x), progress=False)
    assert two.report["relayouts"] == 1
    np.testing.assert_array_equal(CompiledModel(two.lib_path)(x[:1]), CompiledModel(one.lib_path)(x[:1]))


def test_quantization_off_equals_float(tmp_path):
    torch.manual_seed(0)
    model = SmallVGG(cfg=(8, "M", 16), image_size=16).eval()
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 16, 16)).astype(np.float32)
    res = compile_model(model, str(tmp_path / "float.so"), options=BuildOptions(image_size=16),
                        config=QuantConfig(skip=("*",)), ranges=Calibrate(x), progress=False)
    assert {r["dtype"] for r in res.report["layers"]} == {"float32"} and res.report["conversions"] == []
    with torch.no_grad():
        ref = model(torch.from_numpy(x[:1])).numpy()
    # the same float32 graph, compiled by TVM instead of run by PyTorch: summation order differs
    np.testing.assert_allclose(CompiledModel(res.lib_path)(x[:1]), ref, rtol=1e-5, atol=1e-5)


CONFIGS = [QuantConfig(), QuantConfig(calibration="entropy", skip=("classifier.*", "features.0"),
                                      quantize_dense=False, num_calib_images=3), *PRESETS.values()]


@pytest.mark.parametrize("config", CONFIGS)
def test_quant_config_round_trips_through_its_dict(config):
    d = config.to_dict()
    assert d["version"] == CONFIG_VERSION and isinstance(d["skip"], list)
    assert QuantConfig.from_dict(d) == config


def test_quant_config_reads_version_1_and_refuses_bad_values():
    v1 = dict(QuantConfig().to_dict(), version=1, layout="NCHW4c")
    assert QuantConfig.from_dict(v1) == QuantConfig()
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\]"):
        QuantConfig.from_dict(dict(QuantConfig().to_dict(), colour="red"))
    with pytest.raises(ValueError, match="calibration must be one of"):
        QuantConfig(calibration="median")
    with pytest.raises(ValueError, match="skip entries must be non-empty strings"):
        QuantConfig(skip=("",))
    assert QuantConfig(skip=("classifier.*",)).skips("classifier.6") and not QuantConfig().skips("features.0")


def test_skip_entry_matching_no_layer_is_refused_before_calibration(monkeypatch):
    import tvm_qconv.ranges.sources as ranges  # where Calibrate calls it (issue 57 moved ranges.py there)
    monkeypatch.setattr(ranges, "calibrate_candidates", lambda *a, **k: pytest.fail("calibrated before checking --skip"))
    from tvm_qconv.errors import InputError
    with pytest.raises(InputError, match="'classifer.6' matches no layer"):
        quantize_module(SmallVGG(), (1, 3, 32, 32), LLVM, config=QuantConfig(skip=("classifer.6",)),
                        ranges=Calibrate(np.zeros((1, 3, 32, 32), np.float32)), progress=False)


def test_relax_module_kernels_carry_their_implementation():
    torch.manual_seed(0)
    q = quantize_module(SmallVGG(cfg=(8, "M", 8), image_size=16), (1, 3, 16, 16), SM90, ranges=Calibrate(skimage_photos(16)),
                        progress=False)
    impls = sorted({registry.of_func(f).name for f in q.mod.functions.values()
                    if not isinstance(f, relax.Function) and registry.of_func(f) is not None})
    assert impls == ["conv2d.nchw4c.dp4a", "dense.rows.generic", "dequantize.nchw4c.generic", "max_pool2d.nchw4c",
                     "quantize.nchw4c.generic", "quantize_rows.rows.generic"]


@pytest.mark.parametrize("options,message", [
    (dict(families=("tensorcore",)), "unknown kernel family tensorcore: choose from"),
    (dict(kernels={"features.0": "conv2d.dp4a"}), "unknown kernel implementation conv2d.dp4a"),
    (dict(image_size=4), "image size >= 8")])
def test_build_options_name_a_bad_value(options, message):
    with pytest.raises(InputError, match=message):
        BuildOptions(**options)


def test_calibrating_on_no_images_is_refused_with_the_reason():
    with pytest.raises(InputError, match="N >= 1"):
        compile_model(SmallVGG(num_classes=10, image_size=16), "/nonexistent/m.so", progress=False,
                      options=BuildOptions(image_size=16),
                      ranges=Calibrate(np.zeros((0, 3, 16, 16), np.float32)))


def test_a_gemm_of_one_fragment_stays_off_the_tensor_cores():
    """A GEMM of one 16-row fragment (M = 16: ConvNeXt's 4x4 map at batch 1, 64 px) is not
    given to the tensor-core conv, whose epilogue placement TVM refuses (reverse_compute_at)."""
    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90"))
    mma = registry.get("conv2d.nhwc32.mma")
    assert not mma.applies(conv_wl(1, 64, 4, 4, 64, kernel=(1, 1), padding=(0, 0, 0, 0)), sm90)
    assert mma.applies(conv_wl(2, 64, 4, 4, 64, kernel=(1, 1), padding=(0, 0, 0, 0)), sm90)
