"""Float ONNX models in (issue 36, part 1): a ``.onnx`` file builds through TVM's Relax ONNX
frontend into the same pipeline as the torch model it was exported from, and bad files get one line.

The builds are llvm at 64 px (small: CI's CPU); the calibration photos are scikit-image's.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
import torchvision
from onnx import TensorProto, helper
from torch import nn

from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.data import skimage_photos
from tvm_qconv.errors import InputError
from tvm_qconv.frontend import load_model
from tvm_qconv.frontend.onnx_model import OnnxModel
from tvm_qconv.runtime import CompiledModel

SIZE = 64


def _export(model: nn.Module, path, opset: int = 17, dynamic_batch: bool = True, size: int = SIZE) -> str:
    torch.onnx.export(model.eval(), (torch.randn(1, 3, size, size),), str(path), opset_version=opset, dynamo=False,
                      input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "N"}} if dynamic_batch else None)
    return str(path)


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - got) ** 2), 1e-30)))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "squeezenet1_1"])
def test_an_onnx_export_builds_the_library_its_torch_model_builds(name, tmp_path):
    # conv + BN + ReLU with residual adds (resnet18), depthwise convs and ReLU6 as Clip
    # (mobilenet_v2), concat (squeezenet1_1): the ONNX file's library and the torch model's compute
    # the same int8 graph from the same calibration, so their logits agree to float32 rounding of
    # the few float ops (the classifier's bias add, the global pool), far above the int8 noise
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    path = _export(model, tmp_path / f"{name}.onnx")
    options = BuildOptions(target="llvm", image_size=SIZE)
    from_onnx = compile_model(path, str(tmp_path / "onnx.so"), options=options, progress=False)
    from_torch = compile_model(model, str(tmp_path / "torch.so"), options=options, progress=False)
    photos = skimage_photos(SIZE)[:4]
    got = np.concatenate([CompiledModel(from_onnx.lib_path)(p[None]) for p in photos])
    want = np.concatenate([CompiledModel(from_torch.lib_path)(p[None]) for p in photos])
    with torch.no_grad():
        ref = model(torch.from_numpy(photos)).numpy()
    assert _sqnr(want, got) > 60                  # the two libraries: the same int8 graph
    assert abs(_sqnr(ref, got) - _sqnr(ref, want)) < 0.1    # the same SQNR against the float model
    verify = from_onnx.report["verify"]           # verified against ONNX Runtime's float logits
    assert verify["status"] in ("ok", "cannot judge")
    assert from_onnx.meta["report"]["layers"], "no int8 layer in the ONNX build's report"


class _KerasStyle(nn.Module):
    """A graph torchvision does not make: explicit Pad nodes before unpadded convs ('same' as
    Keras writes it), ReLU6, and a Flatten + Gemm classifier."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, stride=2), nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32 * 16 * 16, 10)

    def forward(self, x):
        x = nn.functional.relu6(self.c1(nn.functional.pad(x, (0, 1, 0, 1))))       # asymmetric, as TF's 'same'
        x = torch.relu(self.c2(nn.functional.pad(x, (1, 1, 1, 1))))
        x = nn.functional.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("opset", [13, 17])
def test_a_keras_style_graph_builds_at_opset_13_and_17(opset, tmp_path):
    torch.manual_seed(0)
    model = _KerasStyle().eval()
    path = _export(model, tmp_path / "keras.onnx", opset=opset, dynamic_batch=False)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"Pad", "Gemm", "Conv"} <= ops and ("Flatten" in ops or "Reshape" in ops)
    res = compile_model(path, str(tmp_path / "k.so"), options=BuildOptions(target="llvm", image_size=SIZE),
                        progress=False)
    assert res.report["verify"]["status"] == "ok"     # logits SQNR above the 15 dB floor against ONNX Runtime
    kinds = {ly["layer"]: ly for ly in res.report["layers"]}
    assert len([k for k in kinds if k.endswith("/Conv") or k.endswith("Gemm")]) == 3


def test_a_files_static_image_size_is_the_builds_and_a_contradiction_is_refused(tmp_path):
    path = _export(_KerasStyle(), tmp_path / "k.onnx", dynamic_batch=False)
    model = load_model(path)
    assert model.image_size(None) == SIZE and model.image_size(SIZE) == SIZE
    with pytest.raises(InputError, match=f"fixes its input at {SIZE}x{SIZE}; drop --image-size 32"):
        model.image_size(32)
    with pytest.raises(InputError, match="fixes its input's batch at 1, the build asks for 4: build with --batch 1"):
        model.shape_at((4, 3, SIZE, SIZE))


def test_a_symbolic_batch_is_bound_to_the_builds(tmp_path):
    model = load_model(_export(_KerasStyle(), tmp_path / "k.onnx", dynamic_batch=True))
    assert model.input_dims[0] == "N" and model.shape_at((8, 3, SIZE, SIZE)) == (8, 3, SIZE, SIZE)
    mod = model.relax((8, 3, SIZE, SIZE))
    assert [int(d) for d in mod["main"].params[0].ty.shape.values] == [8, 3, SIZE, SIZE]


def test_the_float_reference_is_onnx_runtimes_and_matches_torch(tmp_path):
    torch.manual_seed(0)
    torch_model = _KerasStyle().eval()
    model = load_model(_export(torch_model, tmp_path / "k.onnx"))
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        # ONNX Runtime's float32 kernels against torch's: a few ulps of the logits
        torch.testing.assert_close(model.eval()(x), torch_model(x), rtol=1e-4, atol=1e-5)


def _tiny_graph(path, nodes, inputs=None, outputs=None, initializers=()):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("not_a_model", "is not an ONNX model: DecodeError"),
    ("unknown_op", r"uses ops TVM's ONNX frontend has no converter for: NotAnOp \(mystery\)"),
    ("two_inputs", r"takes 2 inputs \(x, z\); a classifier build takes one image tensor"),
    ("int8_input", "input x is INT8; builds take a float32 image"),
    ("nhwc_input", "has 8 channels; the calibration images are RGB"),
    ("missing", "no such file"),
])
def test_a_bad_file_gets_one_line_naming_the_problem(case, message, tmp_path):
    path = tmp_path / f"{case}.onnx"
    relu = [helper.make_node("Relu", ["x"], ["y"], name="r")]
    if case == "not_a_model":
        path.write_bytes(b"this is not protobuf" * 50)
    elif case == "unknown_op":
        _tiny_graph(path, [helper.make_node("NotAnOp", ["x"], ["y"], name="mystery")])
    elif case == "two_inputs":
        _tiny_graph(path, [helper.make_node("Add", ["x", "z"], ["y"], name="a")],
                    inputs=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 8, 8]) for n in "xz"])
    elif case == "int8_input":
        _tiny_graph(path, relu, inputs=[helper.make_tensor_value_info("x", TensorProto.INT8, [1, 3, 8, 8])])
    elif case == "nhwc_input":
        _tiny_graph(path, relu, inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 3])])
    with pytest.raises(InputError, match=message):
        OnnxModel(str(path))


def test_weights_and_num_classes_are_refused_for_an_onnx_file(tmp_path):
    path = _export(_KerasStyle(), tmp_path / "k.onnx")
    with pytest.raises(InputError, match="an ONNX file holds its weights and classifier; drop --weights"):
        load_model(path, weights="DEFAULT")
    with pytest.raises(InputError, match="drop --num-classes"):
        load_model(path, num_classes=10)


def test_a_file_with_two_outputs_builds_its_first_and_says_so(tmp_path):
    class TwoHeads(_KerasStyle):
        def forward(self, x):
            y = super().forward(x)
            return y, y * 2

    torch.onnx.export(TwoHeads().eval(), (torch.randn(1, 3, SIZE, SIZE),), str(tmp_path / "two.onnx"), opset_version=17,
                      dynamo=False, input_names=["image"], output_names=["logits", "twice"])
    res = compile_model(str(tmp_path / "two.onnx"), str(tmp_path / "two.so"),
                        options=BuildOptions(target="llvm", image_size=SIZE, verify=False), progress=False)
    assert "the file has 2 outputs (logits, twice): the library computes the first, logits" in res.report["output"]
    assert CompiledModel(res.lib_path)(skimage_photos(SIZE)[:1]).shape == (1, 10)


def test_deploy_build_takes_an_onnx_file_and_its_image_size(tmp_path):
    path = _export(_KerasStyle(), tmp_path / "k.onnx", dynamic_batch=False)
    out = subprocess.run([sys.executable, "deploy.py", "build", "--model", path, "--target", "llvm", "-o",
                          str(tmp_path / "k.so"), "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"size={SIZE}" in out.stdout and "weights=the model file's" in out.stdout
    assert "dynamic batch" not in out.stdout       # this file fixes its batch at 1
    assert CompiledModel(str(tmp_path / "k.so")).input_shape == (1, 3, SIZE, SIZE)


def test_relu6_as_onnx_clip_is_read_as_a_clip_the_conv_absorbs(tmp_path):
    # the frontend imports Clip(x, 0, 6) as two TIR kernels (maximum, minimum); transform/clips.py
    # writes them as clip(x, 0, 6), which graph.py takes into the conv before it (an int8 clamp)
    from tvm_qconv.graph import analyze

    model = load_model(_export(_KerasStyle(), tmp_path / "k.onnx"))
    mod = model.relax((1, 3, SIZE, SIZE))
    kernels = [gv.name_hint for gv in mod.functions if gv.name_hint != "main"]
    assert not [k for k in kernels if k.startswith(("maximum", "minimum"))]
    assert "R.clip(" in mod["main"].script()
    first = analyze(mod["main"], model.layer_names()).layers[0]
    assert first.kind == "conv2d" and first.clip == (0.0, 6.0)


def test_an_onnx_files_tuning_folder_is_named_after_its_stem():
    from tvm_qconv.tuning.job import default_work_dir
    assert default_work_dir("/data/models/resnet18.onnx", 8, "sm_90a") == "tuning_logs/resnet18-b8-sm_90a"
    assert default_work_dir("models/efficientnet_lite.py:lite0", 1, "llvm") == "tuning_logs/efficientnet_lite_lite0-b1-llvm"
    assert default_work_dir("vgg16", 64, "sm_90a") == "tuning_logs/vgg16-b64-sm_90a"


class _AnySize(nn.Module):
    """Two convs, a global mean and a classifier: any height and width."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def _export_any_size(path) -> str:
    # the export docs/usage.md gives (issue 56, item 5): the TorchScript exporter (dynamo=False: the
    # default dynamo one needs the onnxscript package), batch, height and width left dynamic
    torch.manual_seed(0)
    torch.onnx.export(_AnySize().eval(), (torch.randn(1, 3, 224, 224),), str(path), dynamo=False, opset_version=17,
                      input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "batch", 2: "height", 3: "width"}})
    return str(path)


def test_a_dynamic_height_and_width_is_said_in_one_line_with_the_size_built(tmp_path, capsys):
    import deploy

    path = _export_any_size(tmp_path / "any.onnx")
    assert deploy.main(["build", "--model", path, "--target", "llvm", "--image-size", "32", "--quiet",
                        "-o", str(tmp_path / "any.so")]) == 0
    printed = capsys.readouterr().out.splitlines()
    said = [line for line in printed if "dynamic height and width" in line]
    # said as the build starts, and in the report (and so the library's record)
    assert said == [f"[build] {path} has a dynamic height and width: the library is built at 32 x 32 (--image-size "
                    "sets it)", "input: any.onnx has a dynamic height and width (height, width): the library is built "
                    "at 32 x 32 (--image-size sets it)"]
    assert CompiledModel(str(tmp_path / "any.so")).input_shape == (1, 3, 32, 32)


def test_a_file_that_fixes_its_height_and_width_gets_no_input_line(tmp_path):
    path = _export(_KerasStyle(), tmp_path / "k.onnx", dynamic_batch=True)     # H and W fixed at 64
    model = load_model(path)
    model.relax((1, 3, SIZE, SIZE))
    assert model.input_note is None and model.output_note is None


def test_every_torch_onnx_export_of_the_project_runs_without_onnxscript():
    # torch 2.11's default exporter (dynamo=True) imports onnxscript, which the project does not
    # install: each call of the project's (tests, benchmarks, the package) names the TorchScript one
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    calls = []
    files = [p for d in ("tvm_qconv", "tests", "benchmarks") for p in (root / d).rglob("*.py")] + [root / "deploy.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.onnx.export":
                dynamo = [k.value for k in node.keywords if k.arg == "dynamo"]
                calls.append((f"{path.relative_to(root)}:{node.lineno}",
                              bool(dynamo) and isinstance(dynamo[0], ast.Constant) and dynamo[0].value is False))
    assert calls and [where for where, ok in calls if not ok] == []
