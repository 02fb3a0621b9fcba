"""One torch.export per build: the symbolic-batch export gives, at each batch, the module a static
export gives; a build (its batch, calibration at batch 1, verification and the per-layer twin)
exports once, and again only where GPTQ changed the weights."""
import numpy as np
import pytest
import torch
import tvm_ffi.structural
from torch import nn

from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.config import QuantConfig
from tvm_qconv.data import skimage_photos
from tvm_qconv.frontend import ExportedModel, export_to_relax, simplify
from tvm_qconv.ranges import Calibrate


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10)).eval()


class FixedBatch(nn.Module):
    """A model that fixes its batch (a literal 2 in a reshape): no symbolic-batch export."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 14 * 14, 10)

    def forward(self, x):
        return self.fc(self.conv(x).reshape(2, -1))


class CountExports:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = torch.export.export

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(torch.export, "export", counted)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_symbolic_batch_export_at_a_batch_is_the_static_export(batch):
    exported = ExportedModel(_net(), (4, 3, 16, 16))   # a build at batch 4: symbolic
    static, names = export_to_relax(_net(), (batch, 3, 16, 16))
    got = exported.at(batch)
    assert exported.dynamic and got.names == names
    assert tvm_ffi.structural.structural_equal(got.mod["main"], simplify(static)["main"], map_free_vars=True)


def test_every_batch_comes_from_one_export(monkeypatch):
    count = CountExports(monkeypatch)
    exported = ExportedModel(_net(), (4, 3, 16, 16))
    shapes = [tuple(int(d) for d in exported.at(b).graph.func.params[0].ty.shape.values) for b in (4, 1, 4, 2)]
    assert shapes == [(4, 3, 16, 16), (1, 3, 16, 16), (4, 3, 16, 16), (2, 3, 16, 16)]
    assert count.calls == exported.exports == 1


def test_a_model_that_fixes_its_batch_is_exported_at_its_batch(monkeypatch):
    count = CountExports(monkeypatch)
    exported = ExportedModel(FixedBatch().eval(), (2, 3, 16, 16))
    assert [ly.kind for ly in exported.at(2).graph.layers] == ["conv2d", "dense"]
    assert exported.dynamic is False
    assert count.calls == 2  # the symbolic try, then the static export


def test_a_batch_1_build_exports_statically_once(monkeypatch):
    count = CountExports(monkeypatch)
    exported = ExportedModel(_net(), (1, 3, 16, 16))
    exported.at(1), exported.at(1)
    assert exported.dynamic is False and count.calls == 1


@pytest.mark.parametrize("rounding,exports", [("nearest", 1), ("gptq", 2)])
def test_a_build_with_its_verification_twin_exports_once_and_again_only_for_gptq(tmp_path, monkeypatch,
                                                                                  rounding, exports):
    photos = skimage_photos(16)
    count = CountExports(monkeypatch)
    # batch 2 (calibration runs at batch 1) and an accuracy target no build meets, so the
    # verification also builds its per-layer twin at batch 1
    res = compile_model(_net(), str(tmp_path / "net.so"), options=BuildOptions(batch=2, image_size=16,
                                                                             accuracy_target_db=200.0),
                        config=QuantConfig(num_calib_images=4, weight_rounding=rounding),
                        ranges=Calibrate(photos[:6]), progress=False)
    assert res.report["verify"]["layers"], "the per-layer twin ran"
    assert count.calls == exports
    assert np.isfinite(res.report["verify"]["logits_sqnr_db"])


def test_a_spatial_mean_that_drops_its_axes_is_simplified_into_a_global_pool_and_a_view():
    # x.mean((2, 3)) (ShuffleNet-V2's classifier input): mean(keepdims=True) then reshape, the same
    # values, so graph.py finds the int8 global pool it is (transform/global_means.py)
    import tvm
    from tvm import relax

    from tvm_qconv.graph import analyze

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))

    mod, names = export_to_relax(Head().eval(), (2, 3, 9, 9))
    simple = simplify(mod)
    means = [b.value for b in simple["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", None) == "relax.mean"]
    assert len(means) == 1 and bool(means[0].attrs.keepdims)
    assert [ly.kind for ly in analyze(simple["main"], names).layers] == ["conv2d", "avg_pool2d", "dense"]
    x = np.random.default_rng(0).normal(size=(2, 3, 9, 9)).astype(np.float32)
    outs = []
    for m in (mod, simple):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(x))
        outs.append((out[0] if not hasattr(out, "numpy") else out).numpy())    # the exported main returns a tuple
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)   # float32 sums in another order


def test_every_registered_frontend_implements_the_interface_and_agrees_with_its_reference(tmp_path):
    """Each kind of model (torch module, ONNX file) is a ``Frontend``: the members the build, ``compare``,
    ``eval`` and the CLIs use exist, and its float Relax graph at batch 2 computes its own ``reference``
    on the same input (float32 through two runtimes: 1e-4 of the logits' scale)."""
    from tvm import relax
    import tvm

    from tvm_qconv.frontend import FRONTENDS, Frontend, as_frontend, load_model

    onnx_path = tmp_path / "net.onnx"
    torch.onnx.export(_net(), (torch.randn(1, 3, 16, 16),), str(onnx_path), dynamo=False, opset_version=17,
                      input_names=["x"], dynamic_axes={"x": {0: "N"}})
    models = {"torch_model": as_frontend(_net(), "net"), "onnx_model": as_frontend(load_model(str(onnx_path)))}
    assert sorted(models) == sorted(f.__name__.rsplit(".", 1)[1] for f in FRONTENDS)   # one case per frontend
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    for kind, model in models.items():
        assert isinstance(model, Frontend), kind
        assert model.probe((2, 3, 16, 16)).output_path == ()
        assert model.image_size(None) == (model.fixed_size or 224)      # the ONNX file fixes 16 x 16
        assert len(model.digest()) > 0
        graph = model.export((2, 3, 16, 16)).at(2)
        vm = relax.VirtualMachine(relax.build(graph.mod, target="llvm"), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(x))
        out = out if isinstance(out, tvm.runtime.Tensor) else out[0]    # torch's importer returns a tuple
        ref = model.reference(x)
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-4 * np.abs(ref).max(), err_msg=kind)
