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
    from models.quantized_resnet import fuse_batch_norm_relu
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
