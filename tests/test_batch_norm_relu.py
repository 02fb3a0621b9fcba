"""BatchNorm (+ add) + ReLU as one op (``tvm_qconv/nn/batch_norm.py``) against torch's modules:
outputs, every gradient and the running statistics, in training and eval, on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tvm_qconv.nn.batch_norm import BatchNormReLU

# float32 throughout; the op's sums are float64 where torch's CPU BatchNorm sums in float32 and
# its backward orders operations differently: a few float32 ulps of the gradient's scale
TOL = dict(rtol=1e-4, atol=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.detach() - b.detach()) / torch.linalg.vector_norm(b.detach()))


def _pair(channels=6, momentum=0.1):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(channels, momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    ours = BatchNormReLU(channels, momentum=momentum)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("residual", [False, True], ids=["bn_relu", "bn_add_relu"])
def test_matches_torchs_batch_norm_add_relu_and_its_gradients(train, residual):
    ours, ref = _pair()
    ours.train(train), ref.train(train)
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(4, 6, 5, 7, generator=g) * 3 + 1).requires_grad_()
    add = torch.randn(4, 6, 5, 7, generator=g).requires_grad_() if residual else None
    grad = torch.randn(4, 6, 5, 7, generator=g)
    y2 = y.detach().clone().requires_grad_()
    add2 = add.detach().clone().requires_grad_() if residual else None
    out = ours(y, add)
    z = ref(y2)
    expect = torch.relu(z + add2 if residual else z)
    torch.testing.assert_close(out, expect, **TOL)
    out.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(y.grad, y2.grad, **TOL)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **TOL)
    if residual:
        torch.testing.assert_close(add.grad, add2.grad, **TOL)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked)


def test_backward_keeps_the_input_and_one_bit_an_element():
    # what the autograd graph holds: y (as BatchNorm), the ReLU's bits, per-channel statistics;
    # not the normalized or the ReLU's float output
    ours, _ = _pair(channels=16)
    y = torch.randn(2, 16, 8, 8, requires_grad=True)
    out = ours(y)
    saved = out.grad_fn.saved_tensors
    assert sum(t.numel() * t.element_size() for t in saved if t.dim() == 4) == y.numel() * 4
    assert any(t.dtype == torch.uint8 and t.numel() == y.numel() // 8 for t in saved)


def test_without_a_gradient_or_in_float64_it_is_torchs_modules():
    ours, ref = _pair()
    y = torch.randn(2, 6, 3, 3, dtype=torch.float64)
    ours.double(), ref.double()
    torch.testing.assert_close(ours(y), torch.relu(ref(y)))
    with torch.no_grad():
        ours.float(), ref.float()
        y = y.float()
        torch.testing.assert_close(ours(y), torch.relu(ref(y)))


def test_state_dict_is_batch_norm_2ds():
    ours, ref = _pair()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    copy.deepcopy(ours).load_state_dict(ref.state_dict())


def test_a_fused_resnet_computes_torchvisions_resnet():
    # fuse_batch_norm_relu on torchvision's ResNet-18 and -50 (float: the op alone) against the
    # unfused model in float64 (the truth): the fused float32 model about as close to it as
    # torch's own float32 model.  Both are ~2 % off on some BatchNorm parameters (64 px: the last
    # maps are 2 x 2, BatchNorm's backward over 16 elements a channel cancels); and a ReLU input
    # within rounding of 0 may fall on the other side in either (the two round the normalization
    # in another order), moving a last-block bias gradient by ~0.3 % where torch's happens to be exact
    import torchvision
    from tvm_qconv.models.quantized_resnet import fuse_batch_norm_relu
    for build in (torchvision.models.resnet18, torchvision.models.resnet50):
        torch.manual_seed(0)
        ref = build(num_classes=10)
        fused = fuse_batch_norm_relu(copy.deepcopy(ref))
        truth = copy.deepcopy(ref).double()
        assert fused.state_dict().keys() == ref.state_dict().keys()
        x = torch.randn(4, 3, 64, 64)
        w = torch.randn(4, 10)          # a loss whose gradient BatchNorm does not cancel (a sum would)
        grads, outs = [], []
        for model, dtype in ((truth, torch.float64), (ref, torch.float32), (fused, torch.float32)):
            xi = x.to(dtype).clone().requires_grad_()     # a leaf of its own: to() of the same dtype is x
            out = model(xi)
            (out * w.to(dtype)).sum().backward()
            outs.append(out.double())
            grads.append([xi.grad.double()] + [p.grad.double() for p in model.parameters()])
        assert _rel(outs[2], outs[0]) <= max(2 * _rel(outs[1], outs[0]), 1e-6)
        for g_truth, g_ref, g_fused in zip(*grads):
            assert _rel(g_fused, g_truth) <= 2 * _rel(g_ref, g_truth) + 1e-2
        for name, b in truth.named_buffers():
            torch.testing.assert_close(dict(fused.named_buffers())[name].double(), b.double(), rtol=1e-4, atol=1e-5,
                                       msg=name)


def test_the_int8_resnet50_trains_with_the_fused_op():
    from tvm_qconv.models import quantized_resnet50
    torch.manual_seed(0)
    model = quantized_resnet50(num_classes=10, fuse_bn_relu=True)
    assert sum(isinstance(m, BatchNormReLU) for m in model.modules()) == 1 + 16 * 3
    x = torch.randn(2, 3, 64, 64)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_fused_blocks_identity_gradient_joins_its_first_convs_with_autograds_bits(monkeypatch):
    # the fused blocks take the identity from their first int8 conv (passthrough): its gradient is
    # added to that conv's input gradient inside backward; every gradient has the bits it has when
    # autograd adds the two (the first conv called plainly)
    from tvm_qconv.models import quantized_resnet
    from tvm_qconv.nn import functional
    joined = []
    dequantized = functional._int8_conv_dequantized
    monkeypatch.setattr(functional, "_int8_conv_dequantized",
                        lambda *a, **k: joined.append(k.get("addend") is not None) or dequantized(*a, **k))
    torch.manual_seed(0)
    model = quantized_resnet.quantized_resnet50(num_classes=10, input_grad="int8", weight_grad="int8",
                                                fuse_bn_relu=True)
    x0 = torch.randn(2, 3, 64, 64)
    results = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(quantized_resnet, "_first_conv", lambda conv, x: (conv(x), x))
        m = copy.deepcopy(model)
        x = x0.clone().requires_grad_()
        joined.clear()
        nn.functional.cross_entropy(m(x), torch.tensor([1, 2])).backward()
        results.append([x.grad] + [p.grad for p in m.parameters()])
        assert sum(joined) == (0 if plain else 16)      # each of the 16 blocks' first conv
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("residual", [False, True], ids=["bn_relu", "bn_add_relu"])
def test_the_backward_kernels_give_the_definitions_gradients(residual, tmp_path, monkeypatch):
    # tvm_kernels' six kernels (llvm builds of elementwise.bn_stats, bn_finish, bn_relu,
    # bn_grad_sums, bn_coeffs, bn_grad) in place of the torch definition: the same values (each
    # float32 operation rounded as the definition's; its float64 sums summed in another order, equal
    # to their last bits)
    from tvm_qconv.nn import functional, tvm_kernels
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    ours, _ = _pair(channels=5)
    twin = copy.deepcopy(ours)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(4, 5, 6, 6, generator=g) * 2 + 0.5      # 720 elements: whole bytes of bits
    add = torch.randn(4, 5, 6, 6, generator=g) if residual else None
    grad = torch.randn(4, 5, 6, 6, generator=g)
    results = []
    for kernels in ({}, {"bn_train_stats": tvm_kernels.bn_train_stats, "bn_relu": tvm_kernels.bn_relu,
                         "bn_grad_sums": tvm_kernels.bn_grad_sums, "bn_coeffs": tvm_kernels.bn_coeffs,
                         "bn_grad": tvm_kernels.bn_grad}):
        monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", kernels)
        model = ours if not kernels else twin
        yi = y.clone().requires_grad_()
        ai = add.clone().requires_grad_() if residual else None
        out = model(yi, ai)
        out.backward(grad)
        results.append([out.detach(), model.running_var.clone(), yi.grad, model.weight.grad, model.bias.grad]
                       + ([ai.grad] if residual else []))
    (out0, rv0, dy0, dg0, db0, *da0), (out1, rv1, dy1, dg1, db1, *da1) = results
    # the forward's statistics from float64 sums in another order: the same float32 values here
    torch.testing.assert_close(out1, out0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rv1, rv0, rtol=1e-6, atol=1e-7)
    assert torch.equal(dy0, dy1) or torch.allclose(dy0, dy1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dg1, dg0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(db1, db0, rtol=1e-6, atol=1e-7)
    if residual:
        assert torch.equal(da1[0], da0[0])
    assert {k for k, _ in tvm_kernels.CALLS} >= {"bn_stats", "bn_finish", "bn_relu", "bn_grad_sums", "bn_coeffs",
                                                "bn_grad"}


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["bn_relu", "bn_add_relu"])
def test_on_cuda_the_kernels_give_the_cpu_definitions_values(residual):
    # BatchNormReLU on CUDA (tvm_kernels' four kernels) against the same module on the CPU (the
    # torch definition): the output, its bits' gradient mask and every gradient; the float64 sums'
    # order differs, each float32 operation is rounded the same (CUDA's __f*_rn)
    from tvm_qconv.nn import functional, tvm_kernels
    cuda = torch.device("cuda")
    functional._load_lazy_kernels("cuda")
    ours, _ = _pair(channels=64)
    twin = copy.deepcopy(ours).to(cuda)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(8, 64, 14, 14, generator=g) * 2 + 0.5
    add = torch.randn(8, 64, 14, 14, generator=g) if residual else None
    grad = torch.randn(8, 64, 14, 14, generator=g)
    results = []
    for model, dev in ((ours, torch.device("cpu")), (twin, cuda)):
        # leaves on each device (y.to("cpu") would be y itself, and y.to("cuda") of it no leaf)
        yi = y.detach().to(dev).requires_grad_()
        ai = add.detach().to(dev).requires_grad_() if residual else None
        tvm_kernels.CALLS.clear()
        out = model(yi, ai)
        out.backward(grad.to(dev))
        results.append([t.detach().cpu() for t in [out, model.running_mean, model.running_var, yi.grad,
                                                    model.weight.grad, model.bias.grad] + ([ai.grad] if residual else [])])
    assert {k for k, _ in tvm_kernels.CALLS} >= {"bn_stats", "bn_finish", "bn_relu", "bn_grad_sums", "bn_coeffs",
                                                "bn_grad"}
    for cpu, gpu in zip(*results):
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)


def test_the_training_benchmark_fuses_ours_only():
    # train_memory.py --fuse-bn-relu: our ResNet-50 with the op, the float twins with torch's modules
    from benchmarks.train_memory import build_model
    ours = build_model("resnet50", 10, 64, quantized=True, fuse_bn_relu=True)
    twin = build_model("resnet50", 10, 64, quantized=False, fuse_bn_relu=True)
    assert any(isinstance(m, BatchNormReLU) for m in ours.modules())
    assert not any(isinstance(m, BatchNormReLU) for m in twin.modules())


def test_the_int8_resnet50_fuses_by_default_and_its_float_twin_does_not():
    # fuse_bn_relu=None (the default): fused exactly when quantized; an explicit False keeps torch's
    from tvm_qconv.models import quantized_resnet50
    has_op = lambda m: any(isinstance(c, BatchNormReLU) for c in m.modules())   # noqa: E731
    assert has_op(quantized_resnet50(num_classes=10))
    assert not has_op(quantized_resnet50(num_classes=10, quantized=False))
    assert not has_op(quantized_resnet50(num_classes=10, fuse_bn_relu=False))


def test_eval_statistics_are_constants_and_an_inf_elsewhere_stays_out_of_a_gradient():
    # eval: the running statistics (made non-trivial here), no gradient through them, and dy of an
    # element only from its own gradient (a y of inf next to it does not leak NaN into it)
    ours, ref = _pair(channels=2)
    with torch.no_grad():
        for m in (ours, ref):
            m.running_mean.copy_(torch.tensor([0.5, -1.0]))
            m.running_var.copy_(torch.tensor([2.0, 0.25]))
    ours.eval(), ref.eval()
    y = torch.randn(2, 2, 3, 3)
    y[0, 0, 0, 0] = float("inf")
    ya, yb = y.clone().requires_grad_(), y.clone().requires_grad_()
    grad = torch.randn(2, 2, 3, 3)
    ours(ya).backward(grad)
    torch.relu(ref(yb)).backward(grad)
    assert torch.isfinite(ya.grad).all()        # the inf's own gradient too: gamma * invstd * g
    torch.testing.assert_close(ya.grad, yb.grad, **TOL)


def test_one_value_a_channel_in_training_is_refused_as_torch_does():
    ours, _ = _pair(channels=3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ours(torch.randn(1, 3, 1, 1, requires_grad=True))


def test_fusing_keeps_a_frozen_batch_norm_frozen():
    import torchvision
    from tvm_qconv.models.quantized_resnet import fuse_batch_norm_relu
    model = torchvision.models.resnet18(num_classes=10)
    model.layer1[0].bn1.weight.requires_grad_(False)
    fuse_batch_norm_relu(model)
    assert isinstance(model.layer1[0].bn1, BatchNormReLU) and not model.layer1[0].bn1.weight.requires_grad
