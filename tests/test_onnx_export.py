"""``deploy.py export-onnx`` / :func:`tvm_qconv.onnx_export.export_onnx`: the calibrated int8 model
as ONNX with explicit QuantizeLinear / DequantizeLinear pairs carrying the project's own scales.

The file must be valid ONNX, hold exactly the project's int8 weights and scales, run in ONNX
Runtime (CPU) with its convs in int8, and agree with the project's own int8 library built from
the same ranges (``GivenRanges(amax)``) on real photos.  The two differ only in rounding (ONNX
rounds half to even and requantizes in float; the project rounds half up in fixed point), so
they agree far more closely than either agrees with the float model.

ONNX Runtime sessions here set ``session.qdqisint8allowed=1``: without it, on an x86 CPU ORT
converts the int8 Q/DQ pairs it can to uint8 (zero point 128) and runs its U8S8 kernels, whose
16-bit intermediate sums saturate on CPUs without VNNI (this 2-core CI box: resnet18 at 32 px,
23 dB against the library and 2 of 15 top-1s changed, instead of 41 dB and none).
"""
import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torchvision
from onnx import numpy_helper
from torch import nn

import deploy
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.errors import InputError
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.ranges.observers import quantize_weight_per_channel
from tvm_qconv.onnx_export import export_onnx
from tvm_qconv.ranges import Calibrate, GivenRanges
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.quantization.scales import AMAX_FLOOR

SIZE = 32
CALIB = 4  # calibration photos: enough for real ranges, fast


class SmallNet(nn.Module):
    """A residual add, a concat, a max pool, ReLU6 (clip), a depthwise and a grouped conv, convs
    with no activation (the ones ONNX Runtime fuses into QLinearConv) and a linear layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.left = nn.Conv2d(16, 8, 1)
        self.right = nn.Conv2d(16, 8, 3, padding=1)
        self.grouped = nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=4)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.relu6(self.stem(x))
        x = torch.relu(self.dw(x)) + x
        x = torch.cat([self.left(x), self.right(x)], 1)
        x = self.grouped(nn.functional.max_pool2d(x, 2))
        return self.fc(x.mean((2, 3)))


def small_net() -> nn.Module:
    torch.manual_seed(0)  # the module exported is the module the library is built from
    return SmallNet().eval()


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


def session(path, optimized: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.qdqisint8allowed", "1")  # the module docstring says why
    if optimized:
        so.optimized_model_filepath = optimized
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# The symmetric scheme, the model's own biases: the checks below read the file's numbers to the bit
# (scale amax / 127, zero point 0, the float bias).  The default's unsigned tensors and corrected
# biases are exported and checked against ONNX Runtime in test_unsigned_activations.py and
# test_bias_correction.py.
SYMMETRIC = QuantConfig(unsigned_activations=False, bias_correction=False)


def export_and_build(model, tmp, name):
    """The ONNX file, and the project's llvm int8 library of the same model and ranges."""
    photos = skimage_photos(SIZE)
    res = export_onnx(model, str(tmp / f"{name}.onnx"), input_shape=(1, 3, SIZE, SIZE), config=SYMMETRIC,
                      ranges=Calibrate(photos[:CALIB]), progress=False)
    lib = compile_model(model, str(tmp / f"{name}.so"), options=BuildOptions(image_size=SIZE, verify=False),
                        config=res.config, ranges=res.given_ranges(), progress=False)
    library = CompiledModel(lib.lib_path)
    logits = np.concatenate([library(photos[i:i + 1]) for i in range(len(photos))])
    return dict(res=res, lib=lib, photos=photos, logits=logits, path=tmp / f"{name}.onnx", model=model)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return export_and_build(small_net(), tmp_path_factory.mktemp("small"), "small")


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return export_and_build(resnet18(), tmp_path_factory.mktemp("resnet18"), "resnet18")


def initializers(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def producers(model: onnx.ModelProto) -> dict:
    return {o: n for n in model.graph.node for o in n.output}


def weight_dq(model, conv):
    """The DequantizeLinear feeding ``conv``'s weight, and its int8 weight and scales."""
    node = producers(model).get(conv.input[1])
    assert node is not None and node.op_type == "DequantizeLinear", f"{conv.name}: weight is not dequantized"
    init = initializers(model)
    axis = {a.name: a.i for a in node.attribute}.get("axis", 1)
    return node, init[node.input[0]], init[node.input[1]], axis


@pytest.mark.parametrize("which", ["small", "resnet"])
def test_the_file_is_valid_onnx_and_says_what_it_holds(which, request):
    case = request.getfixturevalue(which)
    onnx.checker.check_model(str(case["path"]), full_check=True)
    model = onnx.load(str(case["path"]))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["producer"] == "tvm_qconv" and model.producer_name == "tvm_qconv"
    assert QuantConfig.from_dict(json.loads(meta["scheme"])) == SYMMETRIC   # the scheme as the build decided it
    assert json.loads(meta["ranges"])["source"] == "calibration"
    assert json.loads(meta["amax"]) == case["res"].amax  # every range, exactly (GivenRanges rebuilds it)
    summary = case["res"].summary
    # the same layers in int8 and the same ops left in float as the library's report
    assert summary["float_ops"] == case["lib"].report["float_ops"]
    assert summary["int8_layers"] == sum(r["dtype"] == "int8" for r in case["lib"].report["layers"])
    assert summary["float_layers"] == [] and summary["opset"] == 17 and summary["dynamic_batch"]


def test_weights_are_the_projects_int8_weights_with_their_per_channel_scales(small):
    model = onnx.load(str(small["path"]))
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm")]
    assert len(convs) == 6
    for node in convs:
        dq, qw, scale, axis = weight_dq(model, node)
        torch_weight = small["model"].get_submodule(node.output[0]).weight.detach().numpy()  # named by layer
        want_q, want_scale = quantize_weight_per_channel(torch_weight)
        assert qw.dtype == np.int8 and axis == 0
        np.testing.assert_array_equal(qw, want_q)
        np.testing.assert_array_equal(scale, want_scale)  # exactly: the project's float32 scales
    assert small["res"].summary["int8_weights"] == 6


def test_conv_bias_is_float_and_the_input_scale_the_builds(small):
    # float, not the project's int32 bias behind a DequantizeLinear: TensorRT refuses an INT32
    # DequantizeLinear (onnx_export's docstring); ONNX Runtime rounds it to the same integers
    model = onnx.load(str(small["path"]))
    init, made = initializers(model), producers(model)
    conv = next(n for n in model.graph.node if n.op_type == "Conv" and n.output[0].startswith("stem"))
    assert conv.input[2] in init and init[conv.input[2]].dtype == np.float32
    np.testing.assert_array_equal(init[conv.input[2]], small["model"].stem.bias.detach().numpy())
    s_x = max(small["res"].amax["stem.in0"], AMAX_FLOOR) / 127.0  # rounded to float32, as the plan's
    assert init[made[conv.input[0]].input[1]] == np.float32(s_x)  # the input's DequantizeLinear(q, s_x, 0)


@pytest.mark.parametrize("which", ["small", "resnet"])
def test_activation_scales_are_the_builds_amax_over_127(which, request):
    case = request.getfixturevalue(which)
    model = onnx.load(str(case["path"]))
    init = initializers(model)
    scales = [float(init[n.input[1]]) for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(scales) == case["res"].summary["qdq_activations"]
    # Every int8 tensor's scale is a point's max(amax, 1e-30) / 127, bit for bit.  Every point is
    # used but one: the input of the conv after the max pool, which reads the pool's int8 output
    # at the pool input's scale (the max of int8 values is int8 at the same scale).
    want = {float(np.float32(max(a, AMAX_FLOOR) / 127.0)) for a in case["res"].amax.values()}
    assert set(scales) <= want and len(want - set(scales)) <= 1
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[0] not in init:
            assert init[n.input[2]].dtype == np.int8 and int(init[n.input[2]]) == 0  # symmetric int8
    for conv in (n for n in model.graph.node if n.op_type == "Conv"):
        _, qw, scale, axis = weight_dq(model, conv)
        assert qw.dtype == np.int8 and axis == 0 and scale.shape == (qw.shape[0],)
        assert producers(model)[conv.input[0]].op_type == "DequantizeLinear"  # int8 input


@pytest.mark.parametrize("which,floor", [("small", 55.0), ("resnet", 35.0)])
def test_onnx_runtime_agrees_with_the_projects_int8_library_on_photos(which, floor, request):
    case = request.getfixturevalue(which)
    got = session(case["path"]).run(None, {"input": case["photos"]})[0]
    ref = case["logits"]
    with torch.no_grad():
        flt = case["model"](torch.from_numpy(case["photos"])).numpy()
    # Measured on the 2-core CI box (15 photos, 32 px): small 61.1 dB, resnet18 41.3 dB against the
    # library, which is itself 29.4 / 24.6 dB from the float model.  The floors are those minus ~6
    # dB: rounding differences only.  A real fault is far below: in resnet18's file, one conv's
    # weight scales 10 % off give 22.3 dB, one activation's scale halved 21.9 dB, doubled 24.7 dB.
    # Top-1 is identical on every photo whose top-1 the library decides: one that leads its
    # runner-up by more than 5 % of the logits' spread.  A random network has near-ties, and one
    # rounding step moves a logit by ~0.03 here: resnet18 ranks one photo 725 / 223 with a gap of
    # 0.0004 (its logits' spread is 0.08), and those two swap.
    top2 = np.sort(ref, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 0.05 * ref.std(axis=1)
    assert decided.sum() >= 10  # not a vacuous check: 12 of resnet18's 15 photos, 13 of the small net's
    assert np.array_equal(got.argmax(1)[decided], ref.argmax(1)[decided])
    assert sqnr_db(ref, got) >= floor, (sqnr_db(ref, got), sqnr_db(flt, ref))
    assert sqnr_db(ref, got) > sqnr_db(flt, ref)  # closer to the project's int8 than int8 is to float


def test_onnx_runtime_runs_the_convs_in_int8(resnet, tmp_path):
    optimized = tmp_path / "resnet18.optimized.onnx"
    session(resnet["path"], str(optimized))
    ops = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
    # resnet18's 20 convs: the 11 whose output is quantized directly (the blocks' second convs and
    # the downsamples) become QLinearConv.  ORT fuses the 9 Conv -> ReLU -> Q into a float FusedConv
    # between Q/DQ instead: it drops a ReLU into QuantizeLinear only for a zero point of -128, and
    # the project's activations are symmetric (zero point 0).  TensorRT fuses DQ -> Conv -> ReLU -> Q
    # (its documented explicit-quantization pattern).
    assert ops["QLinearConv"] >= 10, ops


def test_one_file_runs_at_any_batch(small):
    sess = session(small["path"])
    inputs = sess.get_inputs()[0]
    assert inputs.shape[0] == "batch" and sess.get_outputs()[0].shape[0] == "batch"
    photos = small["photos"][:3]
    three = sess.run(None, {"input": photos})[0]
    ones = np.concatenate([sess.run(None, {"input": photos[i:i + 1]})[0] for i in range(3)])
    np.testing.assert_allclose(three, ones, rtol=1e-5, atol=1e-5 * np.abs(ones).max())  # float sums' order only


class Tokens(nn.Module):
    """ConvNeXt's token-wise linear: [N, C, H, W] -> [N*H*W, C] rows and back; each sample's rows stay
    in dim 0, so the batch stays symbolic."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.conv(x).permute(0, 2, 3, 1).reshape(-1, 4)).reshape(x.shape[0], -1, 5).mean(1)


class BatchMover(Tokens):
    """A reshape that mixes samples: no file can run it at another batch."""

    def forward(self, x):
        return self.conv(x).transpose(0, 1).reshape(4, -1)


@pytest.mark.parametrize("cls,dynamic", [(Tokens, True), (BatchMover, False)])
def test_batch_is_symbolic_unless_a_reshape_moves_it(tmp_path, cls, dynamic):
    torch.manual_seed(0)
    photos = skimage_photos(16)[:3]
    res = export_onnx(cls().eval(), str(tmp_path / "m.onnx"), input_shape=(1, 3, 16, 16), ranges=Calibrate(photos[:2]),
                      progress=False)
    assert res.summary["dynamic_batch"] == dynamic
    sess = session(tmp_path / "m.onnx")
    if dynamic:
        three = sess.run(None, {"input": photos})[0]
        ones = np.concatenate([sess.run(None, {"input": photos[i:i + 1]})[0] for i in range(3)])
        np.testing.assert_allclose(three, ones, rtol=1e-5, atol=1e-5 * np.abs(ones).max())
    else:
        assert "moves the batch dimension" in res.summary["static_batch_reason"]
        assert sess.get_inputs()[0].shape == [1, 3, 16, 16]


def test_skip_list_and_static_batch_and_opset_21(tmp_path):
    path = tmp_path / "skip.onnx"
    res = export_onnx(small_net(), str(path), input_shape=(2, 3, SIZE, SIZE), config=QuantConfig(skip=("right",)),
                      ranges=Calibrate(skimage_photos(SIZE)[:CALIB]), dynamic_batch=False, opset=21, progress=False)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 21
    assert res.summary["float_layers"] == ["right"] and res.summary["int8_weights"] == 5
    init = initializers(model)
    float_convs = [n for n in model.graph.node if n.op_type == "Conv" and n.input[1] in init]  # no DequantizeLinear
    assert len(float_convs) == 1 and init[float_convs[0].input[1]].dtype == np.float32
    assert init[float_convs[0].input[1]].shape == (8, 16, 3, 3)  # right's
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, SIZE, SIZE] and not res.summary["dynamic_batch"]
    out = session(path).run(None, {"input": skimage_photos(SIZE)[:2]})[0]
    assert out.shape == (2, 10) and np.isfinite(out).all()


class Sine(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.sin(self.conv(x)).flatten(1)


def test_an_op_without_onnx_form_is_refused_by_name_before_calibration(tmp_path):
    path = tmp_path / "sine.onnx"
    with pytest.raises(InputError, match=r"cannot be exported to ONNX yet.*relax\.sin"):
        # no images at all: the op check comes before calibration would need them
        export_onnx(Sine(), str(path), input_shape=(1, 3, 16, 16), ranges=Calibrate(np.zeros((0, 3, 16, 16))),
                    progress=False)
    assert not path.exists()


def test_cli_exports_a_model(tmp_path, capsys):
    out = tmp_path / "resnet18.onnx"
    assert deploy.main(["export-onnx", "--model", "resnet18", "--image-size", "32", "--num-calib", str(CALIB),
                        "-o", str(out)]) == 0
    text = capsys.readouterr().out
    # 31 int8 tensors before the global pool, and its output (an int8 GlobalAveragePool)
    assert f"wrote {out}" in text and "activation QuantizeLinear/DequantizeLinear: 32" in text
    assert "int8 weights: 21" in text and "float ops: reshape x1" in text
    onnx.checker.check_model(str(out), full_check=True)
    assert [p.value for p in onnx.load(str(out)).metadata_props if p.key == "model"] == ["resnet18"]


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_cli_bad_output_path_is_one_line_and_exit_2(tmp_path, capsys, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "folder" else tmp_path / "file" / "model.onnx"
    assert deploy.main(["export-onnx", "--model", "resnet18", "--image-size", "32", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ONNX file") and "\n" not in err, err
