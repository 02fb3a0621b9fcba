"""The training path's TVM kernels on CPU: gradient kernels vs NumPy, CUDA builds, the torch wrapper, the cache.

No GPU here, so the CUDA kernels are checked three ways short of running them:

* the compute definitions, built for llvm, against NumPy float64 references (which are
  themselves checked against PyTorch's float64 conv gradients);
* the *scheduled* CUDA PrimFuncs made runnable on llvm (:func:`cpu_twin`: thread loops serial,
  shared/local buffers global), against the same references: this checks the schedules' tiling
  and staging index arithmetic, everything but the hardware;
* the CUDA source they generate for sm_90 (``__dp4a`` in the forward, shared-memory tiles, no
  TVM-allocated global buffer).

Then the autograd layer runs end to end through :mod:`tvm_qconv.nn.tvm_kernels` on the CPU
(``register("cpu")``: the same packing, group, linear-layer and split-K code the CUDA path runs,
with llvm kernels), with the differential helper of ``test_qconv_autograd.py``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm.script import parser as tvmscript

from tests.test_qconv_autograd import CASES, CASE_IDS, NONCONTIGUOUS, _input, _run, assert_matches_reference, run_twins
from tests.workloads import conv_wl
from tvm_qconv import registry
from tvm_qconv.nn import QuantizedLinear, batch_amax, functional, quantize_per_tensor, quantize_weight
from tvm_qconv.nn import tvm_kernels
from tvm_qconv.schedules.training.grad_input import (conv2d_grad_input_int8, conv2d_grad_input_int8_ref,
                                                     schedule_grad_input_cuda)
from tvm_qconv.schedules.training.grad_weight import (conv2d_grad_weight_int8, conv2d_grad_weight_int8_ref,
                                                      schedule_grad_weight_cuda, weight_grad_splits)
from tvm_qconv.schedules.workload import ConvWorkload
from tvm_qconv.target import TargetInfo, cuda_source, make_target


def GW(batch, in_channels, height, width, out_channels, kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1),
       dilation=(1, 1), groups=1) -> ConvWorkload:
    """A gradient kernel's workload (positional, as the kernels' tests write them)."""
    return ConvWorkload(batch, in_channels, height, width, out_channels, kernel, stride, padding, dilation, groups)


CUDA = make_target("cuda", "sm_90")
RNG = np.random.default_rng(0)

# Shapes that divide no tile: odd channels and sizes, stride, dilation, asymmetric padding,
# groups (depthwise too), a 1x1 and a linear layer as the wrapper presents it (batch as width).
WORKLOADS = [
    GW(2, 6, 9, 7, 10, (3, 3), (2, 1), (1, 1, 1, 1), (1, 2), 2),
    GW(1, 8, 6, 5, 12, (3, 3), (1, 1), (0, 1, 2, 1)),
    GW(2, 8, 10, 10, 16, (4, 4), (1, 1), (1, 1, 2, 2)),
    GW(3, 40, 12, 12, 36),
    GW(2, 8, 7, 7, 8, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 8),
    GW(1, 5, 11, 13, 7, (1, 1), (1, 1), (0, 0, 0, 0)),
    GW(1, 70, 1, 5, 9, (1, 1), (1, 1), (0, 0, 0, 0)),
]
WL_IDS = ["odd_stride_dilation_g2", "asym_pad", "even_kernel_same", "wide_channels", "depthwise_s2", "1x1",
          "linear_as_width"]


def _grads(wl: GW, seed: int = 0):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(wl.batch, wl.out_channels, wl.out_height, wl.out_width)).astype(np.float32)
    w = rng.integers(-127, 128, (wl.out_channels, wl.group_in) + wl.kernel).astype(np.int8)
    w_scale = rng.uniform(1e-3, 1e-2, wl.out_channels).astype(np.float32)
    x = rng.integers(-127, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    return g, w, w_scale, x, np.array([0.0123], np.float32)


def cpu_twin(func):
    """A scheduled CUDA PrimFunc made runnable on llvm: thread loops serial, shared/local buffers
    global.  Serial threads run each cooperative copy whole before the compute that reads it, so
    the twin computes what the kernel computes whenever the kernel's barriers are right."""
    text = func.script()
    text, n_bind = re.subn(r'T\.thread_binding\((\d+), thread="[\w.]+"(, annotations=\{[^}]*\})?\)',
                           r"T.serial(\1\2)", text)
    text = text.replace('scope="shared"', 'scope="global"').replace('scope="local"', 'scope="global"')
    assert n_bind > 0
    return tvmscript.parse(text)


def _run_llvm(func, arrays, out_shape):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, np.float32))
    lib["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays], out)
    return out.numpy()


def _dx(func, wl: GW, g, w, w_scale):
    G = wl.groups
    out = _run_llvm(func, [g.reshape(wl.batch, G, -1, wl.out_height, wl.out_width),
                           w.reshape(G, -1, wl.group_in, *wl.kernel), w_scale.reshape(G, -1)],
                    (wl.batch, G, wl.group_in, wl.height, wl.width))
    return out.reshape(wl.batch, wl.in_channels, wl.height, wl.width)


def _dw(func, wl: GW, g, x, x_scale):
    G, splits = wl.groups, int(func.attrs["tvm_qconv.splits"])
    out = _run_llvm(func, [g.reshape(wl.batch, G, -1, wl.out_height, wl.out_width),
                           x.reshape(wl.batch, G, -1, wl.height, wl.width), x_scale],
                    (splits, G, wl.group_out, wl.group_in) + wl.kernel)
    return out.sum(0).reshape(wl.out_channels, wl.group_in, *wl.kernel)


def assert_close_f32(got, ref):
    # float32 sums of <= a few thousand terms vs float64: rounding ~sqrt(terms) * 2**-24 of the
    # largest value (measured <= 2e-6 relative here); 1e-5 of the scale is 5x above it, far
    # below one int8 level of one weight (~1e-2 of the scale).
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)


# ----------------------------------------------------------------------------- references

@pytest.mark.parametrize("wl", WORKLOADS, ids=WL_IDS)
def test_numpy_references_equal_torch_float64_conv_gradients(wl):
    g, w, w_scale, x, x_scale = _grads(wl)
    pt, pl, pb, pr = wl.padding
    wd = torch.from_numpy(w.astype(np.float64) * w_scale.astype(np.float64)[:, None, None, None])
    padded = (wl.batch, wl.in_channels, wl.height + pt + pb, wl.width + pl + pr)
    dx = torch.nn.grad.conv2d_input(padded, wd, torch.from_numpy(g).double(), wl.stride, 0, wl.dilation, wl.groups)
    xd = F.pad(torch.from_numpy(x).double() * float(x_scale[0]), (pl, pr, pt, pb))
    dw = torch.nn.grad.conv2d_weight(xd, w.shape, torch.from_numpy(g).double(), wl.stride, 0, wl.dilation, wl.groups)
    np.testing.assert_allclose(conv2d_grad_input_int8_ref(g, w, w_scale, wl),
                               dx[:, :, pt:pt + wl.height, pl:pl + wl.width].numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(conv2d_grad_weight_int8_ref(g, x, x_scale[0], wl), dw.numpy(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- kernels on llvm

@pytest.mark.parametrize("wl", WORKLOADS, ids=WL_IDS)
def test_grad_input_kernel_and_its_cuda_schedule_match_numpy(wl):
    g, w, w_scale, _, _ = _grads(wl)
    ref = conv2d_grad_input_int8_ref(g, w, w_scale, wl)
    func = conv2d_grad_input_int8(wl)
    assert_close_f32(_dx(func, wl, g, w, w_scale), ref)
    assert_close_f32(_dx(cpu_twin(schedule_grad_input_cuda(func, CUDA)), wl, g, w, w_scale), ref)


@pytest.mark.parametrize("wl", WORKLOADS, ids=WL_IDS)
def test_grad_weight_kernel_and_its_cuda_schedule_match_numpy(wl):
    g, _, _, x, x_scale = _grads(wl)
    ref = conv2d_grad_weight_int8_ref(g, x, x_scale[0], wl)
    for splits in sorted({1, weight_grad_splits(wl)}):  # one chunk, and the planned split-K
        func = conv2d_grad_weight_int8(wl, splits)
        assert_close_f32(_dw(func, wl, g, x, x_scale), ref)
        assert_close_f32(_dw(cpu_twin(schedule_grad_weight_cuda(func, CUDA)), wl, g, x, x_scale), ref)


def test_weight_grad_splits_aim_at_four_blocks_per_sm_of_the_target():
    wl = GW(32, 64, 224, 224, 64)  # 2 x 2 blocks per split; 7168 gradient rows = 2**10 * 7
    plan = {n: weight_grad_splits(wl, TargetInfo(kind="cuda", arch="sm_80", num_sm=n)) for n in (16, 108, 132)}
    # the largest divisor of 7168 up to 4 * num_sm / 4 blocks: 16, 64 (of <= 108), 128 (of <= 132)
    assert plan == {16: 16, 108: 64, 132: 128}
    assert weight_grad_splits(wl) == plan[132]  # no target: an sm_90 of 132 SMs (DEFAULT_TARGET)


def test_weight_grad_splits_divide_the_rows_and_bound_the_partials():
    first = GW(32, 64, 224, 224, 64)  # VGG16's second conv at batch 32: 37 k weights, K = 1.6 M
    s = weight_grad_splits(first)
    assert (32 * 224) % s == 0 and s >= 64
    last = GW(32, 512, 14, 14, 512)
    assert weight_grad_splits(last) * 512 * 512 * 9 <= 16 * 2**20
    assert weight_grad_splits(GW(1, 25088, 1, 32, 4096, (1, 1), padding=(0, 0, 0, 0))) == 1


# ----------------------------------------------------------------------------- CUDA code

VGG_WORKLOADS = [GW(32, 3, 224, 224, 64), GW(32, 256, 56, 56, 256), GW(32, 512, 14, 14, 512),
                 GW(1, 4096, 1, 32, 1000, (1, 1), padding=(0, 0, 0, 0))]


def _cuda_funcs(wl: GW):
    """The three kernels the training path builds for ``wl`` on CUDA (the forward as the registry picks it)."""
    fwd = conv_wl(wl.batch, wl.in_channels, wl.height, wl.width, wl.out_channels, wl.kernel, wl.stride,
                  wl.padding, wl.dilation, relu=False, out_dtype="int32")
    return {"forward": (tvm_kernels._definition("forward", fwd, CUDA), tvm_kernels._impl("forward", fwd, CUDA)),
            "grad_input": (schedule_grad_input_cuda(conv2d_grad_input_int8(wl), CUDA), None),
            "grad_weight": (schedule_grad_weight_cuda(conv2d_grad_weight_int8(wl), CUDA), None)}


@pytest.mark.parametrize("wl", VGG_WORKLOADS, ids=["vgg_conv1", "vgg_256@56", "vgg_512@14", "vgg_fc3"])
def test_cuda_kernels_build_with_shared_tiles_and_no_tvm_allocated_global_memory(wl):
    for kind, (func, impl) in _cuda_funcs(wl).items():
        # Every buffer a kernel allocates lives in shared memory or registers: a global one
        # would be allocated by TVM, outside PyTorch's allocator and its memory statistics.
        allocs = [line.strip() for line in func.script().splitlines() if "alloc_buffer(" in line]
        scopes = re.compile(r'scope="(shared|shared\.dyn|local|warp)"')
        assert allocs and all(scopes.search(a) for a in allocs), (kind, allocs)
        options = registry.compile_options([impl] if impl else [])
        with CUDA, tvm.transform.PassContext(opt_level=3, config=options["config"]):
            src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=CUDA, tir_pipeline=options["tir_pipeline"]))
        assert "__shared__" in src and "__syncthreads()" in src, kind
        threads = [int(t) for t in re.findall(r"__launch_bounds__\((\d+)\)", src)]
        assert threads and max(threads) <= 1024, kind
        if kind == "forward":   # 3 input channels: dp4a; 16 and more: the int8 tensor cores
            assert ("__dp4a" if wl.in_channels < 16 else "mma.sync.aligned.m16n8k32") in src
        else:
            assert "signed char" in src  # the int8 tensor is read as int8, not a float copy


# The elementwise kernels' CUDA schedules, on the CPU twin, against their unscheduled compute: the
# schedules' index arithmetic (tails, 2 x 4 tiles, 16-byte vectors), bit for bit.  The kinds that
# call CUDA's __f*_rn intrinsics on the GPU (quantize, quantize_grad, dequantize) are scheduled
# here over their float64-rounded compute: the same loops, block names and buffers.
ELEMENTWISE_TWIN_CASES = [
    ("grad_stats", (3, 5, 6, 6), {"relu": True}),       # 4 pixels a load, a partial last block
    ("grad_stats", (2, 3, 7, 7), {"relu": True}),       # H * W odd: an element a load
    ("grad_stats", (4, 2, 8, 8), {}),
    ("mask", (2, 3, 4, 8), {}),                          # 8 elements a thread
    ("mask", (2, 3, 16, 8), {}),                         # 96 threads a block: a divisor, no tail
    ("mask", (3, 5, 7, 9), {}),                          # an element a thread
    ("max_pool_grad", (2, 3, 8, 8), {}),                 # 2 x 4 tiles (48 of them: 48 threads)
    ("max_pool_grad", (3, 5, 8, 8), {}),                 # 120 tiles: 120 threads
    ("max_pool_grad", (2, 3, 6, 14), {}),                # 2 x 2 tiles
    ("max_pool_grad", (2, 3, 7, 9), {}),                 # odd: a thread an element
    ("max_pool", (2, 3, 8, 10), {}),
    ("relu_bits", (2, 3, 5, 7), {}),
    ("relu_bits", (2, 4, 5, 6), {"amax": True}),        # and max|y| a byte's 8 (relu_bits_amax)
    ("relu", (2, 4, 5, 6), {}),                          # relu(x), its bits and its range in one pass
    ("pack", (2, 40, 5, 7), {}),                         # one pixel a thread (H * W odd)
    ("pack", (2, 40, 4, 8), {}),                         # a 32-channel x 128-pixel tile, padded to 64
    ("pack", (3, 70, 6, 6), {}),                         # W = 6: a word's 4 pixels run into the next row
    ("pack", (2, 33, 16, 12), {}),                       # 48 words a plane: a whole tile and a partial one
    ("pack", (40, 3, 4, 8), {"transpose": True, "pad_rows": True}),   # the batch as the channels
    ("pack", (33, 5, 2, 2), {"transpose": True}),        # 33 images: the second group's 31 are padding
    ("quantize", (2, 3, 5, 8), {"per_channel": True}),   # 4 elements a thread, 60 threads
    ("quantize", (2, 3, 5, 7), {}),                      # an element a thread
    ("quantize_grad", (2, 3, 6, 8), {"relu": True, "dx": True, "dw": True}),
    ("dequantize", (2, 40, 3, 5), {"per_channel": True, "layout": "nhwc32", "bias": True, "relu": True}),
    ("dequantize", (2, 16, 3, 5), {"layout": "nhwc32"}),          # 8 channels a thread
    ("dequantize", (2, 40, 3, 5), {"per_channel": True, "layout": "nhwc32", "bias": True, "relu": True,
                                   "amax": True}),   # and the range of each 8 (dequantize_amax)
    ("dequantize", (3, 8, 7, 9), {"layout": "nhwc32", "amax": True}),   # no ReLU: |negative| counts
    ("dequantize", (2, 12, 3, 5), {"layout": "nchw4c", "per_channel": True}),
    ("dequantize", (2, 40, 3, 5), {"layout": "nhwc32", "addend": True}),   # dx with a passthrough's gradient
    ("scale_sums", (64, 32, 1, 1), {}),                  # a linear layer's: 2 x 1 tiles of 32 x 32
    ("bn_stats", (3, 5, 6, 6), {}),                       # BatchNormReLU's statistics: 4 pixels a load
    ("bn_stats", (2, 3, 7, 7), {}),
    ("bn_relu", (2, 4, 5, 6), {}),                        # its forward: normalize, ReLU, bits, range
    ("bn_relu", (2, 3, 7, 8), {"addend": True}),          # with the residual: 56 pixels, whole bytes a channel
    ("bn_relu", (8, 3, 7, 7), {"addend": True}),          # 49 pixels: a thread's 8 elements span two channels
    ("bn_grad_sums", (3, 5, 6, 6), {}),                   # BatchNormReLU's backward: 4 pixels of g and y a load
    ("bn_grad_sums", (2, 3, 7, 7), {}),                   # an element a load
    ("bn_grad", (2, 3, 5, 7), {}),
    ("bn_grad", (2, 3, 4, 4), {"addend": True}),          # and dz, the residual's gradient (12 threads: plain)
    ("bn_grad", (2, 4, 8, 8), {}),                        # 8 elements a thread, 64 threads
    ("bn_grad", (2, 4, 8, 8), {"addend": True}),          # the same with dz
    ("bn_grad", (8, 3, 7, 7), {"addend": True}),          # 49 pixels: a thread's 8 elements span two channels
    ("scale_sums", (32, 32, 3, 3), {}),
    ("bn_finish", (4, 200, 7, 7), {"eps": 1e-5, "momentum": 0.1}),   # a thread a channel: 2 blocks of 128
    ("bn_coeffs", (196, 200, 1, 1), {}),
    ("bn_finish", (4, 200, 7, 7), {"eps": 1e-5, "momentum": 0.1, "partials": 600}),   # a block a channel adds
    ("bn_coeffs", (196, 200, 1, 1), {"partials": 37}),    # the partials: whole and partial 256-thread rounds
    ("range_ema", (1, 1, 1, 1), {"momentum": 0.1}),       # one thread of a 128-thread block
    ("conv_scales", (1, 200, 1, 1), {}),                  # a thread a channel: 2 blocks of 128
    ("conv_scales", (1, 200, 1, 1), {"mult": True}),      # backward's: dw's scale from the forward's s_x
    ("grad_finish", (4, 200, 7, 7), {"partials": 300}),   # grad_stats' partials: max and sum, a block a channel
    ("flip_transpose", (64, 32, 3, 3), {}),              # dx's weight: 2 x 1 tiles of 32 x 32 channels, 9 taps
    ("flip_transpose", (32, 64, 1, 1), {}),              # a linear layer's: the plain transpose
    ("flip_transpose", (16, 32, 7, 7), {}),              # 49 taps: 16 x 16 tiles
]


@pytest.mark.parametrize("kind, shape, flags", ELEMENTWISE_TWIN_CASES,
                         ids=[f"{k}-{'x'.join(map(str, s))}" for k, s, _ in ELEMENTWISE_TWIN_CASES])
def test_elementwise_cuda_schedules_on_the_cpu_twin_give_the_computes_bits(kind, shape, flags):
    from tvm_qconv.schedules.training import elementwise
    wl = elementwise.ElementwiseWorkload(kind, shape, **flags)
    plain = elementwise.compute(wl)
    twin = cpu_twin(elementwise.schedule_cuda(elementwise.compute(wl), wl, CUDA, rn=False))
    rng = np.random.default_rng(0)
    arrays = []
    for param in plain.params:
        shp, dtype = [int(d) for d in param.shape], str(param.dtype)
        if dtype.startswith("float"):
            arrays.append(rng.standard_normal(shp).astype(dtype))
        elif dtype == "uint8" and kind == "max_pool_grad":      # window indices 0-3
            arrays.append(rng.integers(0, 4, shp).astype(np.uint8))
        else:
            info = np.iinfo(dtype)
            arrays.append(rng.integers(info.min, int(info.max) + 1, shp).astype(dtype))
    n_out = ({"grad_stats": 2, "max_pool": 2, "quantize_grad": 2, "relu": 3, "bn_grad_sums": 2, "bn_stats": 2,
              "bn_relu": 3, "bn_finish": 5, "bn_coeffs": 5, "conv_scales": 3, "grad_finish": 2}.get(kind, 1)
             + flags.get("amax", False) + (kind == "bn_grad" and flags.get("addend", False)))   # bn_relu's is an input
    results = []
    for func in (plain, twin):
        lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        outs = [tvm.runtime.tensor(np.zeros_like(a)) for a in arrays[len(arrays) - n_out:]]
        lib["main"](*[tvm.runtime.tensor(a) for a in arrays[:len(arrays) - n_out]], *outs)
        results.append([o.numpy() for o in outs])
    for ours, ref in zip(*results):
        np.testing.assert_array_equal(ours, ref)


# ----------------------------------------------------------------------------- the torch wrapper

@pytest.fixture
def tvm_on_cpu(tmp_path, monkeypatch):
    """The autograd layer's CPU kernels replaced by tvm_kernels' (llvm builds, a fresh cache)."""
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setitem(functional.INT8_CONV_KERNELS, "cpu", tvm_kernels.int8_conv)
    monkeypatch.setitem(functional.CONV_GRAD_KERNELS, "cpu",
                        (tvm_kernels.conv_input_grad, tvm_kernels.conv_weight_grad))
    monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", {
        "quantize": tvm_kernels.quantize, "int8_conv_dequantized": tvm_kernels.int8_conv_dequantized,
        "relu_bits": tvm_kernels.relu_bits, "relu_with_bits": tvm_kernels.relu_with_bits, "mask": tvm_kernels.mask,
        "grad_stats": tvm_kernels.grad_stats,
        "quantize_grad": tvm_kernels.quantize_grad, "scale_sums": tvm_kernels.scale_sums,
        "flip_transpose": tvm_kernels.flip_transpose, "update_range": tvm_kernels.update_range,
        "conv_scales": tvm_kernels.conv_scales})
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    monkeypatch.setattr(tvm_kernels, "CALLS", tvm_kernels.collections.Counter())
    return tmp_path / "kernels"


@pytest.fixture
def tensor_cores_on_llvm(tvm_on_cpu, monkeypatch):
    """``tvm_on_cpu`` with the layers of 16+ input channels on the tensor-core path, as on a GPU: the
    forward's compute definition (NHWC32, int32 out: the mma.sync template's) built for llvm, the
    kernels around it (packing, dequantizing) as ``tvm_on_cpu`` builds them.  Returns the list of
    ``(kind, workload)`` of every kernel call, which grows as they run."""
    from tvm_qconv.schedules.tensorcore import conv2d as tc_conv2d

    call, calls = tvm_kernels._call, []

    def run_on_llvm(kind, wl, device, *tensors, **kwargs):
        calls.append((kind, wl))
        if kind != "forward":
            return call(kind, wl, device, *tensors, **kwargs)
        data, weight, out = tensors
        assert data.shape[-1] % 32 == 0 and weight.shape[0] % 32 == 0
        fn = tvm.compile(tvm.IRModule({"main": tc_conv2d.conv2d_nhwc_int32(wl)}), target="llvm")["main"]
        fn(data, weight, out)

    monkeypatch.setattr(tvm_kernels, "forward_layout", lambda wl, device: tvm_kernels.CHANNELS_LAST_LAYOUT)
    monkeypatch.setattr(tvm_kernels, "_call", run_on_llvm)
    return calls


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_layer_through_tvm_kernels_matches_exact_reference(tvm_on_cpu, case):
    ours, _, ref = run_twins(case)
    for name in ("out", "dx", "dw", "db"):
        if getattr(ref, name) is None:
            assert getattr(ours, name) is None
        else:
            assert_matches_reference(getattr(ours, name), getattr(ref, name))
    kinds = {k for k, _ in tvm_kernels.CALLS}
    # the layer's scales and range records; the ReLU's mask kernels where the case has a ReLU; the
    # accumulators dequantized by a kernel unless the groups are narrower than dp4a's 4-channel
    # blocks (torch then)
    dequantized = case.groups == 1 or (case.cout // case.groups) % 4 == 0
    assert kinds == ({"range_ema", "conv_scales", "quantize", "forward", "grad_input", "grad_weight"}
                     | ({"dequantize"} if dequantized else set())
                     | ({"relu_bits", "mask"} if case.relu else set()))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tvm_forward_is_bit_exact_against_cpu_int8_conv(tvm_on_cpu, case):
    g = torch.Generator().manual_seed(0)
    layer, _ = case.layers()
    x_q = torch.randint(-127, 128, (case.batch, case.cin) + case.hw, generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, layer.weight.shape, generator=g, dtype=torch.int8)
    pad4 = functional.padding4(case.padding, layer.kernel_size, layer.dilation)
    args = (layer.stride, pad4, layer.dilation, case.groups)
    acc = tvm_kernels.int8_conv(x_q, w_q, *args)
    assert acc.dtype == torch.int32 and acc.shape == (case.batch, case.cout) + acc.shape[2:]
    assert torch.equal(acc, functional.int8_conv_cpu(x_q, w_q, *args))


@pytest.mark.parametrize("cin, cout, stride", [(16, 20, (1, 1)), (40, 64, (2, 1))])
def test_the_tensor_core_forward_packs_nhwc32_and_returns_the_exact_accumulators(tensor_cores_on_llvm, cin, cout,
                                                                                  stride):
    # On a GPU a layer of 16+ input channels runs the mma.sync template (NHWC32, int32 out); here
    # its compute definition runs on llvm, so the packing around it is checked against the CPU conv.
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (2, cin, 9, 7), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (cout, cin, 3, 3), generator=g, dtype=torch.int8)
    args = (stride, (1, 1, 1, 1), (1, 1), 1)
    acc = tvm_kernels.int8_conv(x_q, w_q, *args)
    assert torch.equal(acc, functional.int8_conv_cpu(x_q, w_q, *args))


@pytest.mark.parametrize("cout, relu", [(24, True), (16, False), (20, True)], ids=["relu", "signed", "no_range"])
def test_the_tensor_core_dequantize_notes_its_outputs_range_for_the_next_layer(tensor_cores_on_llvm, monkeypatch,
                                                                                cout, relu):
    # From NHWC32 in whole 8-channel groups the dequantizing kernel also writes max|out| a group
    # (dequantize_amax): batch_amax(out) then returns it without a reduction of its own, with torch's
    # bits; 20 channels (not whole groups) keep the plain kernel and the reduction
    kinds = tensor_cores_on_llvm
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (2, 16, 6, 5), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (cout, 16, 3, 3), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(cout, generator=g) * 1e-3, torch.randn(cout, generator=g)
    args = ((1, 1), (1, 1, 1, 1), (1, 1), 1, scale, bias, relu)
    y = tvm_kernels.int8_conv_dequantized(x_q, w_q, *args)
    assert kinds[-1][0] == "dequantize" and kinds[-1][1].amax == (cout % 8 == 0)
    assert torch.equal(y, functional.int8_conv_dequantized_torch(x_q, w_q, *args))
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: kinds.append("aminmax") or aminmax(*a, **k))
    amax = functional.batch_amax(y)
    assert ("aminmax" in kinds) == (cout % 8 != 0)
    lo, hi = aminmax(y)
    assert torch.equal(amax, torch.maximum(-lo, hi))


H100 = TargetInfo(kind="cuda", arch="sm_90", num_sm=132, has_dp4a=True, has_int8_mma=True)
# (x shape, weight shape, stride, padding, dilation): strides, dilation, asymmetric padding, a
# stride that leaves input rows unread (11 + 1 + 2 - 2 - 1 = 11: one), a 1x1, a linear layer
WEIGHT_GRAD_CONVS = [((16, 8, 9, 7), (12, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
                     ((17, 5, 11, 10), (7, 5, 3, 2), (2, 1), (1, 0, 2, 1), (1, 2)),
                     ((20, 6, 8, 8), (40, 6, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1)),
                     ((32, 40, 1, 1), (24, 40, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1))]


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, dilation", WEIGHT_GRAD_CONVS)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_int8_weight_gradient_as_a_conv_of_the_input_with_the_gradient_is_exact(
        tvm_on_cpu, monkeypatch, x_shape, w_shape, stride, padding, dilation, splits):
    # dw's sums as the forward's int32 conv, C as its batch, N as its channels, the gradient its
    # kernel (grad_weight_mma.py): its compute definition, split or not, built for llvm, on the
    # packing tvm_kernels does, against PyTorch's float64 conv gradient of the same integers
    from tvm_qconv.schedules.tensorcore import conv2d as tc_conv2d
    from tvm_qconv.schedules.training import grad_weight_mma

    call = tvm_kernels._call

    def run_on_llvm(kind, wl, device, *tensors, **kwargs):
        if kind != "forward":       # the packing kernels: their llvm builds
            return call(kind, wl, device, *tensors, **kwargs)
        fn = tvm.compile(tvm.IRModule({"main": tc_conv2d.conv2d_nhwc_int32(wl)}), target="llvm")["main"]
        fn(*tensors)

    monkeypatch.setattr(tvm_kernels, "_call", run_on_llvm)
    wl = ConvWorkload(*x_shape, w_shape[0], w_shape[2:], stride, padding, dilation, activation="none",
                      act_min=-127, out_dtype="int32")
    conv = grad_weight_mma.weight_grad_conv(wl, H100)
    steps = tc_conv2d.gemm_shape(conv)[3] // 32
    conv = ConvWorkload(**{**conv.__dict__, "splits": max(d for d in range(1, splits + 1) if steps % d == 0)})
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, x_shape, generator=g, dtype=torch.int8)
    g_q = torch.randint(-127, 128, (x_shape[0], w_shape[0], wl.out_height, wl.out_width), generator=g,
                        dtype=torch.int8)
    dw = tvm_kernels.weight_grad_by_conv(conv, x_q, g_q, w_shape)
    # one slice's int32 sums are exact as they are; the slices are added in int64
    assert dw.dtype == (torch.int64 if conv.splits > 1 else torch.int32) and dw.shape == w_shape
    assert torch.equal(dw.double(), functional.int8_weight_grad_cpu(x_q, g_q, w_shape, stride, padding, dilation, 1))


def test_the_weight_gradients_split_fills_the_gpu_and_keeps_int32_exact():
    from tvm_qconv.schedules.tensorcore import conv2d as tc_conv2d
    from tvm_qconv.schedules.training import grad_weight_mma
    for c, o, hw in [(64, 64, 224), (256, 256, 56), (512, 512, 14)]:    # VGG16's layers at batch 32
        conv = grad_weight_mma.weight_grad_conv(GW(32, c, hw, hw, o), H100)
        _, mp, op, k = tc_conv2d.gemm_shape(conv)
        assert (conv.batch, conv.in_channels, conv.kernel) == (c, 32, (hw, hw))    # C images, N channels
        assert k % (32 * conv.splits) == 0 and k // conv.splits <= grad_weight_mma.MAX_SLICE
        assert 127 * 127 * grad_weight_mma.MAX_SLICE < 2**31
    assert grad_weight_mma.weight_grad_conv(GW(32, 64, 224, 224, 64), H100).splits >= 13   # 1.6 M / 2**17
    # what the tensor cores cannot take: groups, a batch under 16, no int8 mma
    assert grad_weight_mma.weight_grad_conv(GW(32, 8, 9, 9, 8, groups=2), H100) is None
    assert grad_weight_mma.weight_grad_conv(GW(8, 8, 9, 9, 8), H100) is None
    assert grad_weight_mma.weight_grad_conv(GW(32, 8, 9, 9, 8), TargetInfo(kind="cuda", arch="sm_75")) is None


def test_a_split_conv_compiles_for_sm_90_with_its_slices_on_blockIdx_y():
    from tvm_qconv.schedules.training import grad_weight_mma
    conv = grad_weight_mma.weight_grad_conv(GW(32, 64, 56, 56, 64), H100)
    assert conv.splits > 1
    func = tvm_kernels._definition("forward", conv, CUDA)
    options = registry.compile_options([tvm_kernels._impl("forward", conv, CUDA)])
    with CUDA, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        ex = tvm.compile(tvm.IRModule({"main": func}), target=CUDA, tir_pipeline=options["tir_pipeline"])
    src = cuda_source(ex)
    assert "blockIdx.y" in src and "mma.sync.aligned.m16n8k32" in src


def _int8_dx_is_a_conv(case) -> bool:
    """Whether ``input_grad="int8"`` computes ``case``'s dx as an int8 conv (exact), not the float kernel."""
    layer, _ = case.layers()
    pad4 = functional.padding4(case.padding, layer.kernel_size, layer.dilation)
    return functional.transposed_padding(layer.kernel_size, pad4, layer.dilation, layer.stride, case.hw) is not None


def _int8_dx(case, seed=0):
    torch.manual_seed(seed)
    layer, _ = case.layers()
    layer.input_grad = "int8"
    x = torch.randn((case.batch, case.cin) + case.hw, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return x.grad


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_int8_input_gradient_through_tvm_kernels_equals_the_exact_cpu_path(tvm_on_cpu, monkeypatch, case):
    # an int8 conv of the quantized gradient (strided: spread out; grouped: per group), exact on
    # both (bit-equal); a conv padded past its kernel the float gradient kernel on the dequantized
    # gradient (float32 rounding, as above)
    ours = _int8_dx(case)
    monkeypatch.setitem(functional.INT8_CONV_KERNELS, "cpu", functional.int8_conv_cpu)
    monkeypatch.setitem(functional.CONV_GRAD_KERNELS, "cpu",
                        (functional.conv_input_grad_torch, functional.conv_weight_grad_torch))
    cpu = _int8_dx(case)
    if _int8_dx_is_a_conv(case):
        assert torch.equal(ours, cpu)
    else:
        assert_matches_reference(ours, cpu)


def test_linear_layer_runs_as_one_wide_image_and_matches_reference(tvm_on_cpu):
    torch.manual_seed(0)
    layer = QuantizedLinear(70, 9)
    x = torch.randn(5, 70, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    x_q, s_x = quantize_per_tensor(x, batch_amax(x))
    w_q, s_w = quantize_weight(layer.weight)
    ref = (x_q.double() * s_x.double()) @ (w_q.double() * s_w.double()[:, None]).T + layer.bias.detach().double()
    assert_matches_reference(y.detach(), ref)
    assert_matches_reference(x.grad, g.double() @ (w_q.double() * s_w.double()[:, None]))
    assert_matches_reference(layer.weight.grad, g.double().T @ (x_q.double() * s_x.double()))
    # batch 5 became the width of one image: "70->9 1x1 s1 @1x5 b1"
    assert {d for k, d in tvm_kernels.CALLS if k not in ("quantize", "conv_scales", "range_ema")} == {
        "70->9 1x1 s1 @1x5 b1 pad(0, 0, 0, 0)"}


def test_linear_layer_at_batch_1_matches_reference(tvm_on_cpu):
    torch.manual_seed(0)
    layer = QuantizedLinear(12, 5)
    x = torch.randn(1, 12, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    x_q, s_x = quantize_per_tensor(x, batch_amax(x))
    w_q, s_w = quantize_weight(layer.weight)
    w_deq = w_q.double() * s_w.double()[:, None]
    assert_matches_reference(y.detach(), (x_q.double() * s_x.double()) @ w_deq.T + layer.bias.detach().double())
    assert_matches_reference(x.grad, w_deq.sum(0, keepdim=True))


@pytest.mark.parametrize("layout", list(NONCONTIGUOUS), ids=list(NONCONTIGUOUS))
def test_noncontiguous_input_and_grad_through_tvm_kernels_are_bit_identical(tvm_on_cpu, layout):
    base = CASES[0]
    x = torch.randn((base.batch, base.cin) + base.hw, generator=torch.Generator().manual_seed(0))
    contiguous, _, _ = run_twins(base, x=x)
    grad = torch.randn(contiguous.out.shape, generator=torch.Generator().manual_seed(1))
    ours, _, _ = run_twins(base, x=NONCONTIGUOUS[layout](x), grad=NONCONTIGUOUS[layout](grad))
    for name in ("out", "dx", "dw", "db"):
        assert torch.equal(getattr(ours, name), getattr(contiguous, name)), name


def test_misaligned_view_is_copied_before_tvm_sees_it():
    # TVM kernels assume 64-byte aligned data (an llvm kernel segfaulted on a 4-byte aligned view).
    big = torch.zeros(100)
    view = big[1:17]
    assert view.is_contiguous() and view.data_ptr() % tvm_kernels.ALIGNMENT != 0
    ready = tvm_kernels._ready(view)
    assert ready.data_ptr() % tvm_kernels.ALIGNMENT == 0 and torch.equal(ready, view)
    aligned = torch.zeros(16)
    assert tvm_kernels._ready(aligned) is aligned


# ----------------------------------------------------------------------------- the cache

SMALL = conv_wl(1, 4, 5, 5, 4, relu=False, out_dtype="int32")


def _fresh_memory(monkeypatch):
    monkeypatch.setattr(tvm_kernels, "_kernels", {})


def test_kernel_is_built_once_and_then_loaded_from_disk(tvm_on_cpu, monkeypatch):
    cpu = torch.device("cpu")
    fn = tvm_kernels.get_kernel("forward", SMALL, cpu)
    assert tvm_kernels.get_kernel("forward", SMALL, cpu) is fn  # memory
    path = tvm_kernels.cache_path("forward", SMALL, "llvm")
    assert os.path.dirname(path) == str(tvm_on_cpu) and os.path.exists(path)
    from tvm_qconv.fileio import TEMP_PREFIX
    assert [f for f in os.listdir(tvm_on_cpu) if f.startswith(TEMP_PREFIX)] == []
    _fresh_memory(monkeypatch)
    monkeypatch.setattr(tvm_kernels, "_build", lambda *a: pytest.fail("rebuilt a cached kernel"))
    tvm_kernels.get_kernel("forward", SMALL, cpu)  # disk


def test_prebuild_compiles_what_a_step_calls_so_the_step_builds_nothing(tvm_on_cpu, monkeypatch):
    # the dry run (on a copy) notes the kernels, two processes build them into the cache; the real
    # step then calls exactly those, loads them all, and gets what a step without prebuild gets
    import copy
    case = next(c for c in CASES if c.relu and c.bias)
    torch.manual_seed(0)
    layer, _ = case.layers()
    fresh = copy.deepcopy(layer)
    x, grad = _input(case, 0), None
    stats = tvm_kernels.prebuild(lambda: _run(copy.deepcopy(layer), x, grad), workers=2)
    assert stats["failed"] == [] and {k for k, _ in stats["built"]} >= {"quantize", "forward", "grad_input",
                                                                        "grad_weight", "relu_bits", "mask"}
    assert not tvm_kernels.CALLS                           # the dry run's calls are not reported
    assert len(os.listdir(tvm_on_cpu)) == len(stats["built"])

    build = tvm_kernels._build

    def no_build(*args):
        raise AssertionError("the step built a kernel that prebuild should have")
    monkeypatch.setattr(tvm_kernels, "_build", no_build)
    ours, _ = _run(layer, x, grad)
    assert set(tvm_kernels.CALLS) == set(stats["built"])
    # a fresh cache, no prebuild: the same bits
    monkeypatch.setattr(tvm_kernels, "_build", build)
    monkeypatch.setenv(tvm_kernels.CACHE_ENV, str(tvm_on_cpu) + "-fresh")
    monkeypatch.setattr(tvm_kernels, "_kernels", {})
    ref, _ = _run(fresh, x, grad)
    for name in ("out", "dx", "dw", "db"):
        assert torch.equal(getattr(ours, name), getattr(ref, name))


def test_corrupt_cache_entry_is_rebuilt_with_a_warning(tvm_on_cpu, monkeypatch):
    cpu = torch.device("cpu")
    path = tvm_kernels.cache_path("forward", SMALL, "llvm")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x7fELF truncated")
    with pytest.warns(UserWarning, match="does not load.*rebuilding"):
        fn = tvm_kernels.get_kernel("forward", SMALL, cpu)
    x = torch.ones(1, 1, 5, 5, 4, dtype=torch.int8)
    w = torch.ones(1, 1, 3, 3, 4, 4, dtype=torch.int8)
    out = torch.zeros(1, 1, 5, 5, 4, dtype=torch.int32)
    fn(x, w, out)
    assert int(out[0, 0, 2, 2, 0]) == 36  # 3x3 taps x 4 channels of ones


def test_interrupted_build_leaves_no_cache_entry(tvm_on_cpu, monkeypatch):
    class Interrupted(Exception):
        pass

    def export_then_die(self, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"half a library")
        raise Interrupted

    monkeypatch.setattr(tvm.runtime.Executable, "export_library", export_then_die)
    with pytest.raises(Interrupted):
        tvm_kernels.get_kernel("forward", SMALL, torch.device("cpu"))
    assert not os.path.exists(tvm_kernels.cache_path("forward", SMALL, "llvm"))
    assert os.listdir(tvm_on_cpu) == []


def test_cache_key_changes_with_workload_arch_and_tvm_version():
    base = tvm_kernels.cache_path("forward", SMALL, "sm_90")
    assert tvm_kernels.cache_path("forward", conv_wl(1, 4, 5, 6, 4, relu=False, out_dtype="int32"), "sm_90") != base
    assert tvm_kernels.cache_path("forward", SMALL, "sm_80") != base
    assert tvm_kernels.cache_path("grad_input", GW(1, 4, 5, 5, 4), "sm_90") != base
    assert tvm_kernels.cache_path("forward", SMALL, "sm_90") == base  # and only with those
    assert tvm.__version__ in str(tvm_kernels.cache_key("forward", SMALL, "sm_90"))


def test_source_hash_changes_when_any_kernel_source_file_changes(tmp_path):
    import shutil
    tree = tmp_path / "schedules"
    shutil.copytree(tvm_kernels._SCHEDULES_DIR, tree, ignore=shutil.ignore_patterns("__pycache__"))
    base = tvm_kernels.source_hash(str(tree))
    assert base == tvm_kernels.source_hash(tvm_kernels._SCHEDULES_DIR)  # the same text, the same hash
    helper = tree / "nchw4c" / "dp4a.py"  # a loop helper the gradient kernels import too
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert tvm_kernels.source_hash(str(tree)) != base
    # the modules that select and target the kernels count too
    package = tmp_path / "tvm_qconv"
    for rel in tvm_kernels._PACKAGE_SOURCES:
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(tvm_kernels._PACKAGE_DIR, rel), package / rel)
    base = tvm_kernels.source_hash(str(tree), str(package))
    for rel in ("registry.py", "target.py"):
        (package / rel).write_text((package / rel).read_text() + "\n# edited\n")
        assert tvm_kernels.source_hash(str(tree), str(package)) != base
        base = tvm_kernels.source_hash(str(tree), str(package))


def test_importing_the_training_layers_does_not_import_tvm():
    code = "import sys, tvm_qconv.nn, tvm_qconv.models.quantized_vgg; print('tvm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("scale_shape, bias, relu", [((), False, False), ((20,), True, True), ((20,), False, True)])
def test_the_tensor_core_convs_float_output_is_one_dequantizing_kernel_with_torchs_bits(tensor_cores_on_llvm,
                                                                                        scale_shape, bias, relu):
    # On a GPU the NHWC32 accumulators of a 16+ channel conv go to float NCHW in one kernel
    # (scale, bias, ReLU: elementwise.dequantize); here the conv's compute runs on llvm and the
    # dequantizing kernel is the llvm build of the same definition, against the torch operations
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-127, 128, (2, 24, 9, 7), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (20, 24, 3, 3), generator=g, dtype=torch.int8)
    scale = torch.rand(scale_shape, generator=g) * 1e-5
    b = torch.randn(20, generator=g) if bias else None
    args = ((2, 1), (1, 1, 1, 1), (1, 1), 1, scale, b, relu)
    y = tvm_kernels.int8_conv_dequantized(x_q, w_q, *args)
    assert ("dequantize", f"dequantize 20 @5x7 b2{' per-channel' if scale_shape else ''} nhwc32"
            f"{' bias' if bias else ''}{' relu' if relu else ''}") in tvm_kernels.CALLS
    assert torch.equal(y, functional.int8_conv_dequantized_torch(x_q, w_q, *args))


@pytest.mark.parametrize("per_channel, mult", [(False, False), (True, False), (False, True)])
def test_the_quantizing_kernel_gives_torchs_int8_including_ties(tvm_on_cpu, per_channel, mult):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 6, generator=g) * 4
    scale = torch.full((5,) if per_channel else (), 0.5)
    x[0, 0, 0, :4] = torch.tensor([0.25, -0.25, 0.75, 63.25])    # x / s = 0.5, -0.5, 1.5, 126.5: ties to even
    m = torch.rand(5, generator=g) + 0.5 if mult else None
    if mult:
        m[0] = 1.0
    q = tvm_kernels.quantize(x, scale, m)
    assert q[0, 0, 0, :4].tolist() == [0, 0, 2, 126]
    assert torch.equal(q, functional.quantize_torch(x, scale, m))


def test_the_relu_mask_kernels_give_pack_bits_and_masked_fills_bits(tvm_on_cpu):
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 3, 5, 7), (1, 8, 4, 4)]:     # 210 elements: a partial last byte; 128: whole bytes
        y, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        bits = tvm_kernels.relu_bits(y)
        assert torch.equal(bits, functional.pack_bits(y > 0))
        assert torch.equal(tvm_kernels.mask(grad, bits), grad.masked_fill(y <= 0, 0.0))


def test_a_compact_relus_output_range_comes_from_its_kernel_for_the_next_int8_layer(tvm_on_cpu, monkeypatch):
    # CompactReLU's forward is one kernel (elementwise.relu: relu, bits, max|y| a byte); the next
    # int8 conv's input range is then that, without an aminmax of its own; the step's bits do not move
    from tvm_qconv.nn import CompactReLU, QuantizedConv2d
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), CompactReLU(), QuantizedConv2d(8, 4, 3))
    x = torch.randn(2, 3, 6, 6)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), QuantizedConv2d(8, 4, 3))
    ref.load_state_dict(model.state_dict())
    aminmax, calls = torch.aminmax, []
    monkeypatch.setattr(torch, "aminmax", lambda t, *a, **k: calls.append(tuple(t.shape)) or aminmax(t, *a, **k))
    y = model.train()(x)
    assert ("relu", "relu 8 @6x6 b2") in tvm_kernels.CALLS
    assert calls == [(2, 4, 4, 4)]      # only the conv's output (dp4a's NCHW4c on llvm: no fused range)
    y_ref = ref.train()(x)
    assert (2, 8, 6, 6) in calls
    assert torch.equal(y, y_ref) and torch.equal(model[2].input_amax, ref[2].input_amax)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.equal(model[0].weight.grad, ref[0].weight.grad)


# (shape, masked): rows of 4 (the vectorized quantize_grad), of 7 (not), a partial last byte of
# bits, a linear layer's [N, K, 1, 1], a feature map large enough for 256-thread stats blocks
GRAD_SHAPES = [((2, 3, 5, 8), True), ((3, 4, 6, 7), True), ((5, 6, 1, 1), False), ((4, 2, 48, 48), True)]


@pytest.mark.parametrize("shape, masked", GRAD_SHAPES)
def test_the_gradient_stats_kernel_gives_torchs_max_and_the_sum_in_float64(tvm_on_cpu, shape, masked):
    g = torch.Generator().manual_seed(0)
    grad, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    bits = functional.pack_bits(y > 0) if masked else None
    amax, total = tvm_kernels.grad_stats(grad, bits)
    ref_amax, ref_total = functional.grad_stats_torch(grad, bits)
    assert torch.equal(amax, ref_amax)      # a max is exact in any order
    kept = grad.masked_fill(y <= 0, 0.0) if masked else grad
    exact = kept.double().sum(dim=(0, 2, 3))
    # summed in float64 and rounded once: within half an ulp of the exact sum (float64 error
    # over <= 10**4 terms is ~1e-12 relative, far below float32's 6e-8)
    assert torch.allclose(total.double(), exact, rtol=6e-8, atol=1e-12)
    assert torch.allclose(total, ref_total, rtol=1e-5, atol=1e-5)   # torch's float32 sum order
    # the partials finished by a kernel (grad_finish), not by torch's reductions
    assert [k for k, _ in tvm_kernels.CALLS] == ["grad_stats", "grad_finish"]


@pytest.mark.parametrize("shape, masked", GRAD_SHAPES)
@pytest.mark.parametrize("outputs", ["dx", "dw", "both"])
def test_the_gradient_quantizing_kernel_gives_both_of_torchs_int8_operands(tvm_on_cpu, shape, masked, outputs):
    g = torch.Generator().manual_seed(1)
    grad, y = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    bits = functional.pack_bits(y > 0) if masked else None
    c = shape[1]
    w_scale = torch.rand(c, generator=g) + 0.5
    s_dx = torch.tensor(0.05) if outputs in ("dx", "both") else None
    s_dw = torch.rand(c, generator=g) * 0.05 + 0.01 if outputs in ("dw", "both") else None
    mult = w_scale if s_dx is not None else None
    q_dx, q_dw = tvm_kernels.quantize_grad(grad, bits, s_dx, mult, s_dw)
    ref_dx, ref_dw = functional.quantize_grad_torch(grad, bits, s_dx, mult, s_dw)
    for ours, ref in ((q_dx, ref_dx), (q_dw, ref_dw)):
        assert (ours is None) == (ref is None)
        if ref is not None:
            assert ours.dtype == torch.int8 and torch.equal(ours, ref)
    assert {k for k, _ in tvm_kernels.CALLS} == {"quantize_grad"}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_int8_gradients_through_tvm_kernels_read_g_twice_and_equal_the_torch_path(tvm_on_cpu, monkeypatch, case):
    # both gradients int8: the stats and quantizing kernels replace the mask, the max and the two
    # quantizations (g is read twice, never masked in memory); dx and dw bit-equal to the torch
    # elementwise path's, the bias gradient within float32 summation order
    def grads():
        torch.manual_seed(0)
        layer, _ = case.layers()
        layer.input_grad = layer.weight_grad = "int8"
        x = torch.randn((8, case.cin) + case.hw, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        return x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad

    ours = grads()
    kinds = {k for k, _ in tvm_kernels.CALLS}
    assert {"grad_stats", "quantize_grad"} <= kinds and "mask" not in kinds
    monkeypatch.setitem(functional.ELEMENTWISE_KERNELS, "cpu", {})
    ref = grads()
    assert torch.equal(ours[0], ref[0]) or not _int8_dx_is_a_conv(case)
    assert_matches_reference(ours[0], ref[0])
    assert torch.equal(ours[1], ref[1]) or case.groups > 1
    assert_matches_reference(ours[1], ref[1])
    if ref[2] is not None:
        torch.testing.assert_close(ours[2], ref[2], rtol=1e-5, atol=1e-5)


def test_the_gradient_kernels_compile_for_cuda_with_16_byte_loads_and_register_sums():
    # VGG16's first gradient at batch 32 (64 x 224 x 224): the quantizing kernel reads 4 floats at
    # once and divides with __fdiv_rn (near ties only); the stats kernel reads 4 pixels at once,
    # keeps its max and sum in registers (written once per thread) and runs 256-thread blocks
    from tvm_qconv.schedules.training import elementwise
    shape = (32, 64, 224, 224)
    cuda = make_target("cuda", arch="sm_90")
    for wl in [elementwise.ElementwiseWorkload("quantize_grad", shape, relu=True, dx=True, dw=True),
               elementwise.ElementwiseWorkload("grad_stats", shape, relu=True)]:
        src = cuda_source(tvm.compile(tvm.IRModule({"main": elementwise.definition(wl, cuda)}), target=cuda))
        assert src.count("__global__ void") == 2 and "__launch_bounds__(256)" in src, wl.kind   # one kernel
        if wl.kind == "quantize_grad":   # correctly rounded float32 ops, none of the float64 pipe's
            assert "*(float4*)" in src and "__fdiv_rn" in src and "__fmul_rn" in src and "double" not in src
        else:
            assert "local_ptr[1]" in src and "double" in src and "*(float4*)" in src
    blocks, threads, per = elementwise.stats_grid(shape)    # items of 4 pixels (224 * 224 % 4 == 0)
    assert elementwise.quads(shape) and threads == 256
    assert 4 * per >= elementwise.STATS_PER_THREAD and blocks * threads * per * 4 >= 32 * 224 * 224


@pytest.mark.parametrize("weight_shape", [(64, 32, 3, 3), (32, 96, 1, 1), (40, 3, 3, 3)],
                         ids=["conv", "linear", "no_whole_tiles"])
def test_the_sums_scaling_kernel_gives_torchs_int_times_float_bits(tvm_on_cpu, weight_shape):
    # dw = float(sum) * scale[o] through tvm_kernels.scale_sums (llvm here; a shared-memory
    # transpose on CUDA) from the tensor cores' [C, KH, KW, O] order, against torch.mul's bits;
    # a shape without whole 32 x 32 tiles goes through torch
    o = weight_shape[0]
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(-2 ** 31, 2 ** 31 - 1, weight_shape[1:] + (o,), generator=gen, dtype=torch.int32)
    sums, scale = base.permute(3, 0, 1, 2), torch.rand(o, generator=gen) * 1e-6
    ours = tvm_kernels.scale_sums(sums, scale)
    assert ours.is_contiguous() and torch.equal(ours, functional.scale_sums_torch(sums, scale))
    from tvm_qconv.schedules.training import elementwise
    assert ({k for k, _ in tvm_kernels.CALLS} == {"scale_sums"}) == elementwise.scale_sums_tiles(weight_shape)


@pytest.mark.parametrize("weight_shape, groups", [((64, 32, 3, 3), 1), ((64, 96, 1, 1), 1), ((40, 32, 3, 3), 1),
                                                  ((64, 16, 3, 3), 2)],
                         ids=["conv", "linear", "no_whole_tiles", "groups"])
def test_dx_weight_flip_and_transpose_kernel_gives_torchs_and_packs_without_a_copy(tvm_on_cpu, weight_shape, groups):
    # dx's weight [C, O, KH, KW] flipped through tvm_kernels.flip_transpose (llvm here; a
    # shared-memory transpose on CUDA) equals torch's flip of the transposed view; it is a view of
    # [C, KH, KW, O], so the tensor cores' weight pack ([C_p, KH*KW*O_p]) is a view of it too;
    # groups and shapes without whole 32 x 32 tiles go through torch
    from tvm_qconv.schedules.training import elementwise
    w_q = torch.randint(-127, 128, weight_shape, generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    ours = tvm_kernels.flip_transpose(w_q, groups)
    assert torch.equal(ours, functional.flipped_transposed_torch(w_q, groups))
    kernel = groups == 1 and elementwise.flip_transpose_tiles(weight_shape)
    assert ({k for k, _ in tvm_kernels.CALLS} == {"flip_transpose"}) == kernel
    if kernel:
        packed = tvm_kernels._pack_weight_nhwc32(ours)
        assert packed.data_ptr() == ours.data_ptr()      # no copy
        assert torch.equal(packed, tvm_kernels._pack_weight_nhwc32(functional.flipped_transposed_torch(w_q, 1)))


@pytest.mark.parametrize("kernel", [(3, 3), (1, 1)], ids=["3x3", "1x1"])
def test_the_int8_input_gradient_packs_its_flipped_weight_without_a_copy_and_notes_no_range(tensor_cores_on_llvm,
                                                                                          monkeypatch, kernel):
    # dx as the tensor cores run it (on llvm): the flipped, transposed weight reaches the weight
    # pack as flip_transpose's [C, KH, KW, O] (the pack's own layout: no copy), dx's dequantize
    # writes no range (nothing reads an input gradient's), and dx has the float reference's bits
    kinds = tensor_cores_on_llvm
    packed = []
    pack = tvm_kernels._pack_weight_nhwc32
    monkeypatch.setattr(tvm_kernels, "_pack_weight_nhwc32", lambda w: packed.append(w) or pack(w))
    g = torch.Generator().manual_seed(0)
    kh, kw = kernel
    pad = (kh // 2,) * 4
    g_q = torch.randint(-127, 128, (2, 64, 5, 6), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (64, 32, kh, kw), generator=g, dtype=torch.int8)
    w_scale, s_g = torch.rand(64, generator=g) * 1e-2, torch.tensor(0.01)
    dx = functional._conv_input_grad_int8(g_q, s_g, w_q, w_scale, (2, 32, 5, 6), (1, 1), pad, (1, 1), 1)
    assert [k for k, _ in kinds if k == "flip_transpose"] == ["flip_transpose"]
    assert packed[-1].shape == (32, 64, kh, kw) and packed[-1].permute(0, 2, 3, 1).is_contiguous()
    assert [wl.amax for k, wl in kinds if k == "dequantize"] == [False]
    ref = torch.nn.grad.conv2d_input((2, 32, 5, 6), w_q.double(), g_q.double() * s_g.double(), padding=kh // 2)
    torch.testing.assert_close(dx.double(), ref, rtol=1e-6, atol=1e-9)   # float32 rounding of exact sums


def test_a_passthroughs_gradient_is_added_in_dxs_dequantizing_kernel_with_torchs_bits(tensor_cores_on_llvm):
    # dx + the identity's gradient (a residual block's, QuantizedConv2dFunction's passthrough) in
    # dx's one dequantize (addend, no range) on the tensor-core path: the bits of dx, then torch's add
    kinds = tensor_cores_on_llvm
    g = torch.Generator().manual_seed(0)
    g_q = torch.randint(-127, 128, (2, 64, 5, 6), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (64, 32, 1, 1), generator=g, dtype=torch.int8)
    w_scale, s_g = torch.rand(64, generator=g) * 1e-2, torch.tensor(0.01)
    addend = torch.randn(2, 32, 5, 6, generator=g)
    args = (g_q, s_g, w_q, w_scale, (2, 32, 5, 6), (1, 1), (0, 0, 0, 0), (1, 1), 1)
    joined = functional._conv_input_grad_int8(*args, addend=addend)
    dequantizes = [wl for k, wl in kinds if k == "dequantize"]
    assert len(dequantizes) == 1 and dequantizes[0].addend and not dequantizes[0].amax
    assert torch.equal(joined, functional._conv_input_grad_int8(*args) + addend)


def test_batch_norms_channel_kernels_give_the_definitions_values(tvm_on_cpu):
    # bn_finish and bn_coeffs (llvm here; a thread a channel on CUDA) against batch_norm's torch
    # definition from the same float64 sums: the statistics, scale and coefficients bit for bit;
    # the running statistics within a float32 rounding (torch may fuse add_'s alpha product)
    from tvm_qconv.nn import batch_norm
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 40, 6, 6, generator=g) * 3 + 1
    gamma = torch.rand(40, generator=g) + 0.5
    rm, rv = torch.randn(40, generator=g), torch.rand(40, generator=g) + 0.5
    ref_rm, ref_rv = rm.clone(), rv.clone()
    ours = tvm_kernels.bn_train_stats(y, gamma, rm, rv, 1e-5, 0.1)
    ref = batch_norm.train_stats(y, gamma, ref_rm, ref_rv, 1e-5, 0.1)
    assert {k for k, _ in tvm_kernels.CALLS} == {"bn_stats", "bn_finish"}
    # mean, invstd, scale: the same bits (the float64 sums' order could move one in a rare tie)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    torch.testing.assert_close(rm, ref_rm, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rv, ref_rv, rtol=1e-6, atol=1e-7)
    s1, s2 = torch.randn(40, generator=g, dtype=torch.float64) * 50, torch.randn(40, generator=g, dtype=torch.float64)
    invstd = ours[1]
    got = tvm_kernels.bn_coeffs(s1, s2, gamma, invstd, 144)
    want = batch_norm.grad_coefficients(s1, s2, gamma, invstd, 144)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the same from [C, K] partials (bn_grad_sums' on CUDA), added in the kernel: multiples of
    # 2^-20 well inside float64's 53 bits, so the sums are exact in any order and the bits comparable
    p1 = torch.randint(-2**20, 2**20, (40, 300), generator=g).to(torch.float64) / 2**20
    p2 = torch.randint(-2**20, 2**20, (40, 300), generator=g).to(torch.float64) / 2**20
    got = tvm_kernels.bn_coeffs(p1, p2, gamma, invstd, 144)
    want = batch_norm.grad_coefficients(p1.sum(1), p2.sum(1), gamma, invstd, 144)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any("partials 300" in d for k, d in tvm_kernels.CALLS if k == "bn_coeffs")
    # the torch definition takes the partials too (a kernel's bn_grad_sums with torch's coefficients)
    assert all(torch.equal(a, b) for a, b in zip(batch_norm.grad_coefficients(p1, p2, gamma, invstd, 144), want))


def test_range_records_update_in_one_kernel_with_torchs_bits(tvm_on_cpu):
    # range_ema (llvm here; one thread on CUDA) against update_range_torch: the EMA's bits where a
    # range was recorded, the batch's own where none was (0), in place; NaN stays NaN as in torch
    cases = [(0.0, 3.5), (2.0, 3.0), (3.0, 2.0), (1e-3, 7.25e4), (5.5, 5.5), (1.0, float("nan")),
             (float("inf"), 1.0)]
    for momentum in (0.1, 0.01, 1.0):
        for before, m in cases:
            ours, ref = torch.tensor(before), torch.tensor(before)
            tvm_kernels.update_range(ours, torch.tensor(m), momentum)
            functional.update_range_torch(ref, torch.tensor(m), momentum)
            assert torch.equal(ours, ref) or (ours.isnan() and ref.isnan()), (momentum, before, m, ours, ref)
    assert {k for k, _ in tvm_kernels.CALLS} == {"range_ema"}


def test_a_convs_scales_come_from_one_kernel_with_torchs_bits(tvm_on_cpu):
    # conv_scales (llvm here; a thread a channel on CUDA) against conv_scales_torch: s_x, s_w and
    # their product bit for bit, an all-zero input or weight channel clamped to the minimum scale
    g = torch.Generator().manual_seed(0)
    w_amax = torch.rand(200, generator=g) * torch.logspace(-6, 3, 200)
    w_amax[7] = 0.0
    for amax in (torch.tensor(0.0), torch.tensor(1e-35), torch.tensor(6.123), torch.tensor(3.0e4)):
        for times in (None, torch.tensor(0.0173)):     # backward's: dw's scale from the forward's s_x
            ours = tvm_kernels.conv_scales(amax, w_amax, times)
            ref = functional.conv_scales_torch(amax, w_amax, times)
            assert ours[0].dim() == 0 and all(torch.equal(a, b) for a, b in zip(ours, ref)), (amax, times)
    # backward's three as the functions they stand for
    g_amax, w_scale, x_scale = w_amax.flip(0), torch.rand(200, generator=g) * 1e-2, torch.tensor(0.0173)
    s_dx, s_dw, dw_scale = functional._grad_scales(g_amax, w_scale, x_scale)
    assert torch.equal(s_dx, functional.input_grad_scale(g_amax, w_scale))
    assert torch.equal(s_dw, functional.weight_grad_scales(g_amax)) and torch.equal(dw_scale, x_scale * s_dw)
    assert {k for k, _ in tvm_kernels.CALLS} == {"conv_scales"}


def test_batch_norm_partials_over_the_cap_are_added_by_torch_first(tvm_on_cpu, monkeypatch):
    # K partials a channel above bn_channel.MAX_PARTIALS (ResNet-50 b128's stem: 50,176) reach
    # bn_finish as [C] sums (a block a channel would read them alone); under it, as partials
    from tvm_qconv.nn import batch_norm
    from tvm_qconv.schedules.training import bn_channel, elementwise
    g = torch.Generator().manual_seed(0)
    y, gamma = torch.randn(4, 8, 16, 16, generator=g), torch.rand(8, generator=g) + 0.5
    k = elementwise.stats_grid(y.shape)[0] * elementwise.stats_grid(y.shape)[1]
    results = []
    for cap in (k, k - 1):
        monkeypatch.setattr(bn_channel, "MAX_PARTIALS", cap)
        tvm_kernels.CALLS.clear()
        results.append(tvm_kernels.bn_train_stats(y, gamma, torch.zeros(8), torch.ones(8), 1e-5, 0.1))
        finish = [d for kind, d in tvm_kernels.CALLS if kind == "bn_finish"]
        assert len(finish) == 1 and (f"partials {k}" in finish[0]) == (cap == k), finish
    want = batch_norm.train_stats(y, gamma, torch.zeros(8), torch.ones(8), 1e-5, 0.1)
    for got in results:     # the statistics either way (the float64 sums' order could move a rare tie)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_weight_gradient_sums_scale_to_the_float_paths_bits_in_one_pass(monkeypatch, dtype):
    # the tensor cores hand dw's exact sums as int32 (one slice) or int64 (slices added), in their
    # [C, KH, KW, O] order: dw = sums * (s_x * s_g[o]) in one torch.mul must give the bits of the
    # float64 sums rounded to float32 and then scaled (the CPU reference's two steps)
    case = CASES[0]
    exact = functional.int8_weight_grad_cpu

    def integer_sums(*args):
        sums = exact(*args)
        return sums.to(dtype).permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)   # exact, strided

    def dw():
        torch.manual_seed(0)
        layer, _ = case.layers()
        layer.weight_grad = "int8"
        x = torch.randn((16, case.cin) + case.hw, generator=torch.Generator().manual_seed(0))
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        return layer.weight.grad

    ref = dw()
    monkeypatch.setitem(functional.INT8_WEIGHT_GRAD_KERNELS, "cpu", integer_sums)
    ours = dw()
    assert ours.is_contiguous() and torch.equal(ours, ref)


def test_an_elementwise_kernel_past_int32_indexing_is_refused_with_what_to_do():
    # the written kernels index in int32: a pack of 2.4 G padded elements would wrap silently
    from tvm_qconv.schedules.training import elementwise
    with pytest.raises(ValueError, match="index in int32.*smaller batch"):
        elementwise.ElementwiseWorkload("pack", (9, 64, 2048, 2048))
    with pytest.raises(ValueError, match="smaller batch"):   # 3 channels padded to 32 in NHWC32
        elementwise.ElementwiseWorkload("dequantize", (700, 3, 320, 320), layout="nhwc32")
    elementwise.ElementwiseWorkload("pack", (32, 64, 224, 224))      # VGG16's first map at batch 32
