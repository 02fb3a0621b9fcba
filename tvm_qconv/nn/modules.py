"""int8 quantization-aware layers and their float twins, with ``nn.Conv2d`` / ``nn.Linear``'s signatures.

* ``QuantizedConv2d``, ``QuantizedConv2dReLU``, ``QuantizedLinear``: int8 forward, STE backward
  (:mod:`tvm_qconv.nn.functional`).
* ``TorchConv2d``, ``TorchConv2dReLU``, ``TorchLinear``: the same layers in float, for comparison.

Every one of them subclasses the PyTorch layer (same arguments, same initialization, same
parameter names ``weight`` / ``bias``) and keeps two range buffers, updated in training as an
exponential moving average (EMA) of each batch's max:

* ``input_amax``: max|input|.  The quantized layers quantize with the batch's own max in
  training (nothing clips) and with this *learned scale* in eval; it is saved in checkpoints
  and becomes the compile step's calibration range ``f"{layer}.in0"``.
* ``output_amax``: max|output| (after the ReLU for the fused layers): ``f"{layer}.out"``.

A value of 0 means "not observed yet"; an eval pass before any training then quantizes with
the batch's own max.  The float twins keep the same buffers (used for nothing but the record),
so a model's quantized and float versions have identical state dicts; a twin that stands for plain
float training (a speed baseline) stops recording with :func:`set_range_records` (two reductions a
layer a step that ``nn.Conv2d`` does not do).  A plain float model
(``nn.Conv2d``) lacks the two buffers: load it with :func:`load_float_state_dict`, and go back
with :func:`to_float_state_dict`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import (batch_amax, check_input_grad, known_amax, note_amax, quantized_conv2d, quantized_linear,
                         update_range)

AMAX_BUFFERS = {"input_amax": "in0", "output_amax": "out"}  # buffer -> calibration-point suffix
DEFAULT_AMAX_MOMENTUM = 0.1
# How a training step picks the range it quantizes its input with: "batch", the batch's own max
# (nothing clips); "delayed", the range learned before this batch (input_amax; the batch's own on
# the first), so values beyond it clip and their gradient is 0: what a layer handed int8 by the
# one before would have to use (docs/history.md, issue 35's next steps).
INPUT_RANGES = ("batch", "delayed")


class _RangeTracker:
    """Mixin: the ``input_amax`` / ``output_amax`` EMA buffers shared by every layer here."""

    def _init_ranges(self, amax_momentum: float) -> None:
        if not 0.0 < amax_momentum <= 1.0:
            raise ValueError(f"amax_momentum must be in (0, 1], got {amax_momentum}")
        self.amax_momentum = float(amax_momentum)
        self.register_buffer("input_amax", torch.zeros(()))
        self.register_buffer("output_amax", torch.zeros(()))

    @torch.no_grad()
    def _observe(self, buf: torch.Tensor, t: torch.Tensor, made_here: bool = False) -> torch.Tensor:
        """Fold this batch's max|t| into ``buf``; return the batch max.  Training only.
        ``made_here``: ``t`` is this layer's output, whose max the next layer reuses (``note_amax``)."""
        m = known_amax(t)     # the range a layer noted for its output: read, not copied
        if m is None:
            m = batch_amax(t)
            if made_here:
                note_amax(t, m)
        m = m.to(buf.device)
        update_range(buf, m, self.amax_momentum)     # on CUDA one kernel
        return m

    input_range = "batch"   # INPUT_RANGES; set_input_range sets it on every layer of a model
    record_ranges = True    # the float twins' EMA records (set_range_records); the int8 layers always observe

    def _input_clip(self, x: torch.Tensor) -> torch.Tensor:
        """The amax to quantize ``x`` with: in training the batch's (``input_range`` "batch") or
        the one learned before this batch ("delayed"), in eval the learned one; the batch's where
        none was learned yet.  Chosen on the device: no host sync."""
        if self.training:
            learned = self.input_amax.clone() if self.input_range == "delayed" else None
            m = self._observe(self.input_amax, x)
            return m if learned is None else torch.where(learned > 0, learned, m)
        return torch.where(self.input_amax > 0, self.input_amax, batch_amax(x).to(self.input_amax.device))

    @property
    def _amax_is_batch_max(self) -> bool:
        return self.training and self.input_range == "batch"

    def extra_repr(self) -> str:
        grads = "".join(f", {name}={getattr(self, name)!r}" for name in ("input_grad", "weight_grad")
                        if getattr(self, name, "float32") != "float32")
        return super().extra_repr() + f", amax_momentum={self.amax_momentum}" + grads


def _check_padding_mode(padding_mode: str) -> None:
    if padding_mode != "zeros":
        # Zero point 0 makes zero padding exact in int8; other modes are not implemented.
        raise ValueError(f"quantized convs support padding_mode='zeros' only, got {padding_mode!r}")


class QuantizedConv2d(_RangeTracker, nn.Conv2d):
    """int8 ``nn.Conv2d``: per-tensor int8 input, per-channel int8 weight, int32 accumulation.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
        padding_mode, device, dtype: as ``nn.Conv2d`` (``padding_mode='zeros'`` only).
        amax_momentum: EMA weight of each training batch in ``input_amax`` / ``output_amax``.
        input_grad: ``"float32"``, or ``"int8"``: the input gradient from the output gradient
            quantized to int8, on the int8 conv kernels (``functional._conv_input_grad_int8``).
        weight_grad: ``"float32"``, or ``"int8"``: the weight gradient from the output gradient
            quantized to int8 per channel, exact int sums (on CUDA the int8 tensor cores:
            ``functional._conv_weight_grad_int8``).

    Example:
        >>> conv = QuantizedConv2d(3, 16, 3, padding=1)
        >>> conv(torch.randn(2, 3, 8, 8)).sum().backward()
    """

    relu = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None,
                 amax_momentum: float = DEFAULT_AMAX_MOMENTUM, input_grad: str = "float32",
                 weight_grad: str = "float32"):
        _check_padding_mode(padding_mode)
        nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                           bias, padding_mode, device, dtype)
        self._init_ranges(amax_momentum)
        self.input_grad = check_input_grad(input_grad)
        self.weight_grad = check_input_grad(weight_grad, "weight_grad")

    def forward(self, x: torch.Tensor, passthrough: bool = False):
        """``passthrough``: ``(y, x)``, ``x``'s gradient joining the conv's input gradient in one
        kernel (``functional.quantized_conv2d``): a residual block's identity taken from here."""
        out = quantized_conv2d(x, self.weight, self.bias, self._input_clip(x), self.stride, self.padding,
                               self.dilation, self.groups, relu=self.relu, amax_is_batch_max=self._amax_is_batch_max,
                               input_grad=self.input_grad, weight_grad=self.weight_grad, passthrough=passthrough)
        if self.training:
            self._observe(self.output_amax, out[0] if passthrough else out, made_here=True)
        return out


class QuantizedConv2dReLU(QuantizedConv2d):
    """``QuantizedConv2d`` with a fused ReLU: backward keeps a 1-bit mask, not the float output."""

    relu = True


class TorchConv2d(_RangeTracker, nn.Conv2d):
    """Float twin of ``QuantizedConv2d``: ``nn.Conv2d`` plus the range buffers."""

    relu = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None,
                 amax_momentum: float = DEFAULT_AMAX_MOMENTUM):
        nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                           bias, padding_mode, device, dtype)
        self._init_ranges(amax_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record = self.training and self.record_ranges
        if record:
            self._observe(self.input_amax, x)
        y = nn.Conv2d.forward(self, x)
        if self.relu:
            y = F.relu(y)
        if record:
            self._observe(self.output_amax, y, made_here=True)
        return y


class TorchConv2dReLU(TorchConv2d):
    """Float twin of ``QuantizedConv2dReLU``: ``nn.Conv2d`` then ``F.relu``."""

    relu = True


class QuantizedLinear(_RangeTracker, nn.Linear):
    """int8 ``nn.Linear`` (per-tensor int8 input, per-channel int8 weight), through the conv path.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        amax_momentum: EMA weight of each training batch in the range buffers.
        input_grad, weight_grad: as ``QuantizedConv2d``.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 amax_momentum: float = DEFAULT_AMAX_MOMENTUM, input_grad: str = "float32",
                 weight_grad: str = "float32"):
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self._init_ranges(amax_momentum)
        self.input_grad = check_input_grad(input_grad)
        self.weight_grad = check_input_grad(weight_grad, "weight_grad")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quantized_linear(x, self.weight, self.bias, self._input_clip(x), amax_is_batch_max=self._amax_is_batch_max,
                             input_grad=self.input_grad, weight_grad=self.weight_grad)
        if self.training:
            self._observe(self.output_amax, y, made_here=True)
        return y


class TorchLinear(_RangeTracker, nn.Linear):
    """Float twin of ``QuantizedLinear``: ``nn.Linear`` plus the range buffers."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 amax_momentum: float = DEFAULT_AMAX_MOMENTUM):
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self._init_ranges(amax_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record = self.training and self.record_ranges
        if record:
            self._observe(self.input_amax, x)
        y = nn.Linear.forward(self, x)
        if record:
            self._observe(self.output_amax, y, made_here=True)
        return y


QUANTIZED_LAYERS = (QuantizedConv2d, QuantizedLinear)
TRACKED_LAYERS = (QuantizedConv2d, QuantizedLinear, TorchConv2d, TorchLinear)


def learned_amax(model: nn.Module) -> dict[str, float]:
    """The learned ranges of every layer of this module, by calibration-point name.

    Args:
        model: a model built from this module's layers.

    Returns:
        ``{f"{name}.in0": input amax, f"{name}.out": output amax}`` for every tracked layer
        (``name`` is the module path, e.g. ``"features.0"``); 0.0 where nothing was observed.

    Example:
        >>> learned_amax(nn.Sequential(QuantizedConv2dReLU(3, 8, 3)))
        {'0.in0': 0.0, '0.out': 0.0}
    """
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TRACKED_LAYERS):
            for buf, suffix in AMAX_BUFFERS.items():
                out[f"{name}.{suffix}"] = float(getattr(m, buf))
    return out


def to_float_state_dict(state_dict: dict) -> dict:
    """Drop the range buffers, so that the state dict loads strictly into the float model.

    Args:
        state_dict: a state dict of a model built from this module's layers.

    Returns:
        A new dict without ``*.input_amax`` / ``*.output_amax`` (tensors shared, not copied).
    """
    return {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in AMAX_BUFFERS}


def load_float_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Load a float model's state dict (no range buffers) into a model built from these layers.

    Every key must match; only the range buffers may be missing (they keep their values,
    0 = not observed).  Equivalent to ``load_state_dict(sd, strict=False)`` plus that check.

    Raises:
        RuntimeError: unexpected keys, or missing keys other than the range buffers.
    """
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if k.rsplit(".", 1)[-1] not in AMAX_BUFFERS]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")


def set_range_records(model: nn.Module, on: bool) -> nn.Module:
    """Make every float twin of ``model`` record its ranges in training (``on``, the default) or
    not: off, a twin computes what ``nn.Conv2d`` / ``nn.Linear`` do and nothing more (the speed
    baseline of ``benchmarks/train_memory.py``).  The int8 layers always observe their input (it
    is their quantization range) and output.  Off, a twin's range buffers keep what they held (0:
    never observed), and so do its checkpoints.  Returns ``model``."""
    for m in model.modules():
        if isinstance(m, (TorchConv2d, TorchLinear)):
            m.record_ranges = bool(on)
    return model


def set_input_range(model: nn.Module, input_range: str) -> nn.Module:
    """Make every int8 layer of ``model`` pick its training range as ``input_range`` says
    (:data:`INPUT_RANGES`); returns ``model``."""
    if input_range not in INPUT_RANGES:
        raise ValueError(f"input_range must be one of {INPUT_RANGES}, got {input_range!r}")
    for m in model.modules():
        if isinstance(m, _RangeTracker):
            m.input_range = input_range
    return model
