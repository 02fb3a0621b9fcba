"""A conv with a bias followed by a batch norm folds into one conv (issue 56, item 1).

``nn.Conv2d(bias=True)`` -> ``nn.BatchNorm2d`` in a user's model, or an ONNX ``Conv`` with its
bias input -> ``BatchNormalization``: the build has one int8 conv layer per conv, no batch-norm
layer and no float op of its own, and its logits agree with the float model's
(``transform/conv_bias_batch_norms.py``).  llvm builds at 32 px of a 3-conv net.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import deploy
from tvm_qconv.data import skimage_photos
from tvm_qconv.evaluate import sqnr_db
from tvm_qconv.frontend import export_to_relax, load_model, simplify
from tvm_qconv.runtime import CompiledModel

SIZE = 32

# Convs with biases, each before a batch norm whose statistics are not the identity's (a fold that
# dropped the bias or the mean would be off by O(1) in every channel): a plain conv, a depthwise
# one and a strided one, a ReLU after the first two, then the global mean and the classifier.
MODEL_FILE = '''
import torch
from torch import nn


def _bn(channels):
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=True), _bn(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=True), _bn(16), nn.ReLU(),
            nn.Conv2d(16, 24, 3, stride=2, padding=1, bias=True), _bn(24), nn.ReLU())
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def make():
    return Net().eval()
'''
CONVS = 3


def _torch_model_spec(tmp_path) -> tuple[str, torch.nn.Module]:
    path = tmp_path / "biased.py"
    path.write_text(MODEL_FILE)
    return f"{path}:make", load_model(f"{path}:make")


def _onnx_file(tmp_path) -> tuple[str, torch.nn.Module]:
    """The same net as an ONNX file written node by node: ``Conv`` with its bias input, then
    ``BatchNormalization`` (torch.onnx.export would fold the pair itself), so the fold is the build's."""
    _, model = _torch_model_spec(tmp_path)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    inits, nodes, x = [], [], "image"
    for i, (conv, bn, groups, stride) in enumerate([(0, 1, 1, 1), (3, 4, 16, 1), (6, 7, 1, 2)]):
        c, b = f"body.{conv}", f"body.{bn}"
        names = [f"{c}.weight", f"{c}.bias", f"{b}.weight", f"{b}.bias", f"{b}.running_mean", f"{b}.running_var"]
        inits += [numpy_helper.from_array(sd[n], n) for n in names]
        nodes += [helper.make_node("Conv", [x, names[0], names[1]], [f"conv{i}"], name=f"conv{i}", pads=[1, 1, 1, 1],
                                   group=groups, strides=[stride, stride]),
                  helper.make_node("BatchNormalization", [f"conv{i}"] + names[2:], [f"bn{i}"], name=f"bn{i}",
                                   epsilon=1e-5),
                  helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"], name=f"relu{i}")]
        x = f"relu{i}"
    inits += [numpy_helper.from_array(sd["head.weight"], "head.weight"),
              numpy_helper.from_array(sd["head.bias"], "head.bias")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"),
              helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "head.weight", "head.bias"], ["logits"], name="head", transB=1)]
    graph = helper.make_graph(nodes, "biased", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                              [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializer=inits)
    path = tmp_path / "biased.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path), model


FRONTENDS = [_torch_model_spec, _onnx_file]


@pytest.mark.parametrize("made", FRONTENDS, ids=["torch_py_file", "onnx_file"])
def test_a_biased_conv_and_its_batch_norm_build_as_one_int8_conv(made, tmp_path, capsys):
    spec, model = made(tmp_path)
    out = tmp_path / "net.so"
    assert deploy.main(["build", "--model", spec, "--target", "llvm", "--image-size", str(SIZE), "--quiet",
                        "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.with_suffix(".json").read_text())["report"]
    kinds = [r["kind"] for r in report["layers"]]
    assert sum(k.startswith("conv2d") for k in kinds) == CONVS          # one conv layer per conv
    assert not [k for k in kinds if "batch_norm" in k], kinds           # no batch norm left as a layer
    assert all(r["dtype"] == "int8" for r in report["layers"]), report["layers"]
    # the only float op is the view before the classifier (the pooled [1, 24, 1, 1] as [1, 24]), as in
    # every classifier here: nothing of the batch norms
    assert report["float_ops"] == {"relax.reshape": 1} and "stayed float: reshape x1" in printed
    # 3 int8 convs and an int8 classifier: measured 43.3 dB for both files; a fold that lost the
    # biases would be under the floor (the float model without them: 19.4 dB from the model)
    assert report["verify"]["status"] == "ok" and report["verify"]["logits_sqnr_db"] > 35.0
    photos = skimage_photos(SIZE)[:4]
    with torch.no_grad():
        want = model(torch.from_numpy(photos)).numpy()
    got = np.concatenate([CompiledModel(str(out))(p[None]) for p in photos])
    assert sqnr_db(want, got) > 35.0


def _simplified_matches_torch(model) -> str:
    """The simplified float graph's script, after checking it computes what torch does."""
    import tvm
    from tvm import relax

    mod, _ = export_to_relax(model, (1, 3, SIZE, SIZE))
    folded = simplify(mod)
    vm = relax.VirtualMachine(tvm.compile(folded, target="llvm"), tvm.cpu())
    x = skimage_photos(SIZE)[:1]
    got = vm["main"](tvm.runtime.tensor(x))[0].numpy()
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)     # float32 reassociation only
    return folded["main"].script()


def test_the_fold_is_exact_in_float(tmp_path):
    _, model = _torch_model_spec(tmp_path)
    assert "batch_norm" not in _simplified_matches_torch(model)


class _SharedConvOutput(torch.nn.Module):
    """A biased conv whose output a batch norm and a residual add both read: folding the batch norm
    would change the residual's addend, so the pair stays as it is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_a_biased_conv_whose_output_is_read_elsewhere_keeps_its_batch_norm():
    assert "batch_norm" in _simplified_matches_torch(_SharedConvOutput().eval())
