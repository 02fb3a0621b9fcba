"""The training path's elementwise kernels: quantizing into and dequantizing out of its int8
convs with the scales the step computes (tensors, not build-time constants), one pass each.

In torch each of them is four to six passes over a float tensor: quantizing ``x`` is
``x / s``, ``round_``, ``clamp_`` and ``to(int8)``; a conv's float output is ``copy_`` of the
int32 accumulators (NHWC32 to NCHW), ``mul_`` by the scales, ``+= bias`` and ``relu_``.  On
VGG16 at batch 32 (H200, 2026-11-28) those passes were ~30 of the step's 61 ms of GPU time
(docs/performance.md, "Training").  Here each is one kernel:

=================  ===============================================================================
kind               what
=================  ===============================================================================
``quantize``       float32 NCHW ``x`` -> int8 NCHW ``clamp(nearbyint(x [* mult[c]] / s), -127, 127)``,
                   ``s`` one scale or one per channel (``c``, axis 1)
``dequantize``     int32 accumulators (NHWC32 ``[N, H, W, C_p]``, the tensor cores' output; NCHW4c
                   ``[N, ceil(C / 4), H, W, 4]``, dp4a's; or NCHW)
                   -> float32 NCHW ``acc * s [+ bias[c]]``, ``s`` one or per channel, optional ReLU,
                   optionally ``+ addend`` (float32 NCHW) last
``relu_bits``      float32 ``y`` -> uint8 ``[ceil(numel / 8)]``: bit ``i`` of byte ``j`` is
                   ``y[8j + i] > 0`` (``functional.pack_bits(y > 0)``: the ReLU mask backward keeps)
``relu``           float32 ``x`` -> ``y = relu(x)``, its ``relu_bits`` and its range (``CompactReLU``)
``mask``           float32 ``g``, those bits -> ``g`` where its bit is set, else 0 (the ReLU's backward)
``pack``           int8 NCHW -> the tensor cores' NHWC32 ``[N, H, W, C_p]``, or with ``transpose``
                   ``[C, H, W, N_p]`` (the batch as the channels: the weight gradient's operands,
                   ``grad_weight_mma.py``; ``pad_rows``: ``C`` padded to 32 as well)
``grad_stats``     float32 NCHW ``g`` [, ReLU bits] -> per channel of the masked ``g``, partial over
                   ``[P, T]`` (:func:`stats_grid`): ``max|g|`` (float32) and ``sum g`` (float64);
                   the caller finishes both over ``[P, T]`` (a few KB): the int8 gradients' scales and
                   the bias gradient in one pass over ``g``
``quantize_grad``  float32 NCHW ``g`` [, ReLU bits] -> the masked ``g`` quantized twice in one pass:
                   for ``dx`` (``* mult[c] / s``, one scale) and for ``dw`` (``/ s[c]``, per channel)
``max_pool``       float32 NCHW ``x`` -> its 2x2 / stride 2 max-pool and the window index of each max
                   (uint8 0-3, row-major, the first of equal ones: ``tvm_qconv.nn.max_pool``)
``max_pool_grad``  the pooled gradient and those indices -> float32 NCHW ``dx`` (``shape``)
``scale_sums``     the int8 weight gradient's int32 sums ``[C * KH * KW, O]`` (the tensor cores' order)
                   -> float32 OIHW ``dw = float(sum) * scale[o]`` (``shape`` = OIHW): torch's
                   ``int32 * float32`` bits, a transpose through shared memory
``flip_transpose`` the int8 weight OIHW ``[O, C, KH, KW]`` -> ``[C, KH, KW, O]``, both taps flipped: the
                   weight of the conv that computes ``dx`` (``functional.flipped_transposed_torch``)
                   in the layout the tensor-core pack reads without a copy
``bn_stats``       ``BatchNormReLU``'s forward statistics: float32 NCHW ``y`` -> per channel, partial over
                   ``[P, T]`` as ``grad_stats``: ``sum y`` and ``sum y * y`` (float64)
``bn_relu``        its forward after them: ``relu((y - mean[c]) * scale[c] + beta[c] [+ addend])``, its
                   bits and its range as ``relu`` (``relu_bits_amax``)
``bn_grad_sums``   ``BatchNormReLU``'s backward, pass 1 (``tvm_qconv/nn/batch_norm.py``): float32 NCHW
                   ``g``, ReLU bits, ``y``, ``mean[c]`` -> per channel of ``dz = g`` masked, partial
                   over ``[P, T]`` as ``grad_stats``: ``sum dz`` and ``sum dz * (y - mean)`` (float64)
``bn_grad``        pass 2: ``g``, bits, ``y``, ``mean``, ``a``, ``b``, ``c`` (per channel) -> float32
                   ``dy = a * dz + b * (y - mean) + c`` [and, with ``addend``, ``dz``: the residual's]
``bn_finish``      the statistics from the channel sums, the running ones updated (``bn_channel.py``)
``bn_coeffs``      backward's per-channel ``a``, ``b``, ``c``, ``dgamma``, ``dbeta`` from its sums
``range_ema``      a layer's range record updated with a batch's ``max|t|`` (``quant_scales.py``)
``conv_scales``    a conv's input, weight and dequantizing scales from the ranges (``quant_scales.py``)
``grad_finish``    ``grad_stats``' partials finished: ``max|g|`` and ``sum g`` a channel (``quant_scales.py``)
=================  ===============================================================================

Bit for bit the torch operations they replace, on every target, although TVM compiles CUDA
with ``--use_fast_math`` (``schedules/quantize.py`` says more: an approximate ``/``, subnormals
flushed, ``a * b + c`` contracted into one rounding).  On CUDA each float32 operation is its
correctly rounded intrinsic (``__fmul_rn``, ``__fdiv_rn``, ``__fadd_rn``: IEEE round to nearest
whatever the flags say; they flush subnormals, which changes no int8 value as every scale is at
least 1e-30).  Elsewhere it is done in float64 and rounded to float32 once, which is exactly
the float32 result for ``+``, ``*`` and ``/`` of float32 operands (53 >= 2 * 24 + 2 bits: no
double-rounding error).  The float64 route was the CUDA one too until 893d09e: on an H200 it
was ~40 % of ``quantize_grad``'s time (VGG16 b32: 3.0 -> 1.7 ms without it; history.md).  The
quantizing kinds need the correctly rounded quotient only where it decides the integer: on CUDA
they round the fast one and compute ``__fdiv_rn`` only within 2^-12 of a half-integer
(:func:`_quantized_quotient`; ``quantize_grad`` 1.7 -> 0.85 ms).  The int32 -> float32 conversion
rounds to nearest, as torch's ``copy_``.  Rounding is ``nearbyint``: ties to even, as
``torch.round``.

CUDA schedules (:func:`schedule_cuda`), each to keep 16-byte accesses and several loads in flight a
thread: ``quantize`` / ``quantize_grad`` 4 elements along a row (one 16-byte load); ``dequantize``
8 NHWC32 channels of a pixel (a 32-byte sector; 4 in NCHW4c), neighbouring threads on neighbouring
pixels (coalesced NCHW stores); ``mask`` 8 elements (a byte of bits); ``max_pool_grad`` 2 rows x 4
columns (two windows); ``pack`` a 32-channel x 128-pixel tile through shared memory
(``pack_nhwc32``: each warp load 128 bytes of a channel, each pair of 16-byte stores a whole
sector); ``grad_stats`` 4 pixels a load from a flat ``g``, 4 loads in flight; ``scale_sums`` a
32 x 32 transpose through shared memory; ``flip_transpose`` 32 x 32 channel pairs (all taps) through
shared memory.  Written kernels where a range comes along
(``dequantize`` with ``amax``: ``dequantize_amax``; ``relu``, and ``relu_bits`` with ``amax``:
``relu_bits_amax``).  Every staged path takes a thread count dividing its items
(``block_threads``) or the plain one: a register stage's store loses the grid tail's guard in TVM
0.27.  ``tests/test_grad_kernels.py`` runs each schedule on a CPU twin against its compute.  Off
CUDA the compute runs as it is (llvm).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import te, tirx

from ..channels_last_conversions import _schedule as schedule_pixels_by_vectors
from ..elementwise_int8 import block_threads
from ..sched_utils import as_schedule_of
from ..tensorcore.layout import ceil32
from . import bn_channel, dequantize_amax, pack_nhwc32, quant_scales, relu_bits_amax
from .elementwise_bits import abs_bits, relu_passes, relu_value
from .exact_float import exact

KINDS = ("quantize", "dequantize", "relu_bits", "relu", "mask", "pack", "grad_stats", "quantize_grad", "max_pool",
         "max_pool_grad", "scale_sums", "flip_transpose", "bn_stats", "bn_relu", "bn_grad_sums", "bn_grad",
         "bn_finish", "bn_coeffs", "range_ema", "conv_scales", "grad_finish")
CHANNEL_KINDS = ("bn_finish", "bn_coeffs", "range_ema", "conv_scales", "grad_finish")  # a thread or a block a
#                                                                      channel (bn_channel.py, quant_scales.py)
PARTIALS_KINDS = ("bn_finish", "bn_coeffs", "grad_finish")   # may take [C, K] partials (bn_channel.schedule_cuda)
LAYOUTS = ("nchw", "nhwc32", "nchw4c")
THREADS = 256
VEC = 4     # int32 channels a dequantize thread reads at once from NHWC32: 16 bytes
INDEX_LIMIT = 2 ** 31   # elements of a kernel's tensors: the written kernels index in int32


@dataclass(frozen=True)
class ElementwiseWorkload:
    """One elementwise kernel of the training path.

    Attributes:
        kind: ``quantize`` or ``dequantize``.
        shape: the float side's NCHW shape (N, C, H, W).
        per_channel: the scale is ``[C]`` (else ``[1]``).
        mult: (quantize) ``x`` is multiplied by a ``[C]`` factor first (the weight scales folded
            into the output gradient of the int8 input gradient); (conv_scales) the product's
            first factor is an input (backward's ``dw`` scale).
        layout: (dequantize) the accumulators' layout: ``nchw``, ``nhwc32`` or ``nchw4c`` (one group).
        bias: (dequantize) a ``[C]`` bias is added after the scale.
        relu: (dequantize) ReLU last; (grad_stats, quantize_grad) ``g`` masked by the ReLU's bits.
        transpose: (pack) the batch becomes the packed channels: ``[C, H, W, N_p]``.
        pad_rows: (pack, transposed) the rows ``C`` padded to 32 too (zeros).
        dx: (quantize_grad) the per-tensor quantization for the input gradient (``mult``, one scale).
        dw: (quantize_grad) the per-channel quantization for the weight gradient.
        addend: (bn_relu) a residual added before the ReLU; (bn_grad) also ``dz``, its gradient;
            (dequantize) a float32 NCHW tensor added last (a passthrough's gradient joining dx).
        eps, momentum: (bn_finish) the BatchNorm's; momentum: (range_ema) the range record's.
        partials: (bn_finish, bn_coeffs, grad_finish) the two float64 sums (``grad_finish``: the
            max and the sum) arrive as ``[C, partials]`` per-thread partials of the statistics
            kernels, reduced in the kernel (``bn_channel``).
        amax: also ``part`` (int32), whose max is the bits (:func:`abs_bits`) of the range
            ``max |.|`` of a tensor the kernel writes or reads whole: (dequantize, NHWC32, C a
            multiple of 8) ``[N, C / 8, H, W]``, over each 8 channels of a pixel
            (``dequantize_amax``); (relu_bits, numel a multiple of 8) ``[numel / 8]``, over each
            byte's 8 (``relu_bits_amax``).
    """

    kind: str
    shape: tuple[int, int, int, int]
    per_channel: bool = False
    mult: bool = False
    layout: str = "nchw"
    bias: bool = False
    relu: bool = False
    transpose: bool = False
    pad_rows: bool = False
    dx: bool = False
    dw: bool = False
    amax: bool = False
    addend: bool = False
    eps: float = 0.0
    momentum: float = 0.0
    partials: int = 1

    def __post_init__(self):
        if self.kind not in KINDS or self.layout not in LAYOUTS or len(self.shape) != 4 or min(self.shape) < 1:
            raise ValueError(f"not an elementwise training kernel: {self}")
        if (self.partials < 1 or (self.partials > 1 and self.kind not in PARTIALS_KINDS)
                or (self.kind == "grad_finish" and self.partials == 1)):
            raise ValueError(f"partials (at least 1; more than 1 for grad_finish) are {PARTIALS_KINDS}': {self}")
        if self.largest_tensor() >= INDEX_LIMIT:
            raise ValueError(f"{self.describe()}: a tensor of {self.largest_tensor()} elements; the training kernels "
                             f"index in int32 (under {INDEX_LIMIT}): use a smaller batch")
        if self.kind == "relu" and not relu_bits_amax.supports(self):
            raise ValueError(f"relu takes whole bytes of bits (numel a multiple of 8): {self}")
        if self.amax and not (dequantize_amax.supports(self) or relu_bits_amax.supports(self)):
            raise ValueError(f"amax is for NHWC32 dequantizes of whole {dequantize_amax.CHANNELS}-channel groups "
                             f"and relu_bits of whole bytes: {self}")

    def to_dict(self) -> dict:
        return asdict(self)

    def largest_tensor(self) -> int:
        """Elements of the kernel's largest tensor: the NCHW side, or a padded NHWC32 one."""
        n, c, h, w = self.shape
        if self.kind == "pack":
            rows, cols = (c, n) if self.transpose else (n, c)
            return max(n * c * h * w, (ceil32(rows) if self.pad_rows else rows) * h * w * ceil32(cols))
        return max(n * c * h * w, n * h * w * ceil32(c) if self.layout == "nhwc32" else 0)

    def describe(self) -> str:
        n, c, h, w = self.shape
        opts = [o for o, on in (("per-channel", self.per_channel), ("mult", self.mult), (self.layout, self.kind ==
                "dequantize"), ("bias", self.bias), ("relu", self.relu), ("transposed", self.transpose),
                ("rows32", self.pad_rows), ("dx", self.dx),
                ("dw", self.dw), ("amax", self.amax), ("addend", self.addend),
                (f"eps {self.eps:g} momentum {self.momentum:g}", self.kind == "bn_finish"),
                (f"momentum {self.momentum:g}", self.kind == "range_ema"),
                (f"partials {self.partials}", self.partials > 1)) if on]
        return f"{self.kind} {c} @{h}x{w} b{n}" + "".join(f" {o}" for o in opts)


# |q - nearbyint(q)| above this, the fast quotient may sit on the other side of a half-integer from
# the correctly rounded one: far more than its error (2 ulp of the fast division: 2^-15 below 256)
_NEAR_TIE = 0.5 - 2.0 ** -12
# the fast division is within 2 ulp for divisors below 2^126 (the scales are far below; a larger one
# goes the slow way too)
_APPROX_DIVISOR_MAX = 2.0 ** 125
# 1.5 * 2^23: v + _ROUNDER (|v| <= 127) rounds v to an integer (to nearest, ties to even) held in its
# low mantissa bits; its bits minus _ROUNDER's are that integer
_ROUNDER = 12582912.0
_ROUNDER_BITS = 0x4B400000
QMAX = 127.0


def _clamp_qmax(v):
    return tirx.max(tirx.min(v, tirx.const(QMAX, "float32")), tirx.const(-QMAX, "float32"))


def _quantized_quotient(a, b, rn: bool = False):
    """int8 ``clamp(nearbyint(a / b), -127, 127)``, ``a / b`` the correctly rounded float32 quotient
    (module docstring): torch's ``(a / b).round_().clamp_(-127, 127).to(int8)``.

    On CUDA (``rn``) without a correctly rounded division where it cannot matter: the fast quotient
    (``--use_fast_math``'s division, within 2 ulp), clamped, rounded to an integer by adding
    1.5 * 2^23 (one float add; its bits are the integer) gives the same integer unless the quotient
    lies within ~2^-12 of a half-integer (k + 0.5), where the two roundings could fall on different
    sides; only there (about one value in 4,000 of random data, a branch the warp rarely takes) is
    ``__fdiv_rn`` computed.  The fast quotient overflows only to an infinity of the right sign, which
    clamps as the correct one does.  ncu had ``quantize_grad`` compute-bound (90 % SM throughput,
    21 % of DRAM's) on two ``__fdiv_rn``, two ``nearbyint`` and two float-to-int conversions an
    element, all on the quarter-rate pipe (history.md, 2026-11-28); this leaves one reciprocal."""
    if not rn:
        return _clamp_qmax(tirx.nearbyint(exact("/", a, b))).astype("int8")
    x, q, r = tirx.Var("a", "float32"), tirx.Var("q", "float32"), tirx.Var("r", "float32")
    rounder = tirx.const(_ROUNDER, "float32")
    near_tie = tirx.any(tirx.abs(q - (r - rounder)) > tirx.const(_NEAR_TIE, "float32"),
                        tirx.abs(b) > tirx.const(_APPROX_DIVISOR_MAX, "float32"))
    fast = tirx.reinterpret("int32", r) - tirx.const(_ROUNDER_BITS, "int32")
    slow = _clamp_qmax(tirx.nearbyint(exact("/", x, b, rn=True))).astype("int32")
    body = tirx.if_then_else(near_tie, slow, fast).astype("int8")
    return tirx.Let(x, a, tirx.Let(q, _clamp_qmax(x / b), tirx.Let(r, q + rounder, body)))


def quantize(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(x, scale[, mult], out)``: float32 NCHW -> int8 NCHW."""
    n, c, h, w = wl.shape
    x = te.placeholder(wl.shape, "float32", name="x")
    s = te.placeholder((c if wl.per_channel else 1,), "float32", name="scale")
    m = te.placeholder((c,), "float32", name="mult") if wl.mult else None

    def element(b, ch, y, xx):
        v = x[b, ch, y, xx]
        if m is not None:
            v = exact("*", v, m[ch], rn)
        return _quantized_quotient(v, s[ch if wl.per_channel else 0], rn)

    out = te.compute(wl.shape, element, name="quantize")
    params = [x, s] + ([m] if m is not None else []) + [out]
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": "train_quantize",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def dequantize(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(acc, scale[, bias][, addend], out)``: int32 accumulators -> float32 NCHW
    ``[relu](acc * scale [+ bias]) [+ addend]`` (``addend`` float32 NCHW: a gradient that joins the
    conv's input gradient here, ``QuantizedConv2dFunction``'s passthrough)."""
    n, c, h, w = wl.shape
    packed = {"nhwc32": (n, h, w, ceil32(c)), "nchw4c": (n, (c + 3) // 4, h, w, 4), "nchw": wl.shape}[wl.layout]
    acc = te.placeholder(packed, "int32", name="acc")
    s = te.placeholder((c if wl.per_channel else 1,), "float32", name="scale")
    bias = te.placeholder((c,), "float32", name="bias") if wl.bias else None
    addend = te.placeholder(wl.shape, "float32", name="addend") if wl.addend else None
    if wl.addend and wl.amax:
        raise ValueError(f"dequantize writes a range or adds an addend, not both: {wl}")

    def element(b, ch, y, xx):
        a = {"nhwc32": lambda: acc[b, y, xx, ch], "nchw4c": lambda: acc[b, ch // 4, y, xx, ch % 4],
             "nchw": lambda: acc[b, ch, y, xx]}[wl.layout]()
        v = exact("*", a.astype("float32"), s[ch if wl.per_channel else 0], rn)
        if bias is not None:
            v = exact("+", v, bias[ch], rn)
        v = tirx.max(v, tirx.const(0.0, "float32")) if wl.relu else v
        return exact("+", v, addend[b, ch, y, xx], rn) if addend is not None else v

    out = te.compute(wl.shape, element, name="dequantize")
    params = [acc, s] + ([bias] if bias is not None else []) + ([addend] if addend is not None else []) + [out]
    if wl.amax:     # max |out| over each 8 channels of a pixel, as bits (dequantize_amax)
        k = dequantize_amax.CHANNELS
        lane = te.reduce_axis((0, k), name="lane")
        params.append(te.compute((n, c // k, h, w), lambda b, g, y, xx: te.max(
            abs_bits(element(b, g * k + lane, y, xx)), axis=lane), name="dequantize_amax"))
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": "train_dequantize",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def _numel(wl: ElementwiseWorkload) -> int:
    n, c, h, w = wl.shape
    return n * c * h * w


def relu_bits(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(y, out)``: float32 ``y`` (flat) -> uint8 ``[ceil(numel / 8)]``, bit ``i`` of byte ``j`` set
    where ReLU's backward passes the gradient at ``y[8j + i]`` (:func:`relu_passes`: positive or
    NaN; the tail past ``numel`` 0)."""
    numel = _numel(wl)
    y = te.placeholder((numel,), "float32", name="y")

    def byte(j):
        bits = [tirx.if_then_else(tirx.all(8 * j + i < numel, relu_passes(y[tirx.min(8 * j + i, numel - 1)])),
                                  1 << i, 0) for i in range(8)]
        return sum(bits[1:], bits[0]).astype("uint8")

    out = te.compute(((numel + 7) // 8,), byte, name="relu_bits")
    params = [y, out]
    if wl.amax:     # max |y| over each byte's 8, as bits (relu_bits_amax: numel a multiple of 8)
        lane = te.reduce_axis((0, 8), name="lane")
        params.append(te.compute((numel // 8,), lambda j: te.max(abs_bits(y[8 * j + lane]), axis=lane),
                                 name="relu_bits_amax"))
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": "train_relu_bits",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def relu(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(x, y, bits, part)``: float32 ``x`` (flat, ``numel`` a multiple of 8) -> ``y = relu(x)``
    (:func:`relu_value`), ``relu_bits`` of ``y`` and ``part[j]``, the bits of ``max |y|`` over byte
    ``j``'s 8 (:func:`abs_bits`): ``CompactReLU``'s forward and its output's range in one pass
    (``relu_bits_amax``)."""
    numel = _numel(wl)
    x = te.placeholder((numel,), "float32", name="x")
    y = te.compute((numel,), lambda k: relu_value(x[k]), name="relu")
    bits = te.compute((numel // 8,), lambda j: sum(
        (tirx.if_then_else(relu_passes(y[8 * j + i]), 1 << i, 0) for i in range(1, 8)),
        tirx.if_then_else(relu_passes(y[8 * j]), 1, 0)).astype("uint8"), name="relu_bits")
    lane = te.reduce_axis((0, 8), name="lane")
    part = te.compute((numel // 8,), lambda j: te.max(abs_bits(y[8 * j + lane]), axis=lane), name="relu_amax")
    return te.create_prim_func([x, y, bits, part]).with_attr({"tvm_qconv.kernel": "train_relu",
                                                            "tvm_qconv.workload": str(wl.to_dict())})


def mask(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(g, bits, out)``: float32 ``g`` (flat) where its bit of :func:`relu_bits`'s is set, else 0."""
    numel = _numel(wl)
    g = te.placeholder((numel,), "float32", name="g")
    bits = te.placeholder(((numel + 7) // 8,), "uint8", name="bits")
    out = te.compute((numel,), lambda k: tirx.if_then_else(
        (bits[k // 8].astype("int32") >> (k % 8)) & 1 == 1, g[k], tirx.const(0.0, "float32")), name="mask")
    return te.create_prim_func([g, bits, out]).with_attr({"tvm_qconv.kernel": "train_mask",
                                                          "tvm_qconv.workload": str(wl.to_dict())})


def pack(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(src, out)``: int8 NCHW -> ``[N, H, W, C_p]``, or transposed ``[C or C_p, H, W, N_p]``; the
    padding 0."""
    n, c, h, w = wl.shape
    rows, cols = (c, n) if wl.transpose else (n, c)
    src = te.placeholder(wl.shape, "int8", name="src")

    def element(i, y, xx, j):
        nn, cc = (j, i) if wl.transpose else (i, j)
        return tirx.if_then_else(tirx.all(i < rows, j < cols),
                                 src[tirx.min(nn, n - 1), tirx.min(cc, c - 1), y, xx], tirx.const(0, "int8"))

    out = te.compute((ceil32(rows) if wl.pad_rows else rows, h, w, ceil32(cols)), element, name="pack")
    return te.create_prim_func([src, out]).with_attr({"tvm_qconv.kernel": "train_pack",
                                                      "tvm_qconv.workload": str(wl.to_dict())})

STATS_PER_THREAD = 32   # elements of g a grad_stats thread reduces (at least, where there are enough)
STATS_UNROLL = 8        # loads in flight a grad_stats thread: 8 elements, or 8 // 2 items of 4 pixels


def stats_grid(shape) -> tuple[int, int, int]:
    """``(P, T, L)`` of :func:`grad_stats` on NCHW ``shape``: per channel ``P`` blocks of ``T``
    threads, each reducing ``L`` items ``T`` apart (coalesced); ``P * T * L`` items cover the
    channel's ``N * H * W`` elements.  An item is 4 consecutive pixels (one 16-byte load) where
    ``H * W`` is a multiple of 4 (:func:`quads`), else one element.  The partials, ``12 * C * P * T``
    bytes, are about ``12 / 32`` of a byte per element of ``g``."""
    n, c, h, w = shape
    per_item = 4 if quads(shape) else 1
    m = n * h * w // per_item
    items = STATS_PER_THREAD // per_item
    threads = THREADS if m >= THREADS * items // 4 else 32
    blocks = max(1, m // (threads * items))
    return blocks, threads, -(-m // (blocks * threads))


def quads(shape) -> bool:
    """:func:`grad_stats` reads 4 pixels at a time: ``H * W`` a multiple of 4 (every image's
    channel plane then starts 16-byte aligned, and 4 pixels never straddle two planes)."""
    return shape[2] * shape[3] % 4 == 0


def _bit(bits, flat):
    """Bit ``flat`` of the packed mask (``functional.pack_bits``'s order) as a bool."""
    return ((bits[flat // 8].astype("int32") >> (flat % 8)) & 1) == 1


def grad_stats(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(g[, bits], amax, total)``: per channel of the (masked) float32 NCHW ``g``, the partial
    ``max|g|`` (float32) and ``sum g`` (float64) of each ``[P, T]`` thread (:func:`stats_grid`).
    Where :func:`quads` holds, ``g`` is taken flat and a thread's item is 4 pixels of one plane at
    ``(b * C + ch) * H * W + 4 q``: one address and one 16-byte load for 4 elements (one address an
    element, from a division by ``H * W`` and one by ``W``, had ncu's SM throughput at 68 %)."""
    n, c, h, w = wl.shape
    hw, numel = h * w, n * c * h * w
    blocks, threads, per = stats_grid(wl.shape)
    four = quads(wl.shape)
    lanes = 4 if four else 1
    m = n * hw // lanes                           # items of a channel
    g = te.placeholder((numel,) if four else wl.shape, "float32", name="g")
    bits = te.placeholder(((numel + 7) // 8,), "uint8", name="bits") if wl.relu else None
    r = te.reduce_axis((0, per), "r")
    lane = te.reduce_axis((0, lanes), "lane")
    absmax_sum = te.comm_reducer(lambda a, b: (tirx.max(a[0], b[0]), a[1] + b[1]),
                                 lambda t0, t1: (tirx.const(0.0, t0), tirx.const(0.0, t1)), name="absmax_sum")

    def partial(ch, p, t):
        j = (p * per + r) * threads + t           # the item, over (n, pixels / lanes) of channel ch
        jj = tirx.min(j, m - 1)
        b, q = jj // (hw // lanes), jj % (hw // lanes)
        flat = (b * c + ch) * hw + q * lanes + lane
        keep = j < m
        if bits is not None:
            keep = tirx.all(keep, _bit(bits, flat))
        pix = q * lanes + lane
        v = tirx.if_then_else(keep, g[flat] if four else g[b, ch, pix // w, pix % w], tirx.const(0.0, "float32"))
        return absmax_sum((tirx.abs(v), v.astype("float64")), axis=[r, lane])

    amax, total = te.compute((c, blocks, threads), partial, name="grad_stats")
    params = [g] + ([bits] if bits is not None else []) + [amax, total]
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": "train_grad_stats",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def _pair_sums(wl: ElementwiseWorkload, name: str, images: tuple[str, ...], masked: bool, channel: tuple[str, ...],
               pair) -> tirx.PrimFunc:
    """Per channel of NCHW ``wl.shape``, the partial float64 sums of ``pair(load, ch, keep)`` (two
    values) of each ``[P, T]`` thread of :func:`grad_stats`' grid (:func:`stats_grid`): the float32
    tensors ``images`` (flat, 4 pixels an item, where :func:`quads` holds), then ReLU ``bits`` where
    ``masked``, then the per-channel float32 ``channel`` tensors are the parameters, before the two
    ``[C, P, T]`` outputs.  ``load(t)`` is the item's element of image ``t`` (or channel tensor
    ``t``'s entry); ``keep`` whether it is in the tensor (and its bit set)."""
    n, c, h, w = wl.shape
    hw, numel = h * w, n * c * h * w
    blocks, threads, per = stats_grid(wl.shape)
    four = quads(wl.shape)
    lanes = 4 if four else 1
    m = n * hw // lanes
    tensors = {t: te.placeholder((numel,) if four else wl.shape, "float32", name=t) for t in images}
    bits = te.placeholder(((numel + 7) // 8,), "uint8", name="bits") if masked else None
    tensors.update({t: te.placeholder((c,), "float32", name=t) for t in channel})
    r = te.reduce_axis((0, per), "r")
    lane = te.reduce_axis((0, lanes), "lane")
    sums = te.comm_reducer(lambda a, b: (a[0] + b[0], a[1] + b[1]),
                           lambda t0, t1: (tirx.const(0.0, t0), tirx.const(0.0, t1)), name="sum_pair")

    def partial(ch, p, t):
        j = (p * per + r) * threads + t
        jj = tirx.min(j, m - 1)
        b, q = jj // (hw // lanes), jj % (hw // lanes)
        flat = (b * c + ch) * hw + q * lanes + lane
        pix = q * lanes + lane
        keep = j < m if bits is None else tirx.all(j < m, _bit(bits, flat))

        def load(t):
            if t in channel:
                return tensors[t][ch]
            return tensors[t][flat] if four else tensors[t][b, ch, pix // w, pix % w]
        return sums(pair(load, ch, keep), axis=[r, lane])

    s1, s2 = te.compute((c, blocks, threads), partial, name=name)
    params = [tensors[t] for t in images] + ([bits] if masked else []) + [tensors[t] for t in channel] + [s1, s2]
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": f"train_{name}",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def bn_stats(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(y, s1, s2)``: per channel of float32 NCHW ``y`` the partial ``sum y`` and ``sum y * y``
    (float64, the square too: ``batch_norm.batch_stats``' values) of each ``[P, T]`` thread."""
    def pair(load, ch, keep):
        v = tirx.if_then_else(keep, load("y"), tirx.const(0.0, "float32")).astype("float64")
        return v, v * v
    return _pair_sums(wl, "bn_stats", ("y",), False, (), pair)


def bn_relu(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(x, mean, scale, beta[, addend], y, bits, part)``: float32 (flat, ``numel`` a multiple of
    8) ``y = relu(((x - mean[c]) * scale[c] + beta[c]) [+ addend])``, each float32 operation rounded
    on its own in that order (``batch_norm.normalize_relu``'s bits), with :func:`relu`'s bits and
    ``part`` of ``y``."""
    n, c, h, w = wl.shape
    numel, hw = _numel(wl), h * w
    x = te.placeholder((numel,), "float32", name="x")
    mean, scale, beta = (te.placeholder((c,), "float32", name=nm) for nm in ("mean", "scale", "beta"))
    addend = te.placeholder((numel,), "float32", name="addend") if wl.addend else None

    def value(k):
        ch = k // hw % c
        z = exact("+", exact("*", exact("-", x[k], mean[ch], rn), scale[ch], rn), beta[ch], rn)
        return relu_value(z if addend is None else exact("+", z, addend[k], rn))

    y = te.compute((numel,), value, name="relu")
    bits = te.compute((numel // 8,), lambda j: sum(
        (tirx.if_then_else(relu_passes(y[8 * j + i]), 1 << i, 0) for i in range(1, 8)),
        tirx.if_then_else(relu_passes(y[8 * j]), 1, 0)).astype("uint8"), name="relu_bits")
    lane = te.reduce_axis((0, 8), name="lane")
    part = te.compute((numel // 8,), lambda j: te.max(abs_bits(y[8 * j + lane]), axis=lane), name="relu_amax")
    inputs = [x, mean, scale, beta] + ([addend] if addend is not None else [])
    return te.create_prim_func(inputs + [y, bits, part]).with_attr(
        {"tvm_qconv.kernel": "train_bn_relu", "tvm_qconv.workload": str(wl.to_dict())})


def bn_grad_sums(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(g, y, bits, mean, s1, s2)``: per channel of ``dz = g`` masked by ``bits``, the partial
    ``sum dz`` and ``sum dz * (y - mean)`` of each ``[P, T]`` thread, in float64 (the difference
    and the product too: ``batch_norm.grad_sums``' values)."""
    def pair(load, ch, keep):
        dz = tirx.if_then_else(keep, load("g"), tirx.const(0.0, "float32")).astype("float64")
        return dz, dz * (load("y").astype("float64") - load("mean").astype("float64"))
    return _pair_sums(wl, "bn_grad_sums", ("g", "y"), True, ("mean",), pair)


def bn_grad(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(g, bits, y, mean, a, b, c, dy[, dz])``: float32 NCHW ``dz = g`` masked by ``bits`` and
    ``dy = ((dz * a) + ((y - mean) * b)) + c`` per channel, each float32 operation rounded on its
    own in that order (``batch_norm.grad_apply``'s bits); ``dz`` out with ``addend``.  The tensors
    flat (``[N * C * H * W]``; the channel of element ``k`` is ``k // (H * W) % C``), as ``mask``'s:
    a CUDA thread takes a byte of bits, 8 elements (:func:`schedule_cuda`)."""
    n, c, h, w = wl.shape
    numel = _numel(wl)
    g = te.placeholder((numel,), "float32", name="g")
    bits = te.placeholder(((numel + 7) // 8,), "uint8", name="bits")
    y = te.placeholder((numel,), "float32", name="y")
    mean, a, b, cc = (te.placeholder((c,), "float32", name=nm) for nm in ("mean", "a", "b", "c"))

    def element(k):
        ch = k // (h * w) % c
        dz = tirx.if_then_else(_bit(bits, k), g[k], tirx.const(0.0, "float32"))
        t = exact("*", exact("-", y[k], mean[ch], rn), b[ch], rn)
        dy = exact("+", exact("+", exact("*", dz, a[ch], rn), t, rn), cc[ch], rn)
        return (dy, dz) if wl.addend else dy

    outs = te.compute((numel,), element, name="bn_grad")
    outs = list(outs) if wl.addend else [outs]
    return te.create_prim_func([g, bits, y, mean, a, b, cc] + outs).with_attr(
        {"tvm_qconv.kernel": "train_bn_grad", "tvm_qconv.workload": str(wl.to_dict())})


def quantize_grad(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(g[, bits][, s_dx, mult][, s_dw], [q_dx], [q_dw])``: the (masked) float32 NCHW ``g`` as
    ``quantize``'s ``(g, s_dx, mult)`` and ``(g, s_dw)`` give it, int8 NCHW, in one pass."""
    n, c, h, w = wl.shape
    if not (wl.dx or wl.dw):
        raise ValueError(f"quantize_grad makes dx's or dw's operand: {wl}")
    g = te.placeholder(wl.shape, "float32", name="g")
    bits = te.placeholder(((n * c * h * w + 7) // 8,), "uint8", name="bits") if wl.relu else None
    s_dx = te.placeholder((1,), "float32", name="s_dx") if wl.dx else None
    mult = te.placeholder((c,), "float32", name="mult") if wl.dx else None
    s_dw = te.placeholder((c,), "float32", name="s_dw") if wl.dw else None

    def element(b, ch, y, xx):
        v = g[b, ch, y, xx]
        if bits is not None:
            v = tirx.if_then_else(_bit(bits, ((b * c + ch) * h + y) * w + xx), v, tirx.const(0.0, "float32"))
        out = []
        if wl.dx:
            out.append(_quantized_quotient(exact("*", v, mult[ch], rn), s_dx[0], rn))
        if wl.dw:
            out.append(_quantized_quotient(v, s_dw[ch], rn))
        return tuple(out) if len(out) > 1 else out[0]

    outs = te.compute(wl.shape, element, name="quantize_grad")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    params = ([g] + ([bits] if bits is not None else []) + ([s_dx, mult] if wl.dx else []) + ([s_dw] if wl.dw else [])
              + outs)
    return te.create_prim_func(params).with_attr({"tvm_qconv.kernel": "train_quantize_grad",
                                                  "tvm_qconv.workload": str(wl.to_dict())})


def scale_sums(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """``(sums, scale, dw)``: int32 ``[C * KH * KW, O]`` -> float32 ``[O, C * KH * KW]`` (OIHW flat),
    ``float(sums[k, o]) * scale[o]``: int -> float32 rounded to nearest, then one float32 product
    (torch's ``torch.mul(int32, float32)``)."""
    o, c, kh, kw = wl.shape
    k = c * kh * kw
    sums = te.placeholder((k, o), "int32", name="sums")
    scale = te.placeholder((o,), "float32", name="scale")
    dw = te.compute((o, k), lambda i, j: exact("*", sums[j, i].astype("float32"), scale[i], rn), name="scale_sums")
    return te.create_prim_func([sums, scale, dw]).with_attr({"tvm_qconv.kernel": "train_scale_sums",
                                                             "tvm_qconv.workload": str(wl.to_dict())})


SCALE_TILE = 32     # scale_sums' transpose tile: 32 x 32 sums a block, through shared memory


def scale_sums_tiles(shape) -> bool:
    """:func:`scale_sums` on CUDA takes OIHW ``shape`` whole tiles only: ``O`` and ``C * KH * KW``
    multiples of 32 (VGG16's and ResNet-50's weights but the first conv's)."""
    o, c, kh, kw = shape
    return o % SCALE_TILE == 0 and (c * kh * kw) % SCALE_TILE == 0


def _schedule_scale_sums(sch) -> None:
    """A block per 32 x 32 tile: the sums read into shared memory along ``O`` (coalesced), ``dw``
    written along ``C * KH * KW`` (coalesced); the shared rows padded by one word (no bank
    conflicts on the transposed read).  torch's strided ``mul`` of VGG16's weight gradients, a
    transpose read 4 bytes a sector, took 1.0 ms a step (H200, b32: 16 launches)."""
    block = sch.get_sblock("scale_sums")
    i, j = sch.get_loops(block)
    _transpose_through_shared(sch, block, "sums", i, (), j, SCALE_TILE, row_stride=(SCALE_TILE, 1))


def _transpose_through_shared(sch, block, source: str, row, between, col, tile: int, row_stride) -> None:
    """A block per ``tile x tile`` tile of ``block``'s ``(row, col)`` loops (the ``between`` loops
    whole inside it): the tile's ``source`` read into shared memory (each thread loop fused and
    split into ``THREADS``), the output written from it; the shared rows padded to
    ``row_stride = (factor, offset)`` (``storage_align``: off the banks the transposed reads hit)."""
    r0, r1 = sch.split(row, [None, tile])
    c0, c1 = sch.split(col, [None, tile])
    sch.reorder(r0, c0, r1, *between, c1)
    bx = sch.fuse(r0, c0)
    sch.bind(bx, "blockIdx.x")
    shared = sch.cache_read(block, source, "shared")
    sch.compute_at(shared, bx)
    sch.storage_align(shared, 0, axis=0, factor=row_stride[0], offset=row_stride[1])
    _, tx = sch.split(sch.fuse(*sch.get_loops(shared)[1:]), [None, THREADS])    # [0]: the block's
    sch.bind(tx, "threadIdx.x")
    _, tx = sch.split(sch.fuse(r1, *between, c1), [None, THREADS])
    sch.bind(tx, "threadIdx.x")


def flip_transpose(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(src, out)``: int8 OIHW ``[O, C, KH, KW]`` -> ``[C, KH, KW, O]``,
    ``out[c, y, x, o] = src[o, c, KH - 1 - y, KW - 1 - x]`` (one group)."""
    o, c, kh, kw = wl.shape
    src = te.placeholder(wl.shape, "int8", name="src")
    out = te.compute((c, kh, kw, o), lambda i, y, x, j: src[j, i, kh - 1 - y, kw - 1 - x], name="flip_transpose")
    return te.create_prim_func([src, out]).with_attr({"tvm_qconv.kernel": "train_flip_transpose",
                                                      "tvm_qconv.workload": str(wl.to_dict())})


def flip_transpose_tile(shape) -> int:
    """Channels of each side a ``flip_transpose`` block takes on CUDA: 32 x 32 channel pairs with
    all their taps in shared memory (9 KB at 3 x 3), 16 x 16 above 16 taps (7 x 7: 12 KB)."""
    return 32 if shape[2] * shape[3] <= 16 else 16


def flip_transpose_tiles(shape) -> bool:
    """:func:`flip_transpose` on CUDA takes whole tiles only: ``O`` and ``C`` multiples of
    :func:`flip_transpose_tile` (VGG16's and ResNet-50's weights but the first conv's and the
    1000-class layer's)."""
    t = flip_transpose_tile(shape)
    return shape[0] % t == 0 and shape[1] % t == 0


def _schedule_flip_transpose(sch, shape) -> None:
    """A block per tile of ``T x T`` (output, input) channels: the source's ``T`` rows of
    ``T * KH * KW`` contiguous bytes read into shared memory, the output's ``T * KH * KW`` rows of
    ``T`` bytes (a sector at ``T = 32``) written from it; the shared rows padded by 4 bytes (an odd
    word stride: the transposed byte reads on distinct banks).  torch's ``flip`` and the strided
    copy that packs its result read a byte a sector across the weight: VGG16's 4096 x 25088
    linear layer alone is a 100 MB transpose a step."""
    t = flip_transpose_tile(shape)
    taps = shape[2] * shape[3]
    block = sch.get_sblock("flip_transpose")
    c, y, x, o = sch.get_loops(block)
    _transpose_through_shared(sch, block, "src", c, (y, x), o, t, row_stride=(t * taps, 4))


POOL = 2    # max_pool's window and stride


def max_pool(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(x, out, index)``: float32 NCHW ``x`` (``shape``) -> ``[N, C, H // 2, W // 2]`` maxima and
    their uint8 window index ``2 * i + j`` (the first of equal maxima, as PyTorch's max-pool)."""
    n, c, h, w = wl.shape
    x = te.placeholder(wl.shape, "float32", name="x")

    def window(b, ch, oy, ox):
        best, index = x[b, ch, POOL * oy, POOL * ox], tirx.const(0, "int32")
        for k in range(1, POOL * POOL):
            v = x[b, ch, POOL * oy + k // POOL, POOL * ox + k % POOL]
            index = tirx.Select(v > best, tirx.const(k, "int32"), index)
            best = tirx.max(v, best)
        return best, index.astype("uint8")

    out, index = te.compute((n, c, h // POOL, w // POOL), window, name="max_pool")
    return te.create_prim_func([x, out, index]).with_attr({"tvm_qconv.kernel": "train_max_pool",
                                                           "tvm_qconv.workload": str(wl.to_dict())})


def max_pool_grad(wl: ElementwiseWorkload) -> tirx.PrimFunc:
    """``(g, index, dx)``: the pooled gradient ``[N, C, H // 2, W // 2]`` and :func:`max_pool`'s
    indices -> float32 NCHW ``dx`` (``shape``): ``g`` where the window's max was, else 0 (also in a
    last odd row or column, which the pool skipped)."""
    n, c, h, w = wl.shape
    oh, ow = h // POOL, w // POOL
    g = te.placeholder((n, c, oh, ow), "float32", name="g")
    index = te.placeholder((n, c, oh, ow), "uint8", name="index")

    def element(b, ch, y, xx):
        oy, ox = tirx.min(y // POOL, oh - 1), tirx.min(xx // POOL, ow - 1)
        hit = tirx.all(y < oh * POOL, xx < ow * POOL,
                       index[b, ch, oy, ox].astype("int32") == (y % POOL) * POOL + xx % POOL)
        return tirx.if_then_else(hit, g[b, ch, oy, ox], tirx.const(0.0, "float32"))

    dx = te.compute(wl.shape, element, name="max_pool_grad")
    return te.create_prim_func([g, index, dx]).with_attr({"tvm_qconv.kernel": "train_max_pool_grad",
                                                          "tvm_qconv.workload": str(wl.to_dict())})


def _schedule_pack(func: tirx.PrimFunc, wl: ElementwiseWorkload, target) -> tirx.PrimFunc:
    """``pack`` on CUDA: ``pack_nhwc32``'s shared-memory tile where ``H * W`` is a multiple of 4,
    else a thread per pixel x 16 channels (``channels_last_conversions``)."""
    if not pack_nhwc32.supports(wl.shape):
        return schedule_pixels_by_vectors(func, target, "pack", channel=3, int8_is_output=True)
    return as_schedule_of(func, pack_nhwc32.pack_kernel(wl))


def _dequantize_vector(channels: int, layout: str) -> int:
    """Channels a ``dequantize`` thread reads at once: 8 from NHWC32 (two 16-byte loads, one
    32-byte sector) where the channels allow, else 4 (NCHW4c's 4 are its contiguous ones)."""
    return 2 * VEC if layout == "nhwc32" and channels % (2 * VEC) == 0 else VEC


def _unroll_pairs_of_vectors(sch, block) -> None:
    """A staging block's 8 elements as two unrolled 16-byte vectors (CUDA has no 8-float vector)."""
    pair, lane = sch.split(sch.get_loops(block)[-1], [2, VEC])
    sch.unroll(pair)
    sch.vectorize(lane)


def definition(wl: ElementwiseWorkload, target) -> tirx.PrimFunc:
    """The kernel of ``wl``, scheduled for CUDA (module docstring), as it is elsewhere."""
    cuda = target.kind.name == "cuda"
    func = compute(wl, rn=cuda)
    return schedule_cuda(func, wl, target) if cuda else func


def compute(wl: ElementwiseWorkload, rn: bool = False) -> tirx.PrimFunc:
    """The unscheduled kernel of ``wl``; ``rn``: its float32 operations as CUDA's correctly rounded
    intrinsics (else in float64, rounded once)."""
    rounded = {"quantize": quantize, "dequantize": dequantize, "quantize_grad": quantize_grad,  # float ops
               "scale_sums": scale_sums, "bn_grad": bn_grad, "bn_relu": bn_relu,
               "bn_finish": bn_channel.bn_finish, "bn_coeffs": bn_channel.bn_coeffs,
               "range_ema": quant_scales.range_ema, "conv_scales": quant_scales.conv_scales,
               "grad_finish": quant_scales.grad_finish}
    if wl.kind in rounded:
        return rounded[wl.kind](wl, rn=rn)
    return {"relu_bits": relu_bits, "relu": relu, "mask": mask, "pack": pack, "grad_stats": grad_stats,
            "max_pool": max_pool, "max_pool_grad": max_pool_grad, "bn_grad_sums": bn_grad_sums,
            "bn_stats": bn_stats, "flip_transpose": flip_transpose}[wl.kind](wl)


def schedule_cuda(func: tirx.PrimFunc, wl: ElementwiseWorkload, target, rn: bool = True) -> tirx.PrimFunc:
    """:func:`compute`'s ``func`` scheduled for CUDA (the module docstring's threads and vectors);
    ``rn``: ``func``'s (the written kernels compute as it does)."""
    if wl.kind == "pack":
        return _schedule_pack(func, wl, target)
    if wl.amax or wl.kind in ("relu", "bn_relu"):   # written kernels (float operations rounded as ``func``'s are)
        return as_schedule_of(func, dequantize_amax.dequantize_amax_kernel(wl, rn=rn) if wl.kind == "dequantize"
                              else relu_bits_amax.relu_bits_amax_kernel(wl, rn=rn))
    sch = tvm.s_tir.Schedule(func)
    if wl.kind == "scale_sums":
        if not scale_sums_tiles(wl.shape):
            raise ValueError(f"scale_sums takes whole {SCALE_TILE} x {SCALE_TILE} tiles (scale_sums_tiles): {wl}")
        _schedule_scale_sums(sch)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    if wl.kind in PARTIALS_KINDS:
        return bn_channel.schedule_cuda(func, wl)
    if wl.kind in CHANNEL_KINDS:    # a thread a channel, the outputs' blocks sharing its loop
        loop = sch.get_loops(sch.get_sblock(wl.kind if wl.kind == "range_ema" else f"{wl.kind}_v0"))[0]
        bx, tx = sch.split(loop, [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    if wl.kind == "flip_transpose":
        if not flip_transpose_tiles(wl.shape):
            raise ValueError(f"flip_transpose takes whole {flip_transpose_tile(wl.shape)}-channel tiles "
                             f"(flip_transpose_tiles): {wl}")
        _schedule_flip_transpose(sch, wl.shape)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    # quantize_grad's two outputs are two blocks in one loop nest (the loops below are shared)
    two = (wl.dx and wl.dw) or wl.kind == "max_pool" or (wl.kind == "bn_grad" and wl.addend)
    blocks = [sch.get_sblock(f"{wl.kind}_v{i}") for i in range(2)] if two else [sch.get_sblock(wl.kind)]
    block = blocks[0]
    if wl.kind in ("grad_stats", "bn_grad_sums", "bn_stats"):   # a block per [channel, P], its threads T apart
        ch, p, t, r, lane = sch.get_loops(block)
        sch.bind(sch.fuse(ch, p), "blockIdx.x")
        sch.bind(t, "threadIdx.x")
        # several loads in flight a thread: one at a time, ncu had the warps waiting on them (45 %
        # of stalls) at 36 % of DRAM's throughput
        items = STATS_UNROLL // 2 if quads(wl.shape) else STATS_UNROLL    # 16 or 8 elements in flight
        r_in = sch.split(r, [None, items])[1]
        if quads(wl.shape):     # the item's 4 pixels as one 16-byte load (of g, and of y)
            for name in {"bn_grad_sums": ("g", "y"), "bn_stats": ("y",)}.get(wl.kind, ("g",)):
                load = sch.cache_read(block, name, "local")
                sch.compute_at(load, r_in)
                sch.vectorize(sch.get_loops(load)[-1])
        sch.unroll(r_in)
        sch.unroll(lane)
        amax, total = sch.cache_write(block, 0, "local"), sch.cache_write(block, 1, "local")
        sch.reverse_compute_at(total, t)
        sch.reverse_compute_at(amax, t)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    n, c, h, w = wl.shape
    # The staged paths below (16-byte loads and stores through registers) need a thread count
    # that divides their items (block_threads): a register stage's store loses the grid tail's
    # guard in TVM 0.27 and would write past the output (elementwise_int8.block_threads; the CPU
    # twin test of these schedules caught it).  Without one they take the plain path.
    staged = {"mask": _numel(wl) // 8 if _numel(wl) % 8 == 0 else 0,
              "bn_grad": _numel(wl) // 8 if _numel(wl) % 8 == 0 else 0,
              "max_pool_grad": (n * c * (h // POOL) * (w // (2 * POOL if w % (2 * POOL) == 0 else POOL))
                                if h % POOL == 0 and w % POOL == 0 else 0),
              "quantize": n * c * h * (w // VEC) if w % VEC == 0 else 0,
              "dequantize": n * (c // _dequantize_vector(c, wl.layout)) * h * w if wl.layout != "nchw" and c % VEC == 0 else 0}
    staged["quantize_grad"] = staged["quantize"]
    threads = block_threads(staged[wl.kind]) if staged.get(wl.kind) else None
    if wl.kind in ("mask", "bn_grad") and threads:
        # a thread per byte of bits: 8 elements, two 16-byte loads of each input and stores of each
        # output (a thread per element had ResNet-50 b128's 49 masks at ~40 % of the bandwidth:
        # 5.7 ms of the step; bn_grad at 62 %: 6.7 ms)
        outer, pair, lane = sch.split(sch.get_loops(block)[0], [None, 2, VEC])
        bx, tx = sch.split(outer, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        for name in ("g", "y") if wl.kind == "bn_grad" else ("g",):
            load = sch.cache_read(block, name, "local")
            sch.compute_at(load, tx)
            _unroll_pairs_of_vectors(sch, load)
        stores = [sch.cache_write(b_, 0, "local") for b_ in blocks]
        for store in reversed(stores):
            sch.reverse_compute_at(store, tx)
            _unroll_pairs_of_vectors(sch, store)
        sch.unroll(pair)
        sch.unroll(lane)
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    if wl.kind in ("relu_bits", "mask", "bn_grad"):     # flat: one element (one byte of bits) per thread
        bx, tx = sch.split(sch.get_loops(block)[0], [None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch.mod["main"].with_attr("tir.is_scheduled", True)
    b, ch, y, xx = sch.get_loops(block)
    if wl.kind == "max_pool_grad" and threads:
        # a thread per 2 rows x 4 columns (two windows; 2 x 2 where W is not a multiple of 4): one
        # read of their g and indices, a 16-byte store a row; a thread per element (5 bytes read
        # for 4 written) had it at ~28 % of a copy's bandwidth
        cols = 2 * POOL if w % (2 * POOL) == 0 else POOL
        y0, y1 = sch.split(y, [None, POOL])
        x0, x1 = sch.split(xx, [None, cols])
        sch.reorder(b, ch, y0, x0, y1, x1)
        bx, tx = sch.split(sch.fuse(b, ch, y0, x0), [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        store = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(store, tx)
        sch.vectorize(sch.get_loops(store)[-1])
        sch.unroll(y1)
        sch.unroll(x1)
    elif wl.kind in ("quantize", "quantize_grad") and threads:
        # 4 consecutive elements a thread: one 16-byte load, one 4-byte store
        x0, lane = sch.split(xx, [None, VEC])
        bx, tx = sch.split(sch.fuse(b, ch, y, x0), [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        load = sch.cache_read(block, "x" if wl.kind == "quantize" else "g", "local")
        sch.compute_at(load, tx)
        sch.vectorize(sch.get_loops(load)[-1])
        stores = [sch.cache_write(b_, 0, "local") for b_ in blocks]
        for store in reversed(stores):
            sch.reverse_compute_at(store, tx)
            sch.vectorize(sch.get_loops(store)[-1])
        sch.unroll(lane)
    elif wl.kind == "dequantize" and threads:
        # threads on pixels (consecutive x: coalesced NCHW stores), 8 channels each where C allows:
        # a whole 32-byte sector of the accumulators (4 channels, half a sector, had it at ~69 % of
        # a copy's bandwidth, VGG16 b32 on an H200)
        vec = _dequantize_vector(c, wl.layout)
        c0, lane = sch.split(ch, [None, vec])
        sch.reorder(b, c0, y, xx, lane)
        bx, tx = sch.split(sch.fuse(b, c0, y, xx), [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        stage = sch.cache_read(block, 0, "local")
        sch.compute_at(stage, tx)
        if vec == 2 * VEC:
            _unroll_pairs_of_vectors(sch, stage)
        else:
            sch.vectorize(sch.get_loops(stage)[-1])
        sch.unroll(lane)
    else:
        bx, tx = sch.split(sch.fuse(b, ch, y, xx), [None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].with_attr("tir.is_scheduled", True)
