"""The fused int8 conv kernel: NCHW4c x OIHW4o4i -> int32 accumulate -> +bias -> requantize(+ReLU) -> int8 NCHW4c.

Read top to bottom: the workload (:class:`Conv2dWorkload`), the compute definition
(:func:`conv2d_nchw4c_int8`), the NumPy reference (:func:`conv2d_nchw4c_int8_ref`) and the
packing helpers that put float/NCHW tensors into the kernel's layouts.  Schedules live beside
this file, one per target (``conv2d_nchw4c_cpu.py``, ``conv2d_nchw4c_dp4a.py``).

Layouts (seed 001): data ``[n, c // 4, h, w, c % 4]``; weight ``[o // 4, i // 4, kh, kw, o % 4, i % 4]``,
so one dp4a multiplies 4 consecutive input channels of the data with 4 consecutive input channels
of one output channel's filter, both contiguous int8x4 words.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from tvm import te, tirx

from .requantize import requantize_ref, requantize_tir

KERNEL_NAME = "conv2d_nchw4c_int8"


def ceil4(c: int) -> int:
    return (c + 3) // 4 * 4


def conv_output_size(size: int, kernel: int, stride: int, pad_before: int, pad_after: int, dilation: int) -> int:
    """Output length of a conv along one axis (PyTorch's formula, floor division)."""
    return (size + pad_before + pad_after - (kernel - 1) * dilation - 1) // stride + 1


@dataclass(frozen=True)
class Conv2dWorkload:
    """One conv layer as the kernel sees it (channels in real units, before padding to 4)."""

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int] = (3, 3)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (1, 1, 1, 1)  # top, left, bottom, right
    dilation: tuple[int, int] = (1, 1)
    relu: bool = True

    def __post_init__(self):
        for name in ("batch", "in_channels", "height", "width", "out_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"Conv2dWorkload.{name} must be >= 1, got {getattr(self, name)}")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(f"conv output would be empty: {self}")

    @property
    def out_height(self) -> int:
        return conv_output_size(self.height, self.kernel[0], self.stride[0], self.padding[0], self.padding[2],
                                self.dilation[0])

    @property
    def out_width(self) -> int:
        return conv_output_size(self.width, self.kernel[1], self.stride[1], self.padding[1], self.padding[3],
                                self.dilation[1])

    @property
    def ops(self) -> int:
        """Multiply-adds x 2 over the real (unpadded) channels."""
        return 2 * self.batch * self.out_channels * self.out_height * self.out_width * \
            self.in_channels * self.kernel[0] * self.kernel[1]

    def describe(self) -> str:
        return (f"{self.in_channels}->{self.out_channels} {self.kernel[0]}x{self.kernel[1]} "
                f"s{self.stride[0]} @{self.height}x{self.width} b{self.batch}")

    def to_dict(self) -> dict:
        return asdict(self)


def conv2d_nchw4c_int8(wl: Conv2dWorkload, requantize: bool = True) -> tirx.PrimFunc:
    """Compute definition (unscheduled PrimFunc) of the fused kernel for one workload.

    Params: A int8 (N, IC/4, H, W, 4); Wt int8 (OC/4, IC/4, KH, KW, 4, 4); Bias, Mult, Shift
    int32 (OC/4, 4); returns Out int8 (N, OC/4, OH, OW, 4).  Blocks: ``pad``, ``conv``
    (int32 reduction over ic_outer, kh, kw, ic_inner with ic_inner innermost, 4 wide: the dp4a
    axis) and ``requant`` (the epilogue; a schedule inlines it into the write-back).

    ``requantize=False`` gives the *unfused* conv of the fused-vs-unfused benchmark: params A,
    Wt only, Out is the int32 accumulator, and ``requant`` is a plain copy (same block names,
    so the same schedules apply).
    """
    icc, occ = ceil4(wl.in_channels) // 4, ceil4(wl.out_channels) // 4
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    A = te.placeholder((wl.batch, icc, wl.height, wl.width, 4), "int8", name="A")
    W = te.placeholder((occ, icc, kh, kw, 4, 4), "int8", name="W")
    bias = te.placeholder((occ, 4), "int32", name="Bias")
    mult = te.placeholder((occ, 4), "int32", name="Mult")
    shift = te.placeholder((occ, 4), "int32", name="Shift")
    ph, pw = wl.height + pt + pb, wl.width + pl + pr
    pad = te.compute(
        (wl.batch, icc, ph, pw, 4),
        lambda n, c, h, w, ci: tirx.if_then_else(
            tirx.all(h >= pt, h < pt + wl.height, w >= pl, w < pl + wl.width),
            A[n, c, h - pt, w - pl, ci], tirx.const(0, "int8")),
        name="pad")
    rc = te.reduce_axis((0, icc), name="rc")
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    rci = te.reduce_axis((0, 4), name="rci")
    conv = te.compute(
        (wl.batch, occ, oh, ow, 4),
        lambda n, oc, y, x, oci: te.sum(
            pad[n, rc, y * sh + ry * dh, x * sw + rx * dw, rci].astype("int32")
            * W[oc, rc, ry, rx, oci, rci].astype("int32"),
            axis=[rc, ry, rx, rci]),
        name="conv")
    if not requantize:
        out = te.compute(conv.shape, lambda *i: conv(*i), name="requant")
        return te.create_prim_func([A, W, out]).with_attr({"tvm_qconv.kernel": KERNEL_NAME + "_int32out"})
    lo = 0 if wl.relu else -128
    out = te.compute(
        (wl.batch, occ, oh, ow, 4),
        lambda n, oc, y, x, oci: requantize_tir(
            conv[n, oc, y, x, oci].astype("int64") + bias[oc, oci].astype("int64"),
            mult[oc, oci], shift[oc, oci], lo),
        name="requant")
    func = te.create_prim_func([A, W, bias, mult, shift, out])
    return func.with_attr({"tvm_qconv.kernel": KERNEL_NAME,
                           "tvm_qconv.workload": str(wl.to_dict())})


def conv2d_nchw4c_int8_ref(a, w, bias, mult, shift, wl: Conv2dWorkload) -> np.ndarray:
    """NumPy int64 reference of :func:`conv2d_nchw4c_int8` (same layouts, same epilogue)."""
    (kh, kw), (sh, sw), (dh, dw) = wl.kernel, wl.stride, wl.dilation
    pt, pl, pb, pr = wl.padding
    oh, ow = wl.out_height, wl.out_width
    ap = np.pad(a.astype(np.int64), ((0, 0), (0, 0), (pt, pb), (pl, pr), (0, 0)))
    n, icc = a.shape[:2]
    occ = w.shape[0]
    # [n, icc, h, w, ci] -> [n, h, w, icc*ci]; weight [occ, icc, kh, kw, oci, ici] -> [kh, kw, icc*ici, occ*oci]
    ap = ap.transpose(0, 2, 3, 1, 4).reshape(n, ap.shape[2], ap.shape[3], icc * 4)
    wk = w.astype(np.int64).transpose(2, 3, 1, 5, 0, 4).reshape(kh, kw, icc * 4, occ * 4)
    acc = np.zeros((n, oh, ow, occ * 4), np.int64)
    for y in range(kh):
        for x in range(kw):
            win = ap[:, y * dh: y * dh + (oh - 1) * sh + 1: sh, x * dw: x * dw + (ow - 1) * sw + 1: sw, :]
            acc += win @ wk[y, x]
    acc = acc.reshape(n, oh, ow, occ, 4).transpose(0, 3, 1, 2, 4)
    return requantize_ref(acc + bias.astype(np.int64)[None, :, None, None, :],
                          mult[None, :, None, None, :], shift[None, :, None, None, :], 0 if wl.relu else -128)


def pack_nchw4c(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, ceil(C/4), H, W, 4], zero-padding the channels."""
    n, c, h, w = x.shape
    xp = np.zeros((n, ceil4(c), h, w), x.dtype)
    xp[:, :c] = x
    return np.ascontiguousarray(xp.reshape(n, -1, 4, h, w).transpose(0, 1, 3, 4, 2))


def unpack_nchw4c(x: np.ndarray, channels: int) -> np.ndarray:
    """[N, C/4, H, W, 4] -> [N, C, H, W] keeping the first ``channels`` channels."""
    n, cc, h, w, _ = x.shape
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3).reshape(n, cc * 4, h, w)[:, :channels])


def pack_oihw4o4i(w: np.ndarray) -> np.ndarray:
    """[O, I, KH, KW] -> [O/4, I/4, KH, KW, 4o, 4i], zero-padding both channel axes."""
    o, i, kh, kw = w.shape
    wp = np.zeros((ceil4(o), ceil4(i), kh, kw), w.dtype)
    wp[:o, :i] = w
    return np.ascontiguousarray(wp.reshape(ceil4(o) // 4, 4, ceil4(i) // 4, 4, kh, kw).transpose(0, 2, 4, 5, 1, 3))


def pack_channels(v: np.ndarray, fill=0) -> np.ndarray:
    """Per-output-channel vector [O] -> [O/4, 4]; padded channels get ``fill`` (0 for bias and
    mult, so padded output channels stay exactly 0; 1 for shift, the smallest legal shift)."""
    vp = np.full(ceil4(v.shape[0]), fill, v.dtype)
    vp[: v.shape[0]] = v
    return vp.reshape(-1, 4)
