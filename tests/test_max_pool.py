"""The training path's 2x2 max-pool (``tvm_qconv.nn.max_pool``): PyTorch's values and gradients bit
for bit, from a 1-byte window index instead of an int64 one; its TVM kernels (llvm builds here,
CUDA in ``test_qconv_cuda.py``) equal the torch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tvm_qconv.models import QuantizedVGG16
from tvm_qconv.nn import CompactMaxPool2d, functional
from tvm_qconv.nn import max_pool as mp

# (shape): even, an odd last row and column (skipped by the pool), one window
SHAPES = [(2, 3, 8, 6), (1, 4, 7, 9), (3, 2, 2, 2)]


def _relu_input(shape, seed=0):
    """A ReLU's output: about half zeros, so most windows hold equal maxima (ties)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).relu_()
    x[0, 0, :2, :2] = 0.0       # one all-zero window: the gradient goes to its first element
    return x


def _pool_and_grad(pool, x, g):
    x = x.clone().requires_grad_()
    out = pool(x)
    out.backward(g)
    return out.detach(), x.grad


@pytest.mark.parametrize("shape", SHAPES)
def test_the_compact_pool_gives_nn_maxpool2ds_output_and_gradient_bit_for_bit(shape):
    x = _relu_input(shape)
    g = torch.randn((shape[0], shape[1], shape[2] // 2, shape[3] // 2), generator=torch.Generator().manual_seed(1))
    ours = _pool_and_grad(CompactMaxPool2d(2, 2), x, g)
    ref = _pool_and_grad(nn.MaxPool2d(2, 2), x, g)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_the_index_is_one_byte_per_output_and_routes_ties_to_the_first_element():
    x = torch.tensor([[[[1.0, 1.0], [0.5, 1.0]], [[0.0, 0.0], [0.0, 0.0]]]]).view(1, 2, 2, 2)
    out, index = mp.max_pool2x2_torch(x)
    assert index.dtype == torch.uint8 and index.flatten().tolist() == [0, 0]
    assert out.flatten().tolist() == [1.0, 0.0]
    dx = mp.max_pool2x2_grad_torch(torch.ones(1, 2, 1, 1), index, x.shape)
    assert dx.flatten().tolist() == [1.0, 0, 0, 0, 1.0, 0, 0, 0]


def test_the_pool_keeps_an_eighth_of_nn_maxpool2ds_bytes_for_backward():
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        CompactMaxPool2d(2, 2)(x)
    assert [t.dtype for t in saved] == [torch.uint8] and saved[0].numel() == 2 * 8 * 16 * 16   # 1 byte an output


def test_outside_training_the_pool_is_f_max_pool2d():
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(CompactMaxPool2d(2, 2)(x), F.max_pool2d(x, 2, 2))
    assert torch.equal(CompactMaxPool2d(2)(x), F.max_pool2d(x, 2, 2))    # stride defaults to the kernel


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, stride=2), dict(kernel_size=2, stride=1),
                                    dict(kernel_size=2, padding=1), dict(kernel_size=2, ceil_mode=True)])
def test_other_pools_are_refused_naming_nn_maxpool2d(kwargs):
    with pytest.raises(ValueError, match="use nn.MaxPool2d"):
        CompactMaxPool2d(**kwargs)


def test_the_int8_vgg_pools_compactly_and_its_float_twin_does_not():
    assert isinstance(QuantizedVGG16(image_size=32, quantized=True).features[4], CompactMaxPool2d)
    assert type(QuantizedVGG16(image_size=32, quantized=False).features[4]) is nn.MaxPool2d


@pytest.mark.parametrize("shape", SHAPES)
def test_the_pool_kernels_equal_the_torch_reference(tmp_path, monkeypatch, shape):
    from tvm_qconv.nn import tvm_kernels
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    x = _relu_input(shape)
    out, index = tvm_kernels.max_pool(x)
    ref_out, ref_index = mp.max_pool2x2_torch(x)
    assert torch.equal(out, ref_out) and torch.equal(index, ref_index)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tvm_kernels.max_pool_grad(g, index, x.shape), mp.max_pool2x2_grad_torch(g, index, x.shape))
    monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", {"max_pool": tvm_kernels.max_pool,
                                                               "max_pool_grad": tvm_kernels.max_pool_grad})
    g_ref = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    ours = _pool_and_grad(CompactMaxPool2d(2, 2), x, g_ref)
    ref = _pool_and_grad(nn.MaxPool2d(2, 2), x, g_ref)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
