"""The workloads: one frozen dataclass per op, what its kernel's compute needs.  One conv workload
for every conv kernel of the project (the compile path's fused int8 conv of any family, the
training path's int32 conv and both of its gradients), one per memory-bound op, and one per
conversion kernel (quantize, dequantize, relayout, a linear layer's input rows).

A workload is the layer in real units (channels before any padding to a layout's block), plus
what the epilogue does.  Kernels record it in their PrimFunc (``tvm_qconv.workload``) so the
tuner and the build report can name a kernel by its layer.
"""
from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

import numpy as np

from .requantize import QMIN, UNSIGNED_ZERO

# The epilogue's activation, as a clamp of the requantized int8 output (integer domain): ``none``
# is [-127, 127] (symmetric int8: ``requantize.QMIN``), ``relu`` is [0, 127], ``clip`` (ReLU6, hardtanh) is [act_min, act_max].
ACTIVATIONS = ("none", "relu", "clip")
OUT_DTYPES = ("int8", "int32")  # int8: requantized (bias, multiplier, activation); int32: the accumulator


def conv_output_size(size: int, kernel: int, stride: int, pad_before: int, pad_after: int, dilation: int) -> int:
    """Output length of a conv along one axis (PyTorch's formula, floor division)."""
    return (size + pad_before + pad_after - (kernel - 1) * dilation - 1) // stride + 1


@dataclass(frozen=True)
class ConvWorkload:
    """One conv layer.

    Attributes:
        batch, in_channels, height, width, out_channels: the layer in real units
            (``in_channels`` counts every group's channels, as ``nn.Conv2d`` does).
        kernel, stride, dilation: (h, w).
        padding: (top, left, bottom, right).
        groups: conv groups (``in_channels`` and ``out_channels`` divisible by it).
        activation: the epilogue's ``none`` / ``relu`` / ``clip`` (``out_dtype == "int8"``).
        act_min, act_max: the int8 clamp of ``clip`` (``relu``: 0, 127; ``none``: -127, 127).
        out_dtype: ``int8`` (the fused, requantized layer) or ``int32`` (the raw accumulator:
            the training path and the unfused benchmark).
        in_zero: the input's zero point: 0 (symmetric) or -128 (an unsigned input, 0..255
            stored minus 128; ``requantize.UNSIGNED_ZERO``).  The kernel's padding reads it (a
            padded tap is a real zero); the accumulator's ``-in_zero * sum(w)`` is the bias's.
            A family whose padding cannot be that value (wgmma: TMA's out-of-bounds fill is 0)
            adds the padding's share through a bias per border class (``border_bias.py``).
        table: the epilogue ends in a 256-entry table (the elementwise function after the conv:
            ``epilogue_table.py``); the kernel takes it as its last argument before the output.
            Left out of :meth:`to_dict` when False, so a kernel without one is recorded as before.
        residual: the epilogue ends in the residual add after the conv (``epilogue_residual.py``):
            the add's ``(zero_conv, zero_residual, zero_out, act_min, act_max)``; ``()``: none.
            The kernel takes the other addend after its input and the add's multipliers before
            its output.  Left out of :meth:`to_dict` when empty, as ``table``.
        norm: the epilogue ends in the LayerNorm over each pixel's channels after the conv
            (``tensorcore/depthwise_layer_norm.py``): ``(zero_out,)`` of the LayerNorm's output;
            ``()``: none.  The kernel takes the LayerNorm's gains, offsets and row constants
            before its output.  Left out of :meth:`to_dict` when empty.
        splits: the reduction split into this many equal slices, each slice's int32 sums stored
            on their own (``out_dtype == "int32"``, one group; the sum over slices is the
            caller's): split-K, for the long reductions of the training path's weight gradient
            (``schedules/training/grad_weight_mma.py``).  Left out of :meth:`to_dict` when 1.
    """

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int] = (3, 3)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (1, 1, 1, 1)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    activation: str = "relu"
    act_min: int = 0
    act_max: int = 127
    out_dtype: str = "int8"
    in_zero: int = 0
    table: bool = False
    residual: tuple = ()
    norm: tuple = ()
    splits: int = 1

    def __post_init__(self):
        # ValueError, not InputError: a workload is built by the passes and the training
        # wrapper from a model that PyTorch already validated, so a bad one is a bug here.
        for name in ("batch", "in_channels", "height", "width", "out_channels", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"ConvWorkload.{name} must be >= 1, got {getattr(self, name)}")
        for name, length, least in (("kernel", 2, 1), ("stride", 2, 1), ("dilation", 2, 1), ("padding", 4, 0)):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or len(value) != length:
                raise ValueError(f"ConvWorkload.{name} must be a tuple of {length} ints, got {value!r}")
            if min(value) < least:
                raise ValueError(f"ConvWorkload.{name} must be >= {least} in every entry, got {value}")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"ConvWorkload.groups={self.groups} must divide in_channels={self.in_channels} "
                             f"and out_channels={self.out_channels}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        expected = {"none": (QMIN, 127), "relu": (0, 127)}.get(self.activation)
        if expected is not None and (self.act_min, self.act_max) != expected:
            raise ValueError(f"activation {self.activation!r} clamps to {expected}, got ({self.act_min}, {self.act_max})")
        if not UNSIGNED_ZERO <= self.act_min <= self.act_max <= 127:
            raise ValueError(f"act_min/act_max must satisfy {UNSIGNED_ZERO} <= min <= max <= 127, got "
                             f"({self.act_min}, {self.act_max})")
        if self.in_zero not in (0, UNSIGNED_ZERO):
            raise ValueError(f"in_zero must be 0 or {UNSIGNED_ZERO}, got {self.in_zero}")
        if self.table and self.out_dtype != "int8":
            raise ValueError("a table epilogue needs the requantized int8 output (out_dtype='int8')")
        if self.residual:
            if len(self.residual) != 5 or self.out_dtype != "int8" or self.table:
                raise ValueError("a residual epilogue is (zero_conv, zero_residual, zero_out, act_min, act_max) "
                                 f"on the requantized int8 output, without a table; got {self.residual}")
            z_c, z_r, z_out, lo, hi = self.residual
            if not ({z_c, z_r, z_out} <= {0, UNSIGNED_ZERO} and UNSIGNED_ZERO <= lo <= hi <= 127):
                raise ValueError(f"residual epilogue zero points must be 0 or {UNSIGNED_ZERO} and its clamp "
                                 f"within int8, got {self.residual}")
        if self.norm and (len(self.norm) != 1 or self.norm[0] not in (0, UNSIGNED_ZERO) or self.out_dtype != "int8"
                          or self.table or self.residual):
            raise ValueError("a LayerNorm epilogue is (zero_out,), zero_out 0 or -128, on the requantized int8 "
                             f"output, without a table or a residual; got {self.norm}")
        if self.splits < 1 or (self.splits > 1 and (self.out_dtype != "int32" or self.groups != 1)):
            raise ValueError(f"splits={self.splits}: a split reduction stores int32 sums of one group "
                             f"(out_dtype='int32', groups=1), got out_dtype={self.out_dtype!r}, groups={self.groups}")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(f"conv output would be empty: {self}")

    @classmethod
    def with_activation(cls, activation: str, act_min: int = QMIN, act_max: int = 127, **fields) -> "ConvWorkload":
        """A workload whose clamp follows from ``activation`` (``clip`` takes ``act_min``/``act_max``)."""
        if activation == "none":
            act_min, act_max = QMIN, 127
        elif activation == "relu":
            act_min, act_max = 0, 127
        return cls(activation=activation, act_min=act_min, act_max=act_max, **fields)

    @property
    def out_height(self) -> int:
        return conv_output_size(self.height, self.kernel[0], self.stride[0], self.padding[0], self.padding[2],
                                self.dilation[0])

    @property
    def out_width(self) -> int:
        return conv_output_size(self.width, self.kernel[1], self.stride[1], self.padding[1], self.padding[3],
                                self.dilation[1])

    @property
    def group_in(self) -> int:
        return self.in_channels // self.groups

    @property
    def group_out(self) -> int:
        return self.out_channels // self.groups

    @property
    def is_depthwise(self) -> bool:
        """One input channel per group (``groups == in_channels``), any channel multiplier."""
        return self.groups > 1 and self.group_in == 1

    @property
    def ops(self) -> int:
        """Multiply-adds x 2 over the real (unpadded) channels."""
        return (2 * self.batch * self.out_channels * self.out_height * self.out_width * self.group_in
                * self.kernel[0] * self.kernel[1])

    def describe(self) -> str:
        """``64->64 3x3 s1 @56x56 b1`` (+ `` g32``, `` d2``, `` pad..`` where not the default)."""
        g = f" g{self.groups}" if self.groups > 1 else ""
        d = f" d{self.dilation[0]}" + (f"x{self.dilation[1]}" if self.dilation[1] != self.dilation[0] else "") \
            if self.dilation != (1, 1) else ""
        s = f"s{self.stride[0]}" + (f"x{self.stride[1]}" if self.stride[1] != self.stride[0] else "")
        u = " u8" if self.in_zero else ""
        t = (" +table" if self.table else "") + (" +add" if self.residual else "") + (" +layer_norm" if self.norm else "")
        t += f" split{self.splits}" if self.splits > 1 else ""
        return (f"{self.in_channels}->{self.out_channels} {self.kernel[0]}x{self.kernel[1]} {s}{g}{d}{u} "
                f"@{self.height}x{self.width} b{self.batch}{t}")

    @property
    def pads_with_zero_point(self) -> bool:
        """The padding must read a nonzero zero point (an unsigned input of a padded conv)."""
        return bool(self.in_zero) and any(self.padding)

    def to_dict(self) -> dict:
        d = asdict(self)
        for optional in ("table", "residual", "norm"):
            if not d[optional]:
                del d[optional]
        if self.splits == 1:
            del d["splits"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ConvWorkload":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def of(cls, func) -> "ConvWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls.from_dict(ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class PoolWorkload:
    """A max-pool on an int8 tensor of packed ``shape`` (in its producer's layout)."""

    shape: tuple[int, ...]
    pool: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    dilation: tuple[int, int] = (1, 1)
    ceil_mode: bool = False

    def to_dict(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def of(cls, func) -> "PoolWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class AddWorkload:
    """``clamp((a - zero_a) * mult_a + (b - zero_b) * mult_b >> shift + zero_out, act_min, act_max)``
    on two int8 tensors of ``shape`` (zero points: 0, or -128 for an unsigned tensor)."""

    shape: tuple[int, ...]
    mult_a: int
    mult_b: int
    shift: int
    act_min: int = QMIN
    act_max: int = 127
    zero_a: int = 0
    zero_b: int = 0
    zero_out: int = 0

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass(frozen=True)
class ConcatWorkload:
    """Channel concatenation of int8 tensors of (N, H, W) = ``shape`` with ``channels`` real
    channels each, each requantized to the output scale by (``mults[i]``, ``shifts[i]``) from its
    zero point ``zeros[i]`` to ``out_zero`` (0, or -128 for an unsigned tensor; ``()``: all 0).
    ``gather`` > 0: only that many channels of the concatenation, picked by an index parameter (a
    channel gather of it, read from its inputs: ``concat_int8.py``)."""

    shape: tuple[int, int, int]
    channels: tuple[int, ...]
    mults: tuple[int, ...]
    shifts: tuple[int, ...]
    zeros: tuple[int, ...] = ()
    out_zero: int = 0
    gather: int = 0

    def to_dict(self) -> dict:
        d = self.__dict__.copy()
        if not self.gather:
            del d["gather"]     # a plain concatenation is recorded as before
        return d

    @classmethod
    def of(cls, func) -> "ConcatWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class ChannelsWorkload:
    """A channel gather of an int8 tensor of (N, H, W) = ``shape`` with ``in_channels`` real
    channels into ``out_channels`` (``channels_int8.py``; the index is a parameter)."""

    shape: tuple[int, int, int]
    in_channels: int
    out_channels: int

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass(frozen=True)
class LutWorkload:
    """A 256-entry lookup table over an int8 tensor of (N, H, W) = ``shape`` with ``channels``
    real channels (``lut_int8.py``; the table is a parameter)."""

    shape: tuple[int, int, int]
    channels: int

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass(frozen=True)
class LayerNormWorkload:
    """A LayerNorm over the ``channels`` real channels of each pixel of an int8 tensor of
    (N, H, W) = ``shape``, written at output zero point ``out_zero`` (``layer_norm_int8.py``; the
    gains, offsets and the row constants are parameters)."""

    shape: tuple[int, int, int]
    channels: int
    out_zero: int = 0

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass(frozen=True)
class ScaleWorkload:
    """A channel scaling ``y = x * g[n, c]`` of an int8 tensor of (N, H, W) = ``shape`` with
    ``channels`` real channels, ``rescale`` = s_x / s_y (``scale_int8.py``; the gate is an input)."""

    shape: tuple[int, int, int]
    channels: int
    rescale: float
    in_zero: int = 0
    out_zero: int = 0
    gate_table: bool = False   # the gate as an int8 input and a 256-entry table (scale_int8.py)
    gate_shift: int = 0        # with gate_table: the table's fixed-point shift S (scale_int8.gate_shift)

    def to_dict(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def of(cls, func) -> "ScaleWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class AvgPoolWorkload:
    """An int8 average pool of packed ``shape``, requantized by (``mult``, ``shift``); input and
    output zero points ``in_zero`` / ``out_zero`` (0, or -128 for an unsigned tensor)."""

    shape: tuple[int, ...]
    pool: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int, int, int]
    mult: int
    shift: int
    in_zero: int = 0
    out_zero: int = 0

    def to_dict(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def of(cls, func) -> "AvgPoolWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class AffineWorkload:
    """An int8 per-channel affine (inference BatchNorm) of packed ``shape``, clamped to [act_min, act_max];
    ``out_zero``: the output's zero point (the input's is in the bias)."""

    shape: tuple[int, ...]
    act_min: int = QMIN
    act_max: int = 127
    out_zero: int = 0
    inputs: tuple[int, ...] = ()   # the real channels of each concatenated input (affine_int8.py); () = one input

    def to_dict(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def of(cls, func) -> "AffineWorkload":
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


# ---- the conversion kernels' workloads (``conversion_kernels.py``) -------------------------------
# What each conversion's compute needs.  ``scale`` is held as the float32 the kernels compute with
# (``quantize.py`` rounds it to float32 first): two scales that round alike make the same PrimFunc,
# and so the same workload attribute, so Relax still shares one kernel between them.

def _float32_scale(owner: str, scale) -> float:
    value = float(np.float32(scale))
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{owner}.scale must be a positive finite float32, got {scale!r}")
    return value


def _shape(owner: str, name: str, shape, length: int | None = None) -> tuple[int, ...]:
    value = tuple(int(s) for s in shape)
    if (length is not None and len(value) != length) or min(value, default=0) < 1:
        raise ValueError(f"{owner}.{name} must be {length or 'some'} positive ints, got {shape!r}")
    return value


def _zero(owner: str, zero) -> int:
    if zero not in (0, UNSIGNED_ZERO):
        raise ValueError(f"{owner}.zero must be 0 (symmetric) or {UNSIGNED_ZERO} (unsigned), got {zero!r}")
    return int(zero)


class _Literal:
    """``to_dict`` / ``of``: the workload as the dict literal its PrimFunc records (``tvm_qconv.workload``)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, func):
        """The workload a kernel's PrimFunc was made for (its ``tvm_qconv.workload`` attribute)."""
        return cls(**ast.literal_eval(str(func.attrs["tvm_qconv.workload"])))


@dataclass(frozen=True)
class QuantizeWorkload(_Literal):
    """float NCHW of ``shape`` -> int8 in a layout (the implementation's): ``clamp(round(x / scale)
    + zero)``, ``zero`` 0 (symmetric, -127..127) or -128 (unsigned: 0..255 stored minus 128)."""

    shape: tuple[int, int, int, int]
    scale: float
    zero: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", _shape("QuantizeWorkload", "shape", self.shape, 4))
        object.__setattr__(self, "scale", _float32_scale("QuantizeWorkload", self.scale))
        object.__setattr__(self, "zero", _zero("QuantizeWorkload", self.zero))


@dataclass(frozen=True)
class DequantizeWorkload(_Literal):
    """int8 of packed ``packed_shape`` in a layout (the implementation's) -> float NCHW of its first
    ``channels`` channels, ``(q - zero) * scale``.  The packed shape, not the NCHW one: a producer
    may pad the channels past the layout's own rounding, and the kernel reads its buffer as it is."""

    packed_shape: tuple[int, ...]
    channels: int
    scale: float
    zero: int = 0

    def __post_init__(self):
        object.__setattr__(self, "packed_shape", _shape("DequantizeWorkload", "packed_shape", self.packed_shape))
        if int(self.channels) < 1:
            raise ValueError(f"DequantizeWorkload.channels must be >= 1, got {self.channels!r}")
        object.__setattr__(self, "channels", int(self.channels))
        object.__setattr__(self, "scale", _float32_scale("DequantizeWorkload", self.scale))
        object.__setattr__(self, "zero", _zero("DequantizeWorkload", self.zero))


@dataclass(frozen=True)
class RelayoutWorkload(_Literal):
    """int8 in layout ``src`` -> int8 in layout ``dst`` (layout names, e.g. ``NCHW4c``), of NCHW
    ``shape`` (real channels); the values are moved, not changed (both sides share the scale)."""

    shape: tuple[int, int, int, int]
    src: str
    dst: str

    def __post_init__(self):
        object.__setattr__(self, "shape", _shape("RelayoutWorkload", "shape", self.shape, 4))
        if not (self.src and self.dst) or self.src == self.dst:
            raise ValueError(f"RelayoutWorkload converts between two layouts, got {self.src!r} -> {self.dst!r}")


@dataclass(frozen=True)
class QuantizeRowsWorkload(_Literal):
    """float [N, K] of ``shape`` -> int8 [N, ``k_padded``] (K zero-padded), the input rows of an int8
    linear layer; ``k_padded`` is the dense implementation's (``KernelImpl.in_features_padded``)."""

    shape: tuple[int, int]
    scale: float
    k_padded: int
    zero: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", _shape("QuantizeRowsWorkload", "shape", self.shape, 2))
        if int(self.k_padded) < self.shape[1]:
            raise ValueError(f"QuantizeRowsWorkload.k_padded must be >= K = {self.shape[1]}, got {self.k_padded!r}")
        object.__setattr__(self, "k_padded", int(self.k_padded))
        object.__setattr__(self, "scale", _float32_scale("QuantizeRowsWorkload", self.scale))
        object.__setattr__(self, "zero", _zero("QuantizeRowsWorkload", self.zero))
