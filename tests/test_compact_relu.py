"""The training path's ReLU (``tvm_qconv.nn.relu``): ``nn.ReLU``'s values and gradients bit for
bit, keeping a 1-bit mask for backward instead of the float output."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tvm_qconv.nn import CompactReLU, functional


def _relu_and_grad(relu, x, g):
    x = x.clone().requires_grad_()
    y = relu(x)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 16), (1, 8, 4, 4)])    # a partial last byte; 2-d; whole bytes
def test_compact_relu_gives_nn_relus_output_and_gradient_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-45])     # zeros get no gradient, a subnormal does
    ours, ref = _relu_and_grad(CompactReLU(), x, g), _relu_and_grad(nn.ReLU(), x, g)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_compact_relu_keeps_one_bit_an_element_for_backward():
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        CompactReLU(inplace=True)(x * 1.0)
    kept = [t for t in saved if t.dtype == torch.uint8]
    assert len(kept) == 1 and kept[0].numel() == x.numel() // 8
    assert not [t for t in saved if t.is_floating_point() and t.numel() == x.numel()]


def test_compact_relu_without_a_gradient_is_torch_relu():
    x = torch.randn(3, 4, 5, 6)
    with torch.no_grad():
        assert torch.equal(CompactReLU()(x), torch.relu(x))


def test_the_int8_resnet50_keeps_compact_relus_and_its_float_twin_nn_relus():
    pytest.importorskip("torchvision")
    from tvm_qconv.models import quantized_resnet50
    kinds = lambda m: {type(c) for c in m.modules() if isinstance(c, nn.ReLU)}   # noqa: E731
    assert kinds(quantized_resnet50(num_classes=10)) == {CompactReLU}
    assert kinds(quantized_resnet50(num_classes=10, quantized=False)) == {nn.ReLU}


# (shape, the forward's kernel): 210 elements, a partial last byte (torch's relu, then the bits
# kernel); 240, whole bytes (elementwise.relu: relu, bits and range in one kernel)
@pytest.mark.parametrize("shape, forward", [((2, 3, 5, 7), "relu_bits"), ((2, 3, 5, 8), "relu")])
def test_compact_relu_through_the_kernels_matches(tmp_path, monkeypatch, shape, forward):
    from tvm_qconv.nn import tvm_kernels
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    monkeypatch.setattr(tvm_kernels, "CALLS", tvm_kernels.collections.Counter())
    monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", {
        "relu_bits": tvm_kernels.relu_bits, "relu_with_bits": tvm_kernels.relu_with_bits, "mask": tvm_kernels.mask})
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])     # zeros get no gradient, a subnormal does
    ours, ref = _relu_and_grad(CompactReLU(), x, g), _relu_and_grad(nn.ReLU(), x, g)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert {k for k, _ in tvm_kernels.CALLS} == {forward, "mask"}


def test_compact_relu_kernel_keeps_nan_and_passes_its_gradient_as_nn_relu(tmp_path, monkeypatch):
    # relu(NaN) = NaN and threshold_backward passes the gradient there (NaN <= 0 is false); the
    # range the kernel notes for the next layer is NaN too, as aminmax's
    from tvm_qconv.nn import tvm_kernels
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", {
        "relu_bits": tvm_kernels.relu_bits, "relu_with_bits": tvm_kernels.relu_with_bits, "mask": tvm_kernels.mask})
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 4, generator=gen)
    x.view(-1)[5] = float("nan")
    ours, ref = _relu_and_grad(CompactReLU(), x, g), _relu_and_grad(nn.ReLU(), x, g)
    assert torch.equal(ours[0].isnan(), ref[0].isnan()) and torch.equal(ours[0].nan_to_num(), ref[0].nan_to_num())
    assert torch.equal(ours[1], ref[1]) and ours[1].view(-1)[5] == g.view(-1)[5]
    y, _ = tvm_kernels.relu_with_bits(x)
    assert functional.batch_amax(y).isnan()
