"""The int8 QAT layers on CUDA, through the TVM kernels: the CPU autograd tests, on the GPU.

Mirrors ``test_qconv_autograd.py`` (same cases, same differential helper, same tolerances):
ours on CUDA against the float64 autograd of the dequantized graph (tight) and against the
float twin on CUDA (int8 tolerances); the forward int32 accumulators bit-exact against the CPU
kernel; non-contiguous inputs; streams; and that the TVM kernels, not torch convs, ran.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tvm_qconv.models import SmallQuantizedVGG
from tests.test_grad_kernels import _int8_dx_is_a_conv
from tests.test_qconv_autograd import (CASES, CASE_IDS, GRADS, TWIN_GRAD_TOLERANCE, Case, _input, _reference,
                                       _run, assert_matches_reference, relative_error)
from tvm_qconv.nn import QuantizedLinear, batch_amax, functional, quantize_per_tensor, quantize_weight
from tvm_qconv.nn import tvm_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")]
CUDA = torch.device("cuda")
KINDS = {"quantize", "pack", "forward", "dequantize", "relu_bits", "mask", "grad_input", "grad_weight", "grad_stats",
         "quantize_grad", "scale_sums", "flip_transpose", "max_pool", "max_pool_grad",
         "conv_scales", "range_ema", "grad_finish"}  # all kinds
TORCH_CONVS = {"aten::conv2d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
               "aten::convolution_backward", "aten::cudnn_convolution_backward", "aten::linear", "aten::mm",
               "aten::addmm"}


def run_cuda_twins(case: Case, x: torch.Tensor | None = None, grad: torch.Tensor | None = None, seed: int = 0):
    """``(ours, twin, ref)`` on CUDA: the same seeded weights, input and gradient through ours,
    the float twin and the float64 reference (all on the GPU)."""
    torch.manual_seed(seed)
    ours, twin = case.layers()
    twin.load_state_dict(ours.state_dict())
    ours, twin = ours.to(CUDA), twin.to(CUDA)
    x = _input(case, seed).to(CUDA) if x is None else x
    if grad is None:
        with torch.no_grad():
            shape = twin(x).shape
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(CUDA)
    res_ours, _ = _run(ours, x, grad)
    res_twin, _ = _run(twin, x, grad)
    return res_ours, res_twin, _reference(case, ours, x, grad, batch_amax(x))


@pytest.fixture(autouse=True)
def tvm_kernels_registered():
    torch.zeros(1, device=CUDA)
    functional._load_lazy_kernels("cuda")
    assert functional.INT8_CONV_KERNELS["cuda"] is tvm_kernels.int8_conv, "TVM_QCONV_KERNELS=torch is set?"
    tvm_kernels.CALLS.clear()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_layer_matches_exact_dequantized_reference(case):
    ours, _, ref = run_cuda_twins(case)
    for name in ("out",) + tuple(GRADS):
        if getattr(ref, name) is None:
            assert getattr(ours, name) is None, name
        else:
            assert getattr(ours, name).device.type == "cuda"
            assert_matches_reference(getattr(ours, name), getattr(ref, name))
    assert {"quantize", "forward", "grad_input", "grad_weight"} <= {k for k, _ in tvm_kernels.CALLS} <= KINDS


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_output_within_int8_tolerance_of_twin(case):
    ours, twin, _ = run_cuda_twins(case)
    torch.testing.assert_close(ours.out, twin.out, atol=0.05, rtol=0.01)  # seed 000's bound; see the CPU test


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_gradient_close_to_float_twin(case, grad):
    ours, twin, _ = run_cuda_twins(case)
    if getattr(twin, grad) is None:
        assert getattr(ours, grad) is None
        return
    # The twin runs cuDNN with TF32 allowed (PyTorch's default for convs): its error (~1e-3
    # relative) is far inside these int8 tolerances.
    assert relative_error(getattr(ours, grad), getattr(twin, grad)) < TWIN_GRAD_TOLERANCE[case.relu]


def _int8_operands(case: Case):
    """Random int8 input and weight of ``case`` and its conv arguments (stride, padding4, dilation, groups)."""
    g = torch.Generator().manual_seed(0)
    layer, _ = case.layers()
    x_q = torch.randint(-127, 128, (case.batch, case.cin) + case.hw, generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, layer.weight.shape, generator=g, dtype=torch.int8)
    args = (layer.stride, functional.padding4(case.padding, layer.kernel_size, layer.dilation), layer.dilation,
            case.groups)
    return x_q, w_q, args


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_int8_conv_is_bit_exact_against_cpu_kernel(case):
    x_q, w_q, args = _int8_operands(case)
    acc = functional._int8_conv_forward(x_q.to(CUDA), w_q.to(CUDA), *args)
    assert acc.dtype == torch.int32 and acc.is_cuda
    assert torch.equal(acc.cpu(), functional.int8_conv_cpu(x_q, w_q, *args))


def test_cuda_no_bias_has_no_bias_gradient():
    ours, twin, ref = run_cuda_twins(Case("nb", bias=False))
    assert ours.db is None and twin.db is None
    assert_matches_reference(ours.out, ref.out)
    assert_matches_reference(ours.dw, ref.dw)


def _sliced_cuda(x):
    big = torch.zeros(x.shape[:-1] + (2 * x.shape[-1],), device=x.device)
    big[..., ::2] = x
    return big[..., ::2]


NONCONTIGUOUS_CUDA = {
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "transposed": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3),
    "sliced": _sliced_cuda,
}


@pytest.mark.parametrize("layout", list(NONCONTIGUOUS_CUDA), ids=list(NONCONTIGUOUS_CUDA))
def test_cuda_noncontiguous_input_and_grad_give_bit_identical_results(layout):
    base = CASES[0]
    x = _input(base, 0).to(CUDA)
    strided = NONCONTIGUOUS_CUDA[layout](x)
    assert not strided.is_contiguous() and torch.equal(strided, x)
    contiguous, _, _ = run_cuda_twins(base, x=x)
    grad = torch.randn(contiguous.out.shape, generator=torch.Generator().manual_seed(1)).to(CUDA)
    ours, _, _ = run_cuda_twins(base, x=strided, grad=NONCONTIGUOUS_CUDA[layout](grad))
    for name in ("out",) + tuple(GRADS):
        assert torch.equal(getattr(ours, name), getattr(contiguous, name)), name


def test_cuda_linear_matches_reference():
    torch.manual_seed(0)
    layer = QuantizedLinear(300, 70).to(CUDA)
    x = torch.randn(33, 300, device=CUDA, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    x_q, s_x = quantize_per_tensor(x, batch_amax(x))
    w_q, s_w = quantize_weight(layer.weight)
    w_deq = w_q.double() * s_w.double()[:, None]
    assert_matches_reference(y.detach(), (x_q.double() * s_x.double()) @ w_deq.T + layer.bias.detach().double())
    assert_matches_reference(x.grad, g.double() @ w_deq)
    assert_matches_reference(layer.weight.grad, g.double().T @ (x_q.double() * s_x.double()))


def test_kernels_run_on_torchs_current_stream():
    # On a side stream, the input is written after a ~50 ms sleep; a kernel launched on any
    # other stream would read it before it is written.
    case = CASES[0]
    ours_ref, _, _ = run_cuda_twins(case)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.manual_seed(0)
        layer, _ = case.layers()
        layer = layer.to(CUDA)
        x = torch.zeros((case.batch, case.cin) + case.hw, device=CUDA)
        torch.cuda._sleep(100_000_000)
        x.copy_(_input(case, 0).to(CUDA, non_blocking=False))
        x.requires_grad_()
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(CUDA))
    torch.cuda.synchronize()
    assert torch.equal(out.detach(), ours_ref.out)
    assert torch.equal(x.grad, ours_ref.dx) and torch.equal(layer.weight.grad, ours_ref.dw)


# float32 gradients: every kernel kind (SmallVGG's 16+ channel convs on the tensor cores, their
# NHWC32 accumulators dequantized by TVM); int8 ones at batch 16: dx and dw are int8 convs on the
# forward's kernels too, so no float gradient kernel runs
@pytest.mark.parametrize("grads, batch, kinds", [
    ("float32", 8, KINDS - {"grad_stats", "grad_finish", "quantize_grad", "scale_sums", "flip_transpose"}),
    ("int8", 16, KINDS - {"grad_input", "grad_weight", "mask"})])
def test_a_training_step_runs_tvm_kernels_and_no_torch_conv(grads, batch, kinds):
    torch.manual_seed(0)
    model = SmallQuantizedVGG(input_grad=grads, weight_grad=grads).to(CUDA)
    x = torch.randn(batch, 3, 32, 32, device=CUDA)
    target = torch.randint(0, 10, (batch,), device=CUDA)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
    ops = {e.key for e in prof.key_averages()}
    assert not ops & TORCH_CONVS, sorted(ops & TORCH_CONVS)
    assert {k for k, _ in tvm_kernels.CALLS} == kinds
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_result_type_is_unchanged_by_the_cuda_path():
    ours, twin, _ = run_cuda_twins(CASES[0])
    for name in ("out",) + tuple(GRADS):
        a, b = getattr(ours, name), getattr(twin, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name


def _qat_step(model, opt, x, target):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    return loss


def _small_vgg_and_sgd(grads: str = "float32"):
    torch.manual_seed(0)
    model = SmallQuantizedVGG(input_grad=grads, weight_grad=grads).to(CUDA).train()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batches(n: int, batch: int = 8):
    g = torch.Generator(device=CUDA).manual_seed(3)
    return [(torch.randn(batch, 3, 32, 32, device=CUDA, generator=g),
             torch.randint(0, 10, (batch,), device=CUDA, generator=g)) for _ in range(n)]


# float32 gradients at batch 8; int8 ones at batch 16 (the tensor cores take dw from 16)
GRAD_SETUPS = [("float32", 8), ("int8", 16)]


@pytest.mark.parametrize("grads, batch", GRAD_SETUPS)
def test_a_training_step_reads_nothing_back_to_the_host(grads, batch):
    # torch raises on any synchronizing call (a tensor's bool(), .item(), a pageable copy) in this
    # mode; the clip test and the bit weights' host -> device copies were such calls (issue 35)
    model, opt = _small_vgg_and_sgd(grads)
    (x, t), = _batches(1, batch)
    _qat_step(model, opt, x, t)         # the first step builds or loads the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _qat_step(model, opt, x, t)
        model.eval()
        with torch.no_grad():
            model(x)                    # eval: the learned ranges, chosen on the device
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("grads, batch", GRAD_SETUPS)
def test_a_training_step_captured_in_a_cuda_graph_replays_bit_identically_to_eager(grads, batch):
    batches = _batches(3, batch)
    eager, eager_opt = _small_vgg_and_sgd(grads)
    for x, t in batches:
        _qat_step(eager, eager_opt, x, t)
    model, opt = _small_vgg_and_sgd(grads)
    static_x, static_t = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()          # torch's recipe: warm up on a side stream; the warm-up is
    side.wait_stream(torch.cuda.current_stream())   # step 1 (SGD makes its momentum buffers there)
    with torch.cuda.stream(side):
        _qat_step(model, opt, static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):       # recorded, not run
        _qat_step(model, opt, static_x, static_t)
    for x, t in batches[1:]:
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
    torch.cuda.synchronize()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(eager.named_buffers(), model.buffers()):   # the learned ranges
        assert torch.equal(a, b), name


TENSORCORE_CASES = [Case("tc_3x3", cin=32, cout=48), Case("tc_stride2", cin=16, cout=32, stride=2),
                    Case("tc_1x1_no_relu", cin=64, cout=40, kernel=1, padding=0, relu=False),
                    Case("tc_dilation2", cin=24, cout=32, dilation=2, padding=2, batch=2, hw=(12, 9))]


@pytest.mark.parametrize("case", TENSORCORE_CASES, ids=[c.name for c in TENSORCORE_CASES])
def test_a_layer_of_16_input_channels_or_more_runs_its_forward_on_tensor_cores_bit_exactly(case):
    x_q, w_q, args = _int8_operands(case)
    wl = tvm_kernels.forward_workload(x_q.shape, w_q.shape, *args)
    assert tvm_kernels.forward_layout(wl, CUDA) == tvm_kernels.CHANNELS_LAST_LAYOUT
    acc = functional._int8_conv_forward(x_q.to(CUDA), w_q.to(CUDA), *args)
    assert torch.equal(acc.cpu(), functional.int8_conv_cpu(x_q, w_q, *args))
    ours, _, ref = run_cuda_twins(case)
    for name in ("out", "dx", "dw"):
        assert_matches_reference(getattr(ours, name), getattr(ref, name))


@pytest.mark.parametrize("case", CASES + TENSORCORE_CASES, ids=CASE_IDS + [c.name for c in TENSORCORE_CASES])
def test_cuda_int8_input_gradient_equals_the_cpus(case):
    # input_grad="int8": on stride-1 one-group convs an int8 conv of the quantized gradient (the
    # tensor cores from 16 output channels: the gradient's input), exact, so bit-equal to the CPU's
    def dx(device):
        torch.manual_seed(0)
        layer, _ = case.layers()
        layer = layer.to(device)
        layer.input_grad = "int8"
        x = _input(case, 0).to(device).requires_grad_()
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device))
        return x.grad.cpu()

    ours, cpu = dx(CUDA), dx(torch.device("cpu"))
    if _int8_dx_is_a_conv(case):
        assert torch.equal(ours, cpu)
    else:
        assert_matches_reference(ours, cpu)


@pytest.mark.parametrize("case", CASES + TENSORCORE_CASES, ids=CASE_IDS + [c.name for c in TENSORCORE_CASES])
def test_cuda_int8_weight_gradient_equals_the_cpus(case):
    # weight_grad="int8" at batch 16: a one-group conv's dw sums run on the int8 tensor cores (the
    # batch is their channels), exact, so bit-equal to the CPU's float64 sums; a grouped conv runs
    # the float kernel on the quantized gradient (float32 rounding)
    case = dataclasses.replace(case, batch=16)

    def dw(device):
        torch.manual_seed(0)
        layer, _ = case.layers()
        layer = layer.to(device)
        layer.weight_grad = "int8"
        out = layer(_input(case, 0).to(device))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device))
        return layer.weight.grad.cpu()

    ours, cpu = dw(CUDA), dw(torch.device("cpu"))
    if case.groups == 1:
        assert torch.equal(ours, cpu)
    else:
        assert_matches_reference(ours, cpu)


def test_a_vgg_layers_int8_weight_gradient_is_split_and_exact():
    # VGG16's conv4 at batch 32: K = 56 * 56 * 32 = 100 k split in slices, summed in int64
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (32, 64, 56, 56), generator=g, dtype=torch.int8)
    g_q = torch.randint(-127, 128, (32, 96, 56, 56), generator=g, dtype=torch.int8)
    args = ((96, 64, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    got = tvm_kernels.int8_weight_grad(x_q.to(CUDA), g_q.to(CUDA), *args)
    assert any("split" in d for _, d in tvm_kernels.CALLS)
    assert torch.equal(got.cpu().double(), functional.int8_weight_grad_cpu(x_q, g_q, *args))


def test_scales_on_cuda_are_the_cpus_and_numpys_bit_for_bit():
    # amax / 127 as a true division on every device: CUDA's division by a Python scalar multiplies
    # by its reciprocal, one bit off for some amax (it made int8 dx / dw differ from the CPU's)
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 10
    expected = torch.from_numpy((amax.numpy() / np.float32(127)).astype(np.float32))
    assert torch.equal(functional.input_scale(amax.to(CUDA)).cpu(), expected)
    w = amax.view(-1, 1)
    assert torch.equal(functional.weight_scales(w.to(CUDA)).cpu(), functional.weight_scales(w))
    assert torch.equal(functional.weight_scales(w), expected)
    g = amax.view(1, -1, 1, 1)
    assert torch.equal(functional.quantize_per_channel(g.to(CUDA))[1].cpu(), expected)


def test_cuda_scale_and_range_kernels_give_the_cpus_torch_bits():
    # conv_scales (a thread a channel) and range_ema (one thread) on CUDA against their torch
    # definitions on the CPU: every scale and every updated range bit for bit, over ranges from
    # 1e-6 to 1e4 (the correctly rounded __fdiv_rn / __fmul_rn; --use_fast_math's would not)
    g = torch.Generator().manual_seed(0)
    w_amax = torch.rand(4096, generator=g) * torch.logspace(-6, 4, 4096)
    w_amax[:3] = torch.tensor([0.0, 1e-35, float("inf")])
    for amax in (0.0, 1e-35, 0.731, 6.123, 3.0e4):
        for times in (None, 0.0173):    # backward's: dw's scale from the forward's s_x
            ours = tvm_kernels.conv_scales(torch.tensor(amax, device=CUDA), w_amax.to(CUDA),
                                           None if times is None else torch.tensor(times, device=CUDA))
            ref = functional.conv_scales_torch(torch.tensor(amax), w_amax, None if times is None else torch.tensor(times))
            for got, want in zip(ours, ref):
                # a subnormal product (s_x = 1e-30 of an all-zero input times s_w < 1.2e-8) is
                # flushed to 0 by CUDA's __fmul_rn under TVM's --use_fast_math, as in every kernel here
                subnormal = (want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)
                assert torch.equal(got.cpu(), torch.where(subnormal, torch.zeros_like(want), want)), (amax, times)
                assert amax < 1e-3 or not subnormal.any()       # real ranges: every bit torch's
    bufs = torch.rand(20_000, generator=g) * torch.logspace(-6, 4, 20_000)
    bufs[::7] = 0.0     # nothing recorded yet: the batch's own range
    ms = torch.rand(20_000, generator=g) * torch.logspace(4, -6, 20_000)
    for momentum in (0.1, 0.01):
        for i in range(0, 20_000, 997):
            ours, ref = bufs[i].to(CUDA), bufs[i].clone()
            tvm_kernels.update_range(ours, ms[i].to(CUDA), momentum)
            functional.update_range_torch(ref, ms[i], momentum)
            assert torch.equal(ours.cpu(), ref), (momentum, bufs[i], ms[i])
    assert {k for k, _ in tvm_kernels.CALLS} >= {"conv_scales", "range_ema"}


@pytest.mark.parametrize("shape", [(32, 64, 224, 224), (3, 5, 7, 9)], ids=["vgg_pool1_b32", "odd"])
def test_cuda_compact_pool_gives_nn_maxpool2ds_output_and_gradient_bit_for_bit(shape):
    from tvm_qconv.nn import CompactMaxPool2d
    x = torch.randn(shape, device=CUDA).relu_()         # ReLU output: many tied zero windows
    g = torch.randn((shape[0], shape[1], shape[2] // 2, shape[3] // 2), device=CUDA)
    out = {}
    for name, pool in (("ours", CompactMaxPool2d(2, 2)), ("torch", torch.nn.MaxPool2d(2, 2))):
        xi = x.clone().requires_grad_()
        y = pool(xi)
        y.backward(g)
        out[name] = (y.detach(), xi.grad)
    assert torch.equal(out["ours"][0], out["torch"][0]) and torch.equal(out["ours"][1], out["torch"][1])
    assert {"max_pool", "max_pool_grad"} <= {k for k, _ in tvm_kernels.CALLS}


def test_cuda_elementwise_kernels_give_the_cpus_torch_bits_including_ties_and_extremes():
    # the CUDA kernels round each float32 op with __f*_rn (not float64): bit-equal to torch on
    # the CPU for values whose quotient is a tie (k + 0.5), huge and tiny ones, and random ones
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 12, 16, generator=g) * 3
    x[0, 0, 0, :8] = torch.tensor([0.25, -0.25, 0.75, 63.25, 1e30, -1e-30, 1e-38, 3e-39])
    scale, per_channel = torch.tensor(0.5), torch.rand(8, generator=g) * 0.1 + 1e-3
    mult = torch.rand(8, generator=g) + 0.5
    bits = functional.pack_bits(torch.randn(x.shape, generator=g) > 0)
    for s, m in ((scale, None), (per_channel, None), (scale, mult)):
        assert torch.equal(tvm_kernels.quantize(x.to(CUDA), s.to(CUDA), None if m is None else m.to(CUDA)).cpu(),
                           functional.quantize_torch(x, s, m))
    ours = tvm_kernels.quantize_grad(x.to(CUDA), bits.to(CUDA), scale.to(CUDA), mult.to(CUDA), per_channel.to(CUDA))
    ref = functional.quantize_grad_torch(x, bits, scale, mult, per_channel)
    assert torch.equal(ours[0].cpu(), ref[0]) and torch.equal(ours[1].cpu(), ref[1])
    assert torch.equal(tvm_kernels.grad_stats(x.to(CUDA), bits.to(CUDA))[0].cpu(), functional.grad_stats_torch(x, bits)[0])
    x_q = torch.randint(-127, 128, (4, 32, 9, 9), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (40, 32, 3, 3), generator=g, dtype=torch.int8)
    s_out, bias = torch.rand(40, generator=g) * 1e-3, torch.randn(40, generator=g)
    args = ((1, 1), (1, 1, 1, 1), (1, 1), 1, s_out, bias, True)
    ours = tvm_kernels.int8_conv_dequantized(x_q.to(CUDA), w_q.to(CUDA), *args[:4], s_out.to(CUDA), bias.to(CUDA), True)
    assert torch.equal(ours.cpu(), functional.int8_conv_dequantized_torch(x_q, w_q, *args))


@pytest.mark.parametrize("weight_shape", [(256, 512, 3, 3), (4096, 1024, 1, 1)], ids=["conv", "linear"])
def test_cuda_sums_scaling_kernel_gives_torchs_bits(weight_shape):
    # dw from the tensor cores' [C, KH, KW, O] int32 sums: the shared-memory transpose kernel
    # (elementwise.scale_sums) against torch.mul's int * float bits on the CPU
    o = weight_shape[0]
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(-2 ** 31, 2 ** 31 - 1, weight_shape[1:] + (o,), generator=gen, dtype=torch.int32)
    scale = torch.rand(o, generator=gen) * 1e-6
    ours = tvm_kernels.scale_sums(base.to(CUDA).permute(3, 0, 1, 2), scale.to(CUDA))
    assert {k for k, _ in tvm_kernels.CALLS} == {"scale_sums"}
    assert torch.equal(ours.cpu(), functional.scale_sums_torch(base.permute(3, 0, 1, 2), scale))


@pytest.mark.parametrize("weight_shape", [(256, 512, 3, 3), (4096, 25088, 1, 1), (64, 32, 7, 7)],
                         ids=["conv", "vgg16_fc6", "7x7"])
def test_cuda_dx_weight_flip_and_transpose_kernel_gives_torchs(weight_shape):
    # dx's flipped, transposed int8 weight: the shared-memory transpose (elementwise.flip_transpose;
    # VGG16's first linear layer a 100 MB transpose) against torch's flip of the transposed view
    w_q = torch.randint(-127, 128, weight_shape, generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    ours = tvm_kernels.flip_transpose(w_q.to(CUDA), 1)
    assert {k for k, _ in tvm_kernels.CALLS} == {"flip_transpose"}
    assert torch.equal(ours.cpu(), functional.flipped_transposed_torch(w_q, 1))


@pytest.mark.parametrize("shape, transpose", [((32, 64, 56, 56), False), ((128, 256, 14, 14), False),
                                              ((33, 40, 6, 6), True), ((128, 2048, 7, 7), True)],
                         ids=["vgg", "resnet_14x14", "transposed_padded", "transposed_7x7"])
def test_cuda_pack_gives_the_permuted_padded_copy(shape, transpose):
    # int8 NCHW -> NHWC32 (or [C_p, H, W, N_p]): the pack_nhwc32 kernel (H * W a multiple of 4,
    # words running into the next row at 14 x 14) and the pixel-a-thread one (7 x 7) against
    # torch's permute and zero padding
    x = torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    ours = tvm_kernels._pack_input_nhwc32(x.to(CUDA), transpose=transpose, pad_rows=transpose).cpu()
    ref = x.permute(1, 2, 3, 0) if transpose else x.permute(0, 2, 3, 1)
    rows, cols = ref.shape[0], ref.shape[3]
    ref = torch.nn.functional.pad(ref, (0, -cols % 32) + (0, 0) * 2 + (0, -rows % 32 if transpose else 0))
    assert {k for k, _ in tvm_kernels.CALLS} == {"pack"}
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("cout, relu", [(64, True), (256, False)], ids=["relu", "signed"])
def test_cuda_dequantize_writes_the_outputs_range_as_torchs_aminmax(cout, relu):
    # the tensor-core forward's dequantizing kernel also writes max|out| a group of 8 channels
    # (dequantize_amax); batch_amax(out) takes it from there, with aminmax's bits
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (8, 64, 28, 28), generator=g, dtype=torch.int8).to(CUDA)
    w_q = torch.randint(-127, 128, (cout, 64, 3, 3), generator=g, dtype=torch.int8).to(CUDA)
    scale, bias = (torch.rand(cout, generator=g) * 1e-4).to(CUDA), torch.randn(cout, generator=g).to(CUDA)
    y = tvm_kernels.int8_conv_dequantized(x_q, w_q, (1, 1), (1, 1, 1, 1), (1, 1), 1, scale, bias, relu)
    assert any(k == "dequantize" and "amax" in w for k, w in tvm_kernels.CALLS)
    assert functional.known_amax(y) is not None        # batch_amax below takes the kernel's
    lo, hi = torch.aminmax(y)
    assert torch.equal(batch_amax(y), torch.maximum(-lo, hi))


def test_cuda_relu_bits_writes_its_inputs_range_as_torchs_aminmax():
    # a dp4a layer's ReLU output: the bits kernel also writes max|y| a byte (relu_bits_amax)
    y = torch.relu(torch.randn(16, 64, 56, 56, generator=torch.Generator().manual_seed(0))).to(CUDA)
    bits = tvm_kernels.relu_bits(y)
    assert any(k == "relu_bits" and "amax" in w for k, w in tvm_kernels.CALLS)
    assert torch.equal(bits, functional.pack_bits(y > 0))
    assert functional.known_amax(y) is not None
    lo, hi = torch.aminmax(y)
    assert torch.equal(batch_amax(y), torch.maximum(-lo, hi))


@pytest.mark.parametrize("special", ["subnormals", "nan"])
def test_cuda_relu_kernel_keeps_subnormals_and_nan_as_torch(special):
    # CompactReLU's forward kernel decides on the values' bits: --use_fast_math's max.ftz.f32 would
    # make relu(1e-45) 0 (its gradient lost) and drop NaN from the range
    x = torch.randn(8, 16, 14, 14, generator=torch.Generator().manual_seed(0))
    x.view(-1)[:6] = torch.tensor([1e-45, -1e-45, 1e-40, 0.0, -0.0, 3.0])
    if special == "nan":
        x.view(-1)[7] = float("nan")
    x = x.to(CUDA)
    y, bits = tvm_kernels.relu_with_bits(x)
    ref = torch.relu(x)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(y.nan_to_num(), ref.nan_to_num())
    assert y.view(-1)[0] > 0 and torch.equal(y.view(-1)[[0, 2]], x.view(-1)[[0, 2]])    # not flushed to 0
    assert torch.equal(bits, functional.pack_bits(~(ref <= 0)))    # threshold_backward's: NaN passes
    lo, hi = torch.aminmax(ref)
    assert functional.known_amax(y) is not None
    assert torch.equal(batch_amax(y).nan_to_num(nan=-1.0), torch.maximum(-lo, hi).nan_to_num(nan=-1.0))


def _near_ties(scales: torch.Tensor, width: int = 16) -> torch.Tensor:
    """``[1, C, H, width]``: channel ``c`` holds ``(k + 0.5) * scales[c]`` for k in -130..129, each
    with its float32 neighbours up to 3 ulp away (quotients within a few ulp of a half-integer:
    where the kernels' fast quotient must hand over to the correctly rounded one), zeros after."""
    k = torch.arange(-130, 130, dtype=torch.float32) + 0.5
    rows = []
    for s in scales:
        t = k * s
        vals = [t]
        up, down = t.clone(), t.clone()
        for _ in range(3):
            up, down = torch.nextafter(up, torch.tensor(float("inf"))), torch.nextafter(down, torch.tensor(float("-inf")))
            vals += [up, down]
        rows.append(torch.cat(vals))
    x = torch.stack(rows)
    x = torch.nn.functional.pad(x, (0, -x.shape[1] % width))
    return x.view(1, len(scales), -1, width).contiguous()


def test_cuda_quantizing_kernels_round_quotients_within_ulps_of_a_tie_as_torch():
    # quantize / quantize_grad take the fast quotient and hand over to __fdiv_rn near k + 0.5
    # (elementwise._rounded_quotient): every value here is 0-3 ulp from a tie, for scales that are
    # not powers of two (where the fast and correctly rounded quotients differ most)
    scales = torch.rand(8, generator=torch.Generator().manual_seed(3)) * 0.1 + 1e-4
    x = _near_ties(scales)
    assert torch.equal(tvm_kernels.quantize(x.to(CUDA), scales.to(CUDA)).cpu(), functional.quantize_torch(x, scales))
    s0, ones = scales[0], torch.ones(8)
    bits = functional.pack_bits(torch.ones(x.shape, dtype=torch.bool))
    ours = tvm_kernels.quantize_grad(x.to(CUDA), bits.to(CUDA), s0.to(CUDA), ones.to(CUDA), scales.to(CUDA))
    ref = functional.quantize_grad_torch(x, bits, s0, ones, scales)
    assert torch.equal(ours[0].cpu(), ref[0]) and torch.equal(ours[1].cpu(), ref[1])


@pytest.mark.parametrize("shape", [(8, 64, 28, 28), (3, 5, 7, 9)], ids=["whole_bytes", "odd"])
def test_cuda_compact_relu_gives_nn_relus_output_and_gradient_bit_for_bit(shape):
    # subnormal outputs keep their gradient (the bits kernel reads y's sign bits, not a float
    # compare that --use_fast_math would flush); the mask kernel's 8-element threads where the
    # size is a multiple of 8, one element a thread where it is not
    from tvm_qconv.nn import CompactReLU
    x = torch.randn(shape, device=CUDA)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    g = torch.randn_like(x)
    out = {}
    for name, relu in (("ours", CompactReLU()), ("torch", torch.nn.ReLU())):
        xi = x.clone().requires_grad_()
        y = relu(xi)
        y.backward(g)
        out[name] = (y.detach(), xi.grad)
    assert torch.equal(out["ours"][0], out["torch"][0]) and torch.equal(out["ours"][1], out["torch"][1])


@pytest.mark.parametrize("family", ["mma", "wgmma", "wgmma_dw"])
def test_a_conv_built_with_measured_tiles_gives_the_default_kernels_sums(family, tmp_path, monkeypatch):
    # a tabled conv (conv_tiles: the template with 4 x 2 warps, or Hopper's wgmma kernel with its
    # int32 epilogue: a forward on 64 x 256 tiles, VGG16's split-K dw of 256 -> 256 @56) and the
    # default kernel, on the same random int8 operands: the same int32 sums, bit for bit
    import tvm
    from tvm_qconv.nn import conv_table, conv_tiles
    from tvm_qconv.schedules.tensorcore import mma
    from tvm_qconv.schedules.training import conv_choices, grad_weight_mma
    if family != "mma" and torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")
    wl = tvm_kernels.ConvWorkload(32, 512, 14, 14, 512, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), activation="none",
                                  act_min=-127, out_dtype="int32")
    if family == "wgmma_dw":
        wl = grad_weight_mma.weight_grad_conv(dataclasses.replace(wl, in_channels=256, out_channels=256, height=56,
                                                                  width=56), tvm_kernels._target_info(CUDA))
        assert wl.splits > 1
    arch = tvm_kernels.device_target(CUDA)[1]
    func = tvm_kernels._impl("forward", wl, tvm_kernels.target_of(arch)).compute(wl)
    mp, op, k = conv_choices.gemm_extents(func)
    default = conv_choices.mma_choice(*mma.default_decisions(mp, op, k, 132))
    if family == "mma":
        other = next(c for c in conv_choices.candidates(mp, op, k)
                     if c != default and c["tiles"]["m"][1] * c["tiles"]["o"][1] == 8)
    else:
        other = conv_choices.wgmma_choices(wl)[0]
        assert other["family"] == "wgmma"
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(conv_table.TABLE_ENV, str(path))
    conv_table.merge_rows(str(path), [{"workload": wl.to_dict(), "describe": "test",
                                       "default": {"choice": default, "ms": 1.0},
                                       "best": {"choice": other, "ms": 0.5}}], {"arch": arch})
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    tabled = tvm_kernels.get_kernel("forward", wl, CUDA)
    assert conv_tiles._build_group(wl, arch, {0: None}, str(tmp_path / "default.so")) == {0: None}
    plain = tvm.runtime.load_module(str(tmp_path / "default.so"))["c0"]
    args = conv_tiles._arguments(func, CUDA, torch.Generator(device=CUDA).manual_seed(0))
    tabled(*args)
    sums = args[-1].clone()
    args[-1].zero_()
    plain(*args)
    assert sums.abs().sum() > 0 and torch.equal(sums, args[-1])


def test_a_dw_run_at_its_measured_split_count_on_wgmma_gives_the_same_weight_gradient(tmp_path, monkeypatch):
    # int8_weight_grad with a table whose choice for VGG16's 256 -> 256 @56 dw is the wgmma kernel
    # at another split count: the same exact sums as the default split on mma.sync
    from tvm_qconv.nn import conv_table, conv_tiles
    from tvm_qconv.schedules.tensorcore import mma
    from tvm_qconv.schedules.training import conv_choices, grad_weight_mma
    if torch.cuda.get_device_capability(CUDA) != (9, 0):
        pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")
    g = torch.Generator(device=CUDA).manual_seed(0)
    x_q = torch.randint(-127, 128, (32, 256, 56, 56), dtype=torch.int8, device=CUDA, generator=g)
    g_q = torch.randint(-127, 128, (32, 256, 56, 56), dtype=torch.int8, device=CUDA, generator=g)
    args = (x_q, g_q, (256, 256, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)   # padding: top, left, bottom, right
    monkeypatch.setenv(conv_table.TABLE_ENV, str(tmp_path / "tiles.json"))
    tvm_kernels._measured_splits.cache_clear()
    default = tvm_kernels.int8_weight_grad(*args)
    fwd = tvm_kernels.ConvWorkload(32, 256, 56, 56, 256, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), activation="none",
                                   act_min=-127, out_dtype="int32")
    dw = grad_weight_mma.weight_grad_conv(fwd, tvm_kernels._target_info(CUDA))
    choice = next(c for c in conv_choices.wgmma_split_choices(dw, tvm_kernels._target_info(CUDA).num_sm) if "splits" in c)
    conv_table.merge_rows(str(tmp_path / "tiles.json"), [{"workload": dw.to_dict(), "describe": "test",
                                                          "default": {"choice": None, "ms": 1.0},
                                                          "best": {"choice": choice, "ms": 0.5}}],
                           {"arch": tvm_kernels.device_target(CUDA)[1]})   # a table of another arch is ignored
    tvm_kernels._measured_splits.cache_clear()
    try:
        tvm_kernels.CALLS.clear()
        chosen = tvm_kernels.int8_weight_grad(*args)
        assert any(f"split{choice['splits']}" in d for _, d in tvm_kernels.CALLS)
    finally:
        tvm_kernels._measured_splits.cache_clear()
    assert default.abs().sum() > 0 and torch.equal(chosen, default)


def test_cuda_passthroughs_gradient_joins_dx_in_its_dequantize_with_autograds_bits():
    # a residual block's identity taken from its first conv (passthrough): on the tensor cores the
    # identity's gradient is added in dx's dequantizing kernel (addend), with the bits of dx + it
    from tvm_qconv.nn import quantized_conv2d
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(16, 64, 14, 14, generator=g).to(CUDA)
    w = (torch.randn(128, 64, 1, 1, generator=g) * 0.1).to(CUDA)
    gy, gx = torch.randn(16, 128, 14, 14, generator=g).to(CUDA), torch.randn(x0.shape, generator=g).to(CUDA)
    kw = dict(amax_is_batch_max=True, input_grad="int8", weight_grad="int8")
    grads = []
    for passthrough in (True, False):
        tvm_kernels.CALLS.clear()
        x = x0.clone().requires_grad_()
        y, xi = (quantized_conv2d(x, w, None, batch_amax(x), passthrough=True, **kw) if passthrough
                 else (quantized_conv2d(x, w, None, batch_amax(x), **kw), x))
        ((y * gy).sum() + (xi * gx).sum()).backward()
        grads.append(x.grad)
        assert any("addend" in d for k, d in tvm_kernels.CALLS if k == "dequantize") == passthrough
    assert torch.equal(grads[0], grads[1])
