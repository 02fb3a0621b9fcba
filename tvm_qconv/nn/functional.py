"""Quantization-aware int8 conv / linear for PyTorch training: quantizers and the autograd Function.

Forward (seed 000's scheme, symmetric, zero point 0 everywhere)::

    s_x    = amax / 127                       per tensor; amax = max|x| of the batch in training,
                                              the learned (EMA) amax in eval
    s_w[o] = max|w[o]| / 127                  per output channel
    x_q    = clamp(round(x / s_x), -127, 127)            int8
    w_q    = clamp(round(w / s_w[o]), -127, 127)         int8
    acc    = conv(x_q, w_q)                              int32, exact
    y      = relu(acc * s_x * s_w[o] + bias[o])          float (relu optional)

Backward (seed 000's derivation, straight-through estimator at the quantizers)::

    g  = dL/dy * [y > 0]                      (ReLU mask, relu only)
    dx = conv_transpose(g, w_q * s_w) * [|x| <= amax]     the *dequantized int8* weights;
                                                           zero where the input quantizer clipped
    dw = correlate(g, x_q * s_x)                           the *dequantized int8* input
    db = sum(g over N, H, W)

``ctx`` keeps only what backward needs, and no activation at float width: the int8 input (1 byte
per input element), the scalar input scale, the ReLU mask packed 8 per byte (1/8 byte per output
element) and, unless the input was quantized with its own max (training: nothing clips), the clip
mask packed the same way (1/8 byte per input element).  Nothing in forward or backward reads a
value back to the host, so a training step can be captured in a CUDA graph.  The float twin
(``nn.Conv2d`` + ReLU) keeps the float input and the float output: 4 + 4 bytes per element.

The int8 weight is *not* kept, only its per-channel scales (4 bytes an output channel): backward
re-quantizes the float weight, which autograd keeps by reference (the parameter, 0 extra bytes;
its version counter guarantees it is unchanged), with those scales, and the result is
bit-identical to the forward's.  An int8 copy would cost 1 byte per weight: in VGG16 at 224x224,
batch 2, that is 132 MiB (the classifier has 123 M weights); with it the quantized model kept
223 MiB for backward against the float twin's 140 MiB, without it 91 MiB.  Re-quantizing costs
one elementwise pass over the weights per backward (the scales' reduction is not repeated).

Where kernels plug in
---------------------
The autograd code calls three functions and never a kernel directly:

* :func:`_int8_conv_forward` ``(x_q, w_q, stride, padding, dilation, groups) -> int32`` looks up
  ``INT8_CONV_KERNELS[x_q.device.type]``.  The CPU entry (:func:`int8_conv_cpu`) is exact
  (see its docstring).  Its contract: contiguous NCHW int8 ``x_q``, contiguous OIHW int8
  ``w_q`` (``I = C / groups``), ``padding = (top, left, bottom, right)``, returns NCHW int32
  on ``x_q``'s device, any strides (the CUDA kernel returns a view of its NHWC32 or NCHW4c
  output: ``_forward`` converts to float and to contiguous NCHW in one pass).  Linear layers reach the
  same entry point as 1x1 convs on a 1x1 image (``H = W = 1``), so a kernel may route that
  case to a dense kernel.
* :func:`_conv_input_grad` ``(g, w_q, w_scale, ...)`` and :func:`_conv_weight_grad`
  ``(x_q, x_scale, g, ...)`` compute ``dx`` and ``dw`` through ``CONV_GRAD_KERNELS[device]``;
  the default (:func:`conv_input_grad_torch`, :func:`conv_weight_grad_torch`) is PyTorch's own
  conv gradients on the dequantized tensors (float32), device-generic.
* :func:`_quantize` ``(x, scale, mult)``, :func:`_int8_conv_dequantized` ``(x_q, w_q, ...,
  scale, bias, relu, note_range)``, :func:`_relu_bits` ``(y)``, :func:`_mask` ``(g, bits)``,
  :func:`_grad_stats` ``(g, bits)`` (both int8 gradients' ranges and the bias gradient in one
  pass), :func:`_quantize_grad` (both int8 operands in one pass) and :func:`_flipped_transposed`
  ``(w_q, groups)`` (dx's weight): the
  elementwise work around the int8 convs, through ``ELEMENTWISE_KERNELS[device][name]``; the
  defaults (``TORCH_ELEMENTWISE``) are torch operations, which the CUDA kernels (one pass each)
  reproduce bit for bit.

On CUDA all three are TVM kernels generated from this project's TensorIR definitions
(:mod:`tvm_qconv.nn.tvm_kernels`: the int8 forward on tensor cores (mma.sync) or dp4a, float32
gradient kernels with the int8 tensors read as int8), which register themselves the first time a CUDA tensor arrives
(``LAZY_KERNELS``), so that importing ``tvm_qconv`` needs neither TVM nor CUDA.  Set
``TVM_QCONV_KERNELS=torch`` to run CUDA on the PyTorch reference kernels instead (the exact
float64 forward conv and PyTorch's gradients: a debugging aid).  Other registrations:
``register_int8_conv_kernel`` / ``register_conv_grad_kernels``.

Inputs reach the kernels contiguous (``.contiguous()`` in forward and backward): TVM's DLPack
import rejects non-compact arrays (channels_last, transposed or sliced views), and the CPU path
gains nothing from strides either.
"""
from __future__ import annotations

import importlib
import os
import warnings
import weakref
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..ranges.observers import MIN_WEIGHT_SCALE, QMAX

# The scale of an all-zero tensor (amax == 0): any positive scale quantizes 0 exactly.
MIN_INPUT_SCALE = MIN_WEIGHT_SCALE
# float64 represents every integer below 2**53 exactly; an int8 x int8 product is at most
# 127 * 127 = 16129 < 2**14 and an int32 accumulator is below 2**31, so a float64 conv of int8
# values is exact whatever order its GEMM sums in.  float32 (2**24) would already be inexact
# for one 3x3 conv with 1041+ input channels per group of saturated values (VGG16 has 512).
_EXACT_FLOAT = torch.float64
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)

Padding4 = tuple[int, int, int, int]  # (top, left, bottom, right), as Conv2dWorkload.padding


# ----------------------------------------------------------------------------- quantizers

_QMAX_ON: dict[tuple, torch.Tensor] = {}


def _div_qmax(t: torch.Tensor) -> torch.Tensor:
    """``t / 127``, a true division on every device.

    Not ``t / QMAX``: CUDA divides by a Python (or 0-d CPU) scalar as a multiply by its
    reciprocal, which differs from the division in the last bit for some ``t`` (PyTorch's
    ``div_true_kernel_cuda``); the scales would then differ from the CPU's and from the compile
    step's NumPy ones.  Dividing by a tensor on ``t``'s device divides.  Cached per (device,
    dtype) as :func:`_bit_weights`, for the same reason (no host -> device copy)."""
    key = (t.device, t.dtype)
    d = _QMAX_ON.get(key)
    if d is None:
        d = torch.full((), QMAX, dtype=t.dtype, device=t.device)
        if not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _QMAX_ON[key] = d
    return t / d


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The symmetric int8 scale of a range, ``max(amax / 127, MIN_INPUT_SCALE)``, elementwise (a
    true division: :func:`_div_qmax`).  Every scale here is one (``MIN_INPUT_SCALE`` is
    ``MIN_WEIGHT_SCALE``); ``tvm_kernels.conv_scales`` is its CUDA twin."""
    return torch.clamp(_div_qmax(amax), min=MIN_INPUT_SCALE)


def input_scale(amax: torch.Tensor) -> torch.Tensor:
    """Symmetric per-tensor int8 scale ``amax / 127`` (at least ``MIN_INPUT_SCALE``).

    Args:
        amax: 0-d float tensor, the clipping threshold for |x|.

    Returns:
        0-d float32 tensor on ``amax``'s device.
    """
    return scale_of(amax.detach().to(torch.float32))


def quantize_per_tensor(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to int8 with one symmetric scale ``amax / 127``.

    Rounds to nearest (ties to even, as the compile step's ``nearbyint``) instead of the seed's
    truncation: truncation pulls every value toward zero, a bias that does not average out
    over a convolution's sum, and doubles the worst-case error from ``s/2`` to ``s``.
    Values beyond ``amax`` clip to +-127 (-128 is unused, so the range is symmetric).

    Args:
        x: float tensor of any shape.
        amax: 0-d float tensor >= 0.

    Returns:
        ``(x_q, scale)``: int8 ``x_q`` of ``x``'s shape and the 0-d float32 scale;
        ``x ~= x_q * scale``.

    Example:
        >>> q, s = quantize_per_tensor(torch.tensor([0.5, -1.0, 3.0]), torch.tensor(1.0))
        >>> q.tolist()
        [64, -127, 127]
    """
    scale = input_scale(amax)
    # In place after the division: one float temporary, not three (411 MB each for VGG16's first
    # activations at batch 32); the same operations, so the same bits.
    q = x.detach().to(torch.float32) / scale
    q = q.round_().clamp_(-QMAX, QMAX)
    return q.to(torch.int8), scale


def quantize_per_channel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize NCHW ``x`` to int8 with one symmetric scale per channel, ``max|x[:, c]| / 127``
    (at least ``MIN_INPUT_SCALE``: an all-zero channel quantizes to zeros), rounded to nearest.

    Returns:
        ``(x_q, scale)``: int8 ``x_q`` of ``x``'s shape and the float32 ``(C,)`` scales.
    """
    scale = scale_of(channel_amax(x))
    return quantize_torch(x, scale), scale


def channel_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x[:, c]|`` per channel of NCHW ``x``, float32 ``(C,)``: one reduction, no ``|x|`` temporary."""
    return torch.linalg.vector_norm(x.detach(), float("inf"), dim=(0, 2, 3)).to(torch.float32)


def quantize_torch(x: torch.Tensor, scale: torch.Tensor, mult: torch.Tensor | None = None) -> torch.Tensor:
    """int8 ``clamp(round(x [* mult[c]] / scale), -127, 127)`` of NCHW ``x``, by torch: ``scale``
    0-d (per tensor) or ``(C,)`` (per channel), ``mult`` None or ``(C,)``; float32 arithmetic."""
    v = x.detach().to(torch.float32)
    if mult is not None:
        v = v * mult.view(1, -1, 1, 1)
    q = v / (scale.view(1, -1, 1, 1) if scale.dim() else scale)
    return q.round_().clamp_(-QMAX, QMAX).to(torch.int8)


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric scales ``max|w[o]| / 127`` (at least ``MIN_WEIGHT_SCALE``).

    The same float32 arithmetic as :func:`tvm_qconv.observers.weight_scales_per_channel`, so
    the int8 weights trained here are the ones the compile step builds, bit for bit.

    Args:
        w: weights with output channels on axis 0.

    Returns:
        float32 tensor of shape ``(O,)``.
    """
    return scale_of(weight_amax(w))


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """``max|w[o]|`` per output channel (axis 0), float32 ``(O,)``: one reduction."""
    return torch.linalg.vector_norm(w.detach().reshape(w.shape[0], -1), float("inf"), dim=1).to(torch.float32)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to int8, symmetric per output channel, rounding to nearest.

    Args:
        w: weights with output channels on axis 0 (OIHW, or OI).

    Returns:
        ``(w_q, scales)``: int8 ``w_q`` with ``w``'s shape, values in [-127, 127], and float32
        ``scales`` of shape ``(O,)``; ``w ~= w_q * scales[:, None, ...]``.  Nothing clips
        (the scale comes from ``max|w[o]|``), so the weight STE passes every gradient.
    """
    scales = weight_scales(w)
    s = scales.reshape((-1,) + (1,) * (w.dim() - 1))
    q = (w.detach().to(torch.float32) / s).round_().clamp_(-QMAX, QMAX)  # one temporary, as above
    return q.to(torch.int8), scales


def batch_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a 0-d float32 tensor (0 for an empty tensor), without an |x| temporary.

    Where the range of this very tensor was noted (:func:`note_amax`: a layer notes its output's,
    which it observes for its record) it is not computed again: the next layer's input range is
    then free when the output is that input, as in VGG16 (10 of its step's 32 reductions)."""
    known = known_amax(x)
    if known is not None:
        return known.clone()    # a copy: the caller may change it in place
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(-lo, hi).to(torch.float32)


# ``id(tensor) -> (weakref to it, its version counter then, max|tensor|, that amax's version)``: a
# tensor's range while it lives unchanged (an in-place op bumps a version: of the tensor, or of the
# amax a caller was handed; the weakref's callback drops the entry).
# Python-side bookkeeping only, so a step that uses it records the same kernels in a CUDA graph.
_AMAX: dict[int, tuple] = {}


def note_amax(t: torch.Tensor, amax: torch.Tensor) -> None:
    """Record that ``batch_amax(t)`` is ``amax`` (0-d float32, on ``t``'s device) until ``t``
    changes in place or is freed.  For tensors a layer has just made (its output): a write that
    bypasses the version counter (through ``.numpy()``, ``.data`` or DLPack) would leave the record
    stale, so tensors a user refills (an input buffer) are never noted.  Inference tensors (no
    version counter) are not recorded."""
    if t.is_inference() or amax.is_inference():
        return
    key = id(t)

    def forget(ref, key=key):
        entry = _AMAX.get(key)
        if entry is not None and entry[0] is ref:
            del _AMAX[key]

    _AMAX[key] = (weakref.ref(t, forget), t._version, amax, amax._version)


def known_amax(t: torch.Tensor) -> torch.Tensor | None:
    """The range :func:`note_amax` recorded for ``t`` while it still holds (else None); not a copy."""
    entry = _AMAX.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t._version or entry[3] != entry[2]._version:
        return None
    return entry[2]


# ----------------------------------------------------------------------------- bit masks

_BIT_WEIGHTS_ON: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    """``_BIT_WEIGHTS`` as a uint8 tensor on ``device``, made by kernels (``1 << arange(8)``), not
    copied from the host: a host -> device copy would break CUDA-graph capture.  Cached per device,
    except while a graph is being captured (a tensor made then lives in the graph's memory pool)."""
    w = _BIT_WEIGHTS_ON.get(device)
    if w is None:
        w = torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                     torch.arange(8, dtype=torch.uint8, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _BIT_WEIGHTS_ON[device] = w
    return w


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor 8 elements per byte (uint8, ``ceil(numel / 8)`` long)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``shape``."""
    weights = _bit_weights(packed.device)
    bits = (packed.unsqueeze(1) & weights) != 0
    n = 1
    for d in shape:
        n *= d
    return bits.reshape(-1)[:n].reshape(tuple(shape))


# ----------------------------------------------------------------------------- kernels

def _is_symmetric(padding: Padding4) -> bool:
    top, left, bottom, right = padding
    return top == bottom and left == right


def _pad(x: torch.Tensor, padding: Padding4) -> torch.Tensor:
    top, left, bottom, right = padding
    return F.pad(x, (left, right, top, bottom))


def int8_conv_cpu(x_q: torch.Tensor, w_q: torch.Tensor, stride: tuple[int, int], padding: Padding4,
                  dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """Exact int8 x int8 -> int32 conv through PyTorch's float64 conv.

    PyTorch has no integer conv on the CPU.  Its float64 conv is im2col + a float64 GEMM
    (``Slow2d`` / ``SlowDilated2d``: oneDNN, NNPACK and Winograd only take float32), and every
    product and partial sum is an integer below 2**53, so the result is exact in any summation
    order.  Asymmetric padding is applied explicitly (zero point 0: padding with 0 is exact).

    Args:
        x_q: int8 NCHW input.
        w_q: int8 OIHW weight, ``I = C / groups``.
        stride, dilation: (h, w).
        padding: (top, left, bottom, right).
        groups: conv groups.

    Returns:
        int32 NCHW accumulators.
    """
    x = x_q.to(_EXACT_FLOAT)
    if _is_symmetric(padding):
        pad = (padding[0], padding[1])
    else:
        x, pad = _pad(x, padding), (0, 0)
    acc = F.conv2d(x, w_q.to(_EXACT_FLOAT), None, stride, pad, dilation, groups)
    return acc.to(torch.int32)


# Device type -> int8 conv kernel with int8_conv_cpu's signature and contract.
INT8_CONV_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"cpu": int8_conv_cpu}
# Device type -> (input gradient, weight gradient) with conv_*_grad_torch's signatures; devices
# not listed use those (device-generic) PyTorch versions.
CONV_GRAD_KERNELS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {}
# Device type -> module whose ``register(device_type)`` installs its kernels, imported the first
# time a tensor of that type arrives (TVM loads only when a CUDA tensor does).
LAZY_KERNELS = {"cuda": "tvm_qconv.nn.tvm_kernels"}
KERNELS_ENV = "TVM_QCONV_KERNELS"  # "torch": the PyTorch reference kernels on every device


def register_int8_conv_kernel(device_type: str, kernel: Callable[..., torch.Tensor]) -> None:
    """Make ``kernel`` compute every int8 conv on ``device_type`` (e.g. ``"cuda"``).

    Args:
        device_type: ``torch.device.type`` of the tensors it takes.
        kernel: ``(x_q, w_q, stride, padding, dilation, groups) -> int32``, the contract of
            :func:`int8_conv_cpu`.
    """
    INT8_CONV_KERNELS[device_type] = kernel


def register_conv_grad_kernels(device_type: str, input_grad: Callable[..., torch.Tensor],
                               weight_grad: Callable[..., torch.Tensor]) -> None:
    """Make ``input_grad`` / ``weight_grad`` compute the conv gradients on ``device_type``.

    Args:
        device_type: ``torch.device.type`` of the tensors they take.
        input_grad: :func:`conv_input_grad_torch`'s signature and result.
        weight_grad: :func:`conv_weight_grad_torch`'s signature and result.
    """
    CONV_GRAD_KERNELS[device_type] = (input_grad, weight_grad)


def _load_lazy_kernels(device_type: str) -> None:
    """Register ``device_type``'s kernels on first use (see ``LAZY_KERNELS``)."""
    module = LAZY_KERNELS.get(device_type)
    if module is None:
        return
    if os.environ.get(KERNELS_ENV, "").lower() == "torch":
        register_int8_conv_kernel(device_type, int8_conv_cpu)
        register_conv_grad_kernels(device_type, conv_input_grad_torch, conv_weight_grad_torch)
    else:
        importlib.import_module(module).register(device_type)
    del LAZY_KERNELS[device_type]  # only once it worked: a failed import fails again, loudly


def _int8_conv_forward(x_q: torch.Tensor, w_q: torch.Tensor, stride: tuple[int, int], padding: Padding4,
                       dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """The dispatch point of the forward int8 conv: int8 NCHW x int8 OIHW -> int32 NCHW.

    Raises:
        NotImplementedError: no kernel is registered for the tensors' device.
    """
    _load_lazy_kernels(x_q.device.type)
    kernel = INT8_CONV_KERNELS.get(x_q.device.type)
    if kernel is None:
        raise NotImplementedError(
            f"no int8 conv kernel for device {x_q.device.type!r} (have: {sorted(INT8_CONV_KERNELS)}); "
            f"register one with tvm_qconv.nn.functional.register_int8_conv_kernel({x_q.device.type!r}, fn)")
    return kernel(x_q.contiguous(), w_q.contiguous(), stride, padding, dilation, groups)


def int8_conv_dequantized_torch(x_q: torch.Tensor, w_q: torch.Tensor, stride, padding: Padding4, dilation,
                                groups: int, scale: torch.Tensor, bias: torch.Tensor | None = None,
                                relu: bool = False, note_range: bool = True,
                                addend: torch.Tensor | None = None) -> torch.Tensor:
    """float32 NCHW ``[relu](int8_conv(x_q, w_q) * scale [+ bias[o]]) [+ addend]``, by torch around
    the registered int8 conv: ``scale`` 0-d or ``(O,)``, ``bias`` None or float32 ``(O,)``,
    ``addend`` None or float32 of the output's shape (a gradient joining dx: one rounding, as
    autograd's sum of the two).  ``note_range``: a kernel that can write the output's range may
    (here nothing does)."""
    acc = _int8_conv_forward(x_q, w_q, stride, padding, dilation, groups)
    # copy_ converts int32 -> float32 and the kernel's layout -> contiguous NCHW in one pass; the
    # scale is applied in place: one float temporary fewer per layer.
    y = torch.empty(acc.shape, dtype=torch.float32, device=acc.device).copy_(acc)
    del acc
    y.mul_(scale.view(1, -1, 1, 1) if scale.dim() else scale)
    if bias is not None:
        y += bias.view(1, -1, 1, 1)
    if relu:
        torch.relu_(y)
    return y if addend is None else y.add_(addend)


def relu_bits_torch(y: torch.Tensor) -> torch.Tensor:
    """``pack_bits(~(y <= 0))``: the ReLU mask backward keeps, where ``threshold_backward`` passes
    the gradient (``y > 0``, and NaN)."""
    return pack_bits(~(y <= 0))


def relu_with_bits_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(relu(x), relu_bits(relu(x)))``: ``CompactReLU``'s forward and the mask it keeps (the
    bits through ``ELEMENTWISE_KERNELS``' ``relu_bits``, which may note the output's range)."""
    y = torch.relu(x)
    return y, _relu_bits(y)


def mask_torch(g: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``g`` where its bit of ``bits`` (:func:`pack_bits`) is set, else 0."""
    return g.masked_fill(~unpack_bits(bits, g.shape), 0.0)


# The elementwise work around the int8 convs, by torch; ELEMENTWISE_KERNELS[device type] holds
# twins for a device (one-pass kernels giving the same bits), name by name.
def _masked(g: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    return g if bits is None else mask_torch(g, bits)


def grad_stats_torch(g: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max|g'|, sum g')`` per channel of NCHW ``g' = g`` masked by ``bits`` (None: unmasked),
    float32 ``(C,)`` each: the int8 gradients' ranges and the bias gradient."""
    m = _masked(g, bits)
    return channel_amax(m), m.sum(dim=(0, 2, 3))


def quantize_grad_torch(g: torch.Tensor, bits: torch.Tensor | None, s_dx: torch.Tensor | None,
                        mult: torch.Tensor | None, s_dw: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The operands of the int8 gradients from ``g`` masked by ``bits``: ``quantize_torch(g', s_dx,
    mult)`` for ``dx`` and ``quantize_torch(g', s_dw)`` (per channel) for ``dw``; None where its
    scale is None."""
    m = _masked(g, bits)
    return (None if s_dx is None else quantize_torch(m, s_dx, mult)), (None if s_dw is None else quantize_torch(m, s_dw))


def scale_sums_torch(sums: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Contiguous float32 OIHW ``dw = sums * scale[o]`` from integer sums (any strides): int *
    float32 converts each sum to float32 and multiplies in float32, two roundings in one pass (the
    layout change included)."""
    dw = torch.empty(sums.shape, dtype=torch.float32, device=sums.device)
    return torch.mul(sums, scale.view(-1, 1, 1, 1), out=dw)


def conv_scales_torch(amax: torch.Tensor, w_amax: torch.Tensor, times: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A conv's forward scales from its input's range ``amax`` (0-d) and its weight's
    ``w_amax`` (:func:`weight_amax`): ``(s_x, s_w, s_x * s_w)`` (:func:`input_scale`,
    :func:`weight_scales`, the dequantizing scale); ``times * s_w`` last where ``times`` (0-d) is
    given.  Backward's int8 gradient scales are the same arithmetic (:func:`_grad_scales`)."""
    s_x, s_w = input_scale(amax), scale_of(w_amax)
    return s_x, s_w, (s_x if times is None else times) * s_w


def update_range_torch(buf: torch.Tensor, m: torch.Tensor, momentum: float) -> None:
    """A range record (0-d ``buf``) updated in place with a batch's range ``m``: its EMA,
    ``buf + momentum * (m - buf)``, or ``m`` itself where nothing was recorded yet (``buf == 0``:
    an EMA from 0 would under-estimate for ~1/momentum steps)."""
    buf.copy_(torch.where(buf > 0, buf + momentum * (m - buf), m))


def flipped_transposed_torch(w_q: torch.Tensor, groups: int) -> torch.Tensor:
    """OIHW ``[O, C/G, KH, KW]`` -> ``[C, O/G, KH, KW]`` flipped in both taps, per group: the
    weights of the conv that computes ``dx`` (any strides)."""
    o, cg, kh, kw = w_q.shape
    w_t = w_q.view(groups, o // groups, cg, kh, kw).transpose(1, 2).reshape(groups * cg, o // groups, kh, kw)
    return w_t.flip(2, 3)


TORCH_ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "quantize": quantize_torch, "int8_conv_dequantized": int8_conv_dequantized_torch,
    "relu_bits": relu_bits_torch, "relu_with_bits": relu_with_bits_torch, "mask": mask_torch,
    "grad_stats": grad_stats_torch,
    "quantize_grad": quantize_grad_torch, "scale_sums": scale_sums_torch, "flip_transpose": flipped_transposed_torch,
    "conv_scales": conv_scales_torch, "update_range": update_range_torch}
ELEMENTWISE_KERNELS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {}


def _elementwise(device_type: str, name: str, default: Callable | None = None) -> Callable[..., torch.Tensor]:
    """``device_type``'s kernel ``name``, else ``default`` (else ``TORCH_ELEMENTWISE[name]``)."""
    _load_lazy_kernels(device_type)
    return ELEMENTWISE_KERNELS.get(device_type, {}).get(name, default or TORCH_ELEMENTWISE[name])


def update_range(buf: torch.Tensor, m: torch.Tensor, momentum: float) -> None:
    """The dispatch point of :func:`update_range_torch` (on CUDA one kernel for its six launches)."""
    _elementwise(buf.device.type, "update_range")(buf, m, momentum)


def _quantize(x: torch.Tensor, scale: torch.Tensor, mult: torch.Tensor | None = None) -> torch.Tensor:
    """The dispatch point of :func:`quantize_torch` (contiguous float32 NCHW ``x``)."""
    return _elementwise(x.device.type, "quantize")(x, scale, mult)


def _quantize_weight(w: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight`, its rounding through the device's quantizing kernel (the output
    channels as the channel axis of a ``[1, O, I, KH*KW]`` view): the same bits in 4 launches
    instead of 9, twice a layer a step.  ``scales``: :func:`weight_scales` of this very ``w``,
    computed before (backward passes the forward's: no second reduction over the weight)."""
    scales = weight_scales(w) if scales is None else scales
    q = _quantize(w.detach().to(torch.float32).reshape(1, w.shape[0], w.shape[1], -1), scales)   # a 4-d view
    return q.view(w.shape), scales


def _int8_conv_dequantized(x_q: torch.Tensor, w_q: torch.Tensor, stride, padding: Padding4, dilation, groups: int,
                           scale: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False,
                           note_range: bool = True, addend: torch.Tensor | None = None) -> torch.Tensor:
    """The dispatch point of :func:`int8_conv_dequantized_torch`.  ``w_q`` keeps its strides: the
    kernels pack it from any (dx's flipped weight is a ``[C, KH, KW, O]`` tensor seen as OIHW,
    which the tensor cores' pack reads as it is).  ``note_range=False`` where nothing reads the
    output's range (an input gradient)."""
    return _elementwise(x_q.device.type, "int8_conv_dequantized")(
        x_q.contiguous(), w_q, tuple(stride), tuple(padding), tuple(dilation), groups, scale, bias, relu, note_range,
        None if addend is None else addend.to(torch.float32).contiguous())


def _relu_bits(y: torch.Tensor) -> torch.Tensor:
    """The dispatch point of :func:`relu_bits_torch`."""
    return _elementwise(y.device.type, "relu_bits")(y)


def _relu_with_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch point of :func:`relu_with_bits_torch` (contiguous ``x``)."""
    return _elementwise(x.device.type, "relu_with_bits")(x)


def _mask(g: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The dispatch point of :func:`mask_torch` (contiguous float32 ``g``)."""
    return _elementwise(g.device.type, "mask")(g, bits)


def _grad_stats(g: torch.Tensor, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch point of :func:`grad_stats_torch` (contiguous float32 NCHW ``g``)."""
    return _elementwise(g.device.type, "grad_stats")(g, bits)


def _quantize_grad(g: torch.Tensor, bits: torch.Tensor | None, s_dx, mult, s_dw):
    """The dispatch point of :func:`quantize_grad_torch` (contiguous float32 NCHW ``g``)."""
    return _elementwise(g.device.type, "quantize_grad")(g, bits, s_dx, mult, s_dw)


def conv_input_grad_torch(grad: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_shape: Sequence[int],
                          stride, padding: Padding4, dilation, groups: int) -> torch.Tensor:
    """``dx = conv_transpose(grad, w_q * w_scale)`` for an input of ``input_shape``, by PyTorch (float32)."""
    w_deq = w_q.to(torch.float32) * w_scale.view(-1, 1, 1, 1)
    if _is_symmetric(padding):
        return torch.nn.grad.conv2d_input(input_shape, w_deq, grad, stride, (padding[0], padding[1]), dilation, groups)
    top, left, bottom, right = padding
    n, c, h, w = input_shape
    padded = (n, c, h + top + bottom, w + left + right)
    dx = torch.nn.grad.conv2d_input(padded, w_deq, grad, stride, 0, dilation, groups)
    return dx[:, :, top:top + h, left:left + w]


def conv_weight_grad_torch(x_q: torch.Tensor, x_scale: torch.Tensor, grad: torch.Tensor, weight_shape: Sequence[int],
                           stride, padding: Padding4, dilation, groups: int) -> torch.Tensor:
    """``dw = correlate(grad, x_q * x_scale)``: the weight gradient from the dequantized int8 input, by PyTorch."""
    x_deq = x_q.to(torch.float32) * x_scale
    if _is_symmetric(padding):
        pad = (padding[0], padding[1])
    else:
        x_deq, pad = _pad(x_deq, padding), (0, 0)
    return torch.nn.grad.conv2d_weight(x_deq, weight_shape, grad, stride, pad, dilation, groups)


def _grad_kernels(device_type: str):
    _load_lazy_kernels(device_type)
    return CONV_GRAD_KERNELS.get(device_type, (conv_input_grad_torch, conv_weight_grad_torch))


def _conv_input_grad(grad: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_shape: Sequence[int],
                     stride, padding: Padding4, dilation, groups: int) -> torch.Tensor:
    """The dispatch point of ``dx`` (float32 NCHW) from the float32 gradient and the int8 weights."""
    return _grad_kernels(grad.device.type)[0](grad, w_q, w_scale, input_shape, stride, padding, dilation, groups)


INPUT_GRADS = ("float32", "int8")  # how dx and dw are computed: _conv_input_grad_int8, _conv_weight_grad_int8


def transposed_padding(kernel: Sequence[int], padding: Padding4, dilation, stride=(1, 1),
                       input_size: Sequence[int] | None = None) -> Padding4 | None:
    """The padding of the stride-1 conv that computes a conv's ``dx``: the gradient (its rows and
    columns spread ``stride`` apart, zeros between: :func:`_spread`) convolved with the flipped,
    transposed weights.  ``d * (k - 1) - p`` per side, plus on the bottom / right the rows and
    columns of the padded input that a stride leaves unread (``input_size`` (H, W) tells them;
    needed for a stride above 1).  None where a side would be negative (a conv padded more than
    its kernel reaches)."""
    (kh, kw), (dh, dw), (sh, sw) = tuple(kernel), tuple(dilation), tuple(stride)
    top, left, bottom, right = padding
    rest_h = rest_w = 0
    if (sh, sw) != (1, 1):
        h, w = input_size
        rest_h = (h + top + bottom - dh * (kh - 1) - 1) % sh
        rest_w = (w + left + right - dw * (kw - 1) - 1) % sw
    pads = (dh * (kh - 1) - top, dw * (kw - 1) - left, dh * (kh - 1) - bottom + rest_h,
            dw * (kw - 1) - right + rest_w)
    return pads if min(pads) >= 0 else None


def _spread(g: torch.Tensor, stride) -> torch.Tensor:
    """``g`` [N, O, OH, OW] with ``stride - 1`` zero rows / columns between its rows / columns:
    ``[N, O, (OH - 1) * sh + 1, (OW - 1) * sw + 1]`` (a strided conv's gradient as a stride-1 one's)."""
    sh, sw = stride
    if (sh, sw) == (1, 1):
        return g
    n, o, oh, ow = g.shape
    out = torch.zeros((n, o, (oh - 1) * sh + 1, (ow - 1) * sw + 1), dtype=g.dtype, device=g.device)
    out[:, :, ::sh, ::sw] = g
    return out


def _flipped_transposed(w_q: torch.Tensor, groups: int) -> torch.Tensor:
    """The dispatch point of :func:`flipped_transposed_torch` (on CUDA one transposing kernel,
    ``elementwise.flip_transpose``, where torch's flip and the packing copy after it read a byte a
    sector)."""
    return _elementwise(w_q.device.type, "flip_transpose")(w_q, groups)


def _grad_scales(amax: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both int8 gradients' scales from ``amax = max|g[o]|``: ``(s_dx, s_dw, x_scale * s_dw)``
    (:func:`input_grad_scale`, :func:`weight_grad_scales` and ``dw``'s scale), the last three
    through ``conv_scales`` (one kernel on CUDA; ``MIN_INPUT_SCALE == MIN_WEIGHT_SCALE``)."""
    return _elementwise(amax.device.type, "conv_scales")((amax * w_scale).max(), amax, x_scale)


def input_grad_scale(amax: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The one scale of the int8 input gradient's operand ``g * s_w[o]`` from ``amax = max|g[o]|``
    (:func:`_conv_input_grad_int8`)."""
    return input_scale((amax * w_scale).max())


def weight_grad_scales(amax: torch.Tensor) -> torch.Tensor:
    """The per-channel scales of the int8 weight gradient's operand from ``amax = max|g[o]|``
    (:func:`_conv_weight_grad_int8`)."""
    return scale_of(amax)


def _conv_input_grad_int8(g_q: torch.Tensor, s_g: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          input_shape: Sequence[int], stride, padding: Padding4, dilation, groups: int,
                          addend: torch.Tensor | None = None) -> torch.Tensor:
    """``dx`` from an int8 gradient (``input_grad="int8"``), float32 NCHW.

    The weight scale is folded into the gradient, ``g' = g * s_w[o]`` (it sits on dx's reduction
    axis, so it cannot be applied after it), ``g'`` is quantized to int8 per tensor (its max /
    127, rounded to nearest: ``g_q`` with the scale ``s_g`` of :func:`input_grad_scale`), and
    ``dx = s_g * sum_o g_q[o] * w_q[o]``: that sum is itself an int8 conv, stride 1, of ``g_q``
    (a strided conv's spread ``stride`` apart, zeros between) with the flipped, transposed
    weights, per group, exact in int32 on whatever kernel computes the forward (on CUDA the int8
    tensor cores from 16 channels).  A conv padded more than its kernel reaches runs the float
    gradient kernel on the dequantized ``g_q * s_g``: the same values up to float32 rounding.

    ``max|g'|`` is ``max_o(amax[o] * s_w[o])`` exactly (a float32 product is monotonic in each
    factor), so ``g'`` is never written out: the quantizing kernel multiplies as it reads
    (:func:`_quantize_grad`, which makes ``g_q`` with the weight gradient's operand in one pass).

    The small VGG's QAT on digits reaches the float model's accuracy with it (figures per seed in
    docs/performance.md, "Training").
    """
    pads = transposed_padding(w_q.shape[2:], padding, dilation, stride, input_shape[2:])
    if pads is not None:
        return _int8_conv_dequantized(_spread(g_q, stride), _flipped_transposed(w_q, groups), (1, 1), pads,
                                      tuple(dilation), groups, s_g, note_range=False, addend=addend)
    dx = _conv_input_grad(g_q.to(torch.float32).mul_(s_g), w_q, torch.ones_like(w_scale), input_shape, stride,
                          padding, dilation, groups)
    return dx if addend is None else dx.add_(addend)


def _conv_weight_grad(x_q: torch.Tensor, x_scale: torch.Tensor, grad: torch.Tensor, weight_shape: Sequence[int],
                      stride, padding: Padding4, dilation, groups: int) -> torch.Tensor:
    """The dispatch point of ``dw`` (float32 OIHW) from the int8 input, its scale and the gradient."""
    return _grad_kernels(grad.device.type)[1](x_q, x_scale, grad, weight_shape, stride, padding, dilation, groups)


def int8_weight_grad_cpu(x_q: torch.Tensor, g_q: torch.Tensor, weight_shape: Sequence[int], stride,
                         padding: Padding4, dilation, groups: int) -> torch.Tensor | None:
    """Exact ``sum_{n, y, x} g_q * x_q`` (the int8 weight gradient's sums, float64 OIHW) through
    PyTorch's float64 conv gradient: every partial sum is an integer below 2**53, so exact in any
    order (as :func:`int8_conv_cpu`).  The reference the int8 tensor-core kernel matches."""
    x = x_q.to(_EXACT_FLOAT)
    if _is_symmetric(padding):
        pad = (padding[0], padding[1])
    else:
        x, pad = _pad(x, padding), (0, 0)
    return torch.nn.grad.conv2d_weight(x, weight_shape, g_q.to(_EXACT_FLOAT), stride, pad, dilation, groups)


# Device type -> the int8 weight gradient's exact sums, int8_weight_grad_cpu's signature (any
# float or integer dtype that holds them exactly, any strides), or None for a conv its kernels cannot take.
INT8_WEIGHT_GRAD_KERNELS: dict[str, Callable[..., torch.Tensor | None]] = {"cpu": int8_weight_grad_cpu}
_FALLBACK_NOTED: set = set()


def _conv_weight_grad_int8(x_q: torch.Tensor, x_scale: torch.Tensor, g_q: torch.Tensor, s_g: torch.Tensor,
                           weight_shape: Sequence[int], stride, padding: Padding4, dilation, groups: int,
                           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dw`` from an int8 gradient (``weight_grad="int8"``), float32 OIHW.

    The gradient is quantized per output channel, ``g ~ g_q[o] * s_g[o]`` (``s_g`` of
    :func:`weight_grad_scales`; ``o`` is ``dw``'s own axis, so each channel keeps its own range at
    no cost), and ``dw = s_x * s_g[o] * sum g_q x_q``: an exact int32 / int64 sum, on CUDA the int8
    tensor cores (a split-K conv, ``schedules/training/grad_weight_mma.py``), so bit-equal to the
    CPU's.  A conv those kernels cannot take (groups, a batch under 16) runs the float kernel on
    the dequantized ``g_q * s_g``, the same values up to float32 rounding, with a one-line note
    the first time.  ``scale``: ``x_scale * s_g``, where the caller has it (:func:`_grad_scales`).
    """
    _load_lazy_kernels(g_q.device.type)
    kernel = INT8_WEIGHT_GRAD_KERNELS.get(g_q.device.type)
    acc = None if kernel is None else kernel(x_q, g_q, weight_shape, stride, padding, dilation, groups)
    if acc is None:
        key = (g_q.device.type, tuple(x_q.shape), tuple(weight_shape), stride, padding, dilation, groups)
        if key not in _FALLBACK_NOTED:
            _FALLBACK_NOTED.add(key)
            warnings.warn(f"weight_grad='int8': no int8 weight-gradient kernel takes the conv of input "
                          f"{tuple(x_q.shape)}, weight {tuple(weight_shape)}, groups {groups} on {g_q.device.type}; "
                          "it runs the float32 kernel on the quantized gradient")
        g_deq = g_q.to(torch.float32).mul_(s_g.view(1, -1, 1, 1))
        return _conv_weight_grad(x_q, x_scale, g_deq, weight_shape, stride, padding, dilation, groups)
    scale = x_scale * s_g if scale is None else scale
    if acc.is_floating_point():     # float64 sums: rounded to float32 first, then scaled (two roundings)
        return torch.empty(acc.shape, dtype=torch.float32, device=acc.device).copy_(acc).mul_(scale.view(-1, 1, 1, 1))
    return _elementwise(acc.device.type, "scale_sums")(acc, scale)


# ----------------------------------------------------------------------------- autograd

def _forward(x, weight, bias, amax, stride, padding, dilation, groups, relu, keep_relu_mask, keep_clip_mask):
    """The forward computation; returns ``(y, tensors backward needs)``."""
    # Compact NCHW for the kernels (TVM's DLPack import rejects channels_last, transposed
    # and sliced views); the copy is transient, only its int8 version is kept.
    x = x.contiguous()
    # the scales in one kernel on CUDA (five one-element launches in torch)
    x_scale, w_scale, scale = _elementwise(x.device.type, "conv_scales")(amax, weight_amax(weight))
    x_q = _quantize(x, x_scale)
    w_q, _ = _quantize_weight(weight, w_scale)
    # Dequantized once per accumulator (== dequantizing every product, the sum is exact).
    y = _int8_conv_dequantized(x_q, w_q, stride, padding, dilation, groups, scale,
                               None if bias is None else bias.detach().to(torch.float32), relu)
    empty = torch.empty(0, dtype=torch.uint8, device=x.device)
    relu_bits = _relu_bits(y) if keep_relu_mask else empty
    # The clip mask unless the caller vouched that amax is the batch's own max (training: nothing
    # clips).  Asking the tensors whether anything clipped would be a device -> host sync each
    # layer, and a training step with one cannot be captured in a CUDA graph.
    clip_bits = pack_bits(x.abs() <= amax) if keep_clip_mask else empty
    # The float weight, not w_q: see "ctx keeps" in the module docstring.
    return y.to(x.dtype), (x_q, weight, x_scale, w_scale, relu_bits, clip_bits)


class QuantizedConv2dFunction(torch.autograd.Function):
    """int8 conv (+ bias, + ReLU) with the straight-through estimator; see the module docstring.

    ``apply(x, weight, bias, amax, stride, padding, dilation, groups, relu, amax_is_batch_max,
    input_grad, weight_grad, passthrough)``: ``bias`` may be None; ``amax`` is a 0-d tensor (no
    gradient); ``padding`` is (top, left, bottom, right); ``amax_is_batch_max``, ``input_grad``,
    ``weight_grad``, ``passthrough``: see :func:`quantized_conv2d`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, amax, stride, padding, dilation, groups, relu, amax_is_batch_max,
                input_grad, weight_grad, passthrough=False):
        y, saved = _forward(x, weight, bias, amax, stride, padding, dilation, groups, relu, keep_relu_mask=relu,
                            keep_clip_mask=ctx.needs_input_grad[0] and not amax_is_batch_max)
        ctx.save_for_backward(*saved)
        ctx.conf = (stride, padding, dilation, groups, relu)
        ctx.input_grad, ctx.weight_grad = input_grad, weight_grad
        ctx.shapes = (tuple(x.shape), tuple(weight.shape), tuple(y.shape))
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if not passthrough:
            return y
        xi = x.view_as(x)
        if not ctx.needs_input_grad[0]:
            ctx.mark_non_differentiable(xi)
        return y, xi

    @staticmethod
    def backward(ctx, grad_y, grad_passthrough=None):
        x_q, weight, x_scale, w_scale_fw, relu_bits, clip_bits = ctx.saved_tensors
        stride, padding, dilation, groups, relu = ctx.conf
        x_shape, w_shape, y_shape = ctx.shapes
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        # Compact for the same reason as the input (a permuted loss gives a strided gradient).
        g = grad_y.to(torch.float32).contiguous()
        bits = relu_bits if relu else None      # g is read through the ReLU's mask, never masked in memory
        int8_dx = ctx.needs_input_grad[0] and ctx.input_grad == "int8"
        int8_dw = ctx.needs_input_grad[1] and ctx.weight_grad == "int8"
        w_q = w_scale = g_sum = dw_scale = None
        if ctx.needs_input_grad[0]:
            w_q, w_scale = _quantize_weight(weight, w_scale_fw)  # bit-identical to the forward's
        if int8_dx or int8_dw:
            # one pass for max|g| per channel (both int8 operands' ranges) and the bias gradient,
            # one for both int8 operands
            amax, g_sum = _grad_stats(g, bits)
            if int8_dx and int8_dw:     # one kernel on CUDA for the three scales
                s_dx, s_dw, dw_scale = _grad_scales(amax, w_scale, x_scale)
            else:
                s_dx = input_grad_scale(amax, w_scale) if int8_dx else None
                s_dw = weight_grad_scales(amax) if int8_dw else None
            q_dx, q_dw = _quantize_grad(g, bits, s_dx, w_scale if int8_dx else None, s_dw)
        masked = []     # the masked float gradient, made once if a float kernel needs it

        def g_masked() -> torch.Tensor:
            if not masked:
                masked.append(g if bits is None else _mask(g, bits))
            return masked[0]

        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # the passthrough's gradient joins dx in dx's own dequantizing kernel where nothing
            # comes between them (no clip mask, float32 x): the same bits as autograd's sum
            join = grad_passthrough is not None and int8_dx and not clip_bits.numel() and x_dtype == torch.float32
            if int8_dx:
                dx = _conv_input_grad_int8(q_dx, s_dx, w_q, w_scale, x_shape, stride, padding, dilation, groups,
                                           addend=grad_passthrough if join else None)
            else:
                dx = _conv_input_grad(g_masked(), w_q, w_scale, x_shape, stride, padding, dilation, groups)
            if clip_bits.numel():
                dx = dx.masked_fill(~unpack_bits(clip_bits, x_shape), 0.0)
            dx = dx.to(x_dtype)
            if grad_passthrough is not None and not join:
                dx = dx + grad_passthrough
        if ctx.needs_input_grad[1]:
            if int8_dw:
                dw = _conv_weight_grad_int8(x_q, x_scale, q_dw, s_dw, w_shape, stride, padding, dilation, groups,
                                            dw_scale)
            else:
                dw = _conv_weight_grad(x_q, x_scale, g_masked(), w_shape, stride, padding, dilation, groups)
            dw = dw.to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = (g_masked().sum(dim=(0, 2, 3)) if g_sum is None else g_sum).to(b_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return (int(v), int(v))
    if len(v) != 2:
        raise ValueError(f"expected an int or a pair, got {tuple(v)!r}")
    return (int(v[0]), int(v[1]))


def padding4(padding, kernel_size, dilation) -> Padding4:
    """Normalize ``nn.Conv2d`` padding (int, (h, w), ``'valid'``, ``'same'``) or this project's
    (top, left, bottom, right) to (top, left, bottom, right).

    ``'same'`` splits an odd total as PyTorch does: the extra row/column goes to the bottom/right.
    """
    kh, kw = _pair(kernel_size)
    dh, dw = _pair(dilation)
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        th, tw = dh * (kh - 1), dw * (kw - 1)
        return (th // 2, tw // 2, th - th // 2, tw - tw // 2)
    if isinstance(padding, str):
        raise ValueError(f"padding must be an int, a pair, 'valid' or 'same'; got {padding!r}")
    if not isinstance(padding, int) and len(padding) == 4:
        return tuple(int(p) for p in padding)
    if not isinstance(padding, int) and len(padding) != 2:
        raise ValueError(f"padding must be an int, (h, w), (top, left, bottom, right), 'valid' or 'same'; "
                         f"got {tuple(padding)!r}")
    ph, pw = _pair(padding)
    return (ph, pw, ph, pw)


def check_input_grad(input_grad: str, name: str = "input_grad") -> str:
    """``input_grad`` (or the ``name`` option: ``weight_grad``) if it is one of :data:`INPUT_GRADS`,
    else a ValueError naming them."""
    if input_grad not in INPUT_GRADS:
        raise ValueError(f"{name} must be one of {INPUT_GRADS}, got {input_grad!r}")
    return input_grad


def quantized_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, amax: torch.Tensor,
                     stride=1, padding=0, dilation=1, groups: int = 1, relu: bool = False, *,
                     amax_is_batch_max: bool = False, input_grad: str = "float32",
                     weight_grad: str = "float32", passthrough: bool = False):
    """int8 conv2d (+ bias, + optional fused ReLU) with STE gradients, ``F.conv2d``'s arguments.

    Args:
        x: float NCHW input (any strides).
        weight: float OIHW weight; quantized per output channel on every call.
        bias: float ``(O,)`` or None.
        amax: 0-d tensor, the input's clipping threshold (``batch_amax(x)`` clips nothing).
        stride, dilation: int or (h, w).
        padding: int, (h, w), ``'valid'`` or ``'same'``.
        groups: conv groups.
        relu: apply ReLU (its mask is kept as bits, not the float output).
        amax_is_batch_max: the caller vouches that ``amax`` is ``batch_amax(x)`` (the layers pass
            it in training), so nothing clips and backward keeps no clip mask.  Otherwise the
            clip mask (1 bit per input element) is kept whenever ``x`` needs a gradient, without
            first looking whether anything clipped: that look is a device -> host sync.
        input_grad: ``"float32"`` (dx from the float gradient) or ``"int8"`` (from the gradient
            quantized to int8, on the int8 conv kernels: :func:`_conv_input_grad_int8`).
        weight_grad: ``"float32"`` (dw from the float gradient) or ``"int8"`` (from the gradient
            quantized to int8 per channel, exact int sums: :func:`_conv_weight_grad_int8`).
        passthrough: also return ``x`` itself (a view), whose gradient backward adds to dx in dx's
            own dequantizing kernel: a residual block's identity taken from its first conv, instead
            of autograd adding the two gradients in a pass of their own (ResNet-50 b128: 16 adds
            of whole activations, ~2 ms a step).  The view carries ``x``'s noted range; like any
            output of a custom autograd op that is a view of its input, it cannot be changed in
            place.  On CUDA the sum's float32 rounding is ``__fadd_rn``'s, which flushes a
            subnormal result (below 1.2e-38) to 0.

    Returns:
        float NCHW output in ``x``'s dtype; with ``passthrough``, ``(output, x)``.

    Example:
        >>> x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
        >>> quantized_conv2d(x, w, None, batch_amax(x), padding=1, relu=True).shape
        torch.Size([2, 4, 8, 8])
    """
    if x.dim() != 4:
        raise ValueError(f"quantized_conv2d expects an NCHW input, got shape {tuple(x.shape)}")
    check_input_grad(input_grad)
    check_input_grad(weight_grad, "weight_grad")
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        # Inference: no graph, so no masks to build (ctx.needs_input_grad ignores no_grad mode).
        y = _forward(x, weight, bias, amax, _pair(stride), padding4(padding, weight.shape[2:], dilation),
                     _pair(dilation), int(groups), bool(relu), False, False)[0]
        return (y, x) if passthrough else y
    out = QuantizedConv2dFunction.apply(x, weight, bias, amax, _pair(stride),
                                        padding4(padding, weight.shape[2:], dilation), _pair(dilation),
                                        int(groups), bool(relu), bool(amax_is_batch_max), input_grad, weight_grad,
                                        bool(passthrough))
    if passthrough and (known := known_amax(x)) is not None:
        note_amax(out[1], known)    # the view is another tensor object: the next conv finds x's range
    return out


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, amax: torch.Tensor,
                     relu: bool = False, *, amax_is_batch_max: bool = False, input_grad: str = "float32",
                     weight_grad: str = "float32") -> torch.Tensor:
    """int8 linear layer ``x @ w.T + b`` (``F.linear``'s arguments), as a 1x1 conv on a 1x1 image.

    Args:
        x: float ``(*, K)``.
        weight: float ``(O, K)``, quantized per output channel.
        bias: float ``(O,)`` or None.
        amax: 0-d tensor, the input's clipping threshold.
        relu: apply ReLU.
        amax_is_batch_max, input_grad, weight_grad: as :func:`quantized_conv2d`.

    Returns:
        float ``(*, O)``.
    """
    lead = x.shape[:-1]
    x4 = x.reshape(-1, x.shape[-1], 1, 1)
    y = quantized_conv2d(x4, weight.view(weight.shape[0], weight.shape[1], 1, 1), bias, amax, relu=relu,
                         amax_is_batch_max=amax_is_batch_max, input_grad=input_grad, weight_grad=weight_grad)
    return y.reshape(*lead, weight.shape[0])
