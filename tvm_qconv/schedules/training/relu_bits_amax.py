"""The training path's ReLU mask kernels that also write a range, a thread per 8 elements (two
16-byte loads, one byte of bits):

* ``relu_bits`` with ``amax``: ``y`` -> its byte of bits (``elementwise.relu_bits``, the same bits)
  and the bits of ``max |y|`` over the 8 to ``part`` (int32 ``[numel / 8]``,
  ``elementwise.abs_bits``), so ``part.amax().view(float32)`` is ``batch_amax(y)``;
* ``relu``: ``x`` -> ``y = relu(x)`` (``elementwise.relu_value``: torch's, NaN and positive
  subnormals kept), the bits of ``y`` and the same ``part``: ``CompactReLU``'s whole forward;
* ``bn_relu``: the same of ``x = (y - mean[c]) * scale[c] + beta[c] [+ addend]`` (each float32
  operation rounded on its own, ``elementwise.bn_relu``): ``BatchNormReLU``'s forward after its
  statistics.

Every decision is on the values' bits, not a float compare or max: TVM compiles CUDA with
--use_fast_math, under which ``max(x, 0)`` is ``max.ftz.f32`` (a positive subnormal becomes 0, its
gradient lost) and a float max drops NaN from a range.

Why: ``CompactReLU`` keeps the bits of its output for backward, and the next layer, an int8 conv,
observes the same output's range to quantize it.  In ResNet-50 (b128, H200, 2026-11-29) that was
three passes over every ReLU output: torch's ``relu`` (read and write), the bits kernel (a read)
and torch's ``aminmax`` (a read; about half of the step's 3.5 ms of range reductions).  ``relu``
is one: 4 bytes read, 4 written, 5/8 of a byte for the bits and the range.

Written as scheduled S-TIR (``tensorcore/pool.py`` says why not TIRx) for ``numel`` a multiple of 8
(:func:`supports`); ``tests/test_grad_kernels.py`` runs both on a CPU twin against the compute.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .elementwise_bits import ABS_BITS, relu_passes, relu_value
from .exact_float import exact

ELEMENTS = 8        # a thread's elements: one byte of bits, two 16-byte loads
THREADS = 256


def supports(wl) -> bool:
    """Whole bytes of bits: ``numel`` a multiple of 8."""
    n, c, h, w = wl.shape
    return wl.kind in ("relu_bits", "relu", "bn_relu") and n * c * h * w % ELEMENTS == 0


def relu_bits_amax_kernel(wl, rn: bool = True):
    """The CUDA kernel of ``elementwise.relu_bits(wl)`` with ``wl.amax``, of ``elementwise.relu(wl)``
    or of ``elementwise.bn_relu(wl, rn)`` (same parameters, same bits)."""
    if not (supports(wl) and (wl.amax or wl.kind in ("relu", "bn_relu"))):
        raise ValueError(f"relu_bits_amax_kernel takes relu, bn_relu, or relu_bits with amax, of whole bytes: {wl}")
    n, c, h, w = wl.shape
    NUMEL = n * c * h * w
    BYTES = NUMEL // ELEMENTS
    GRID = (BYTES + THREADS - 1) // THREADS
    RELU = wl.kind in ("relu", "bn_relu")
    BN, ADD, HW = wl.kind == "bn_relu", wl.addend, h * w

    @T.macro
    def body(src, y, out, part, mean, scale, beta, addend):
        with T.sblock("root"):
            got = T.sblock_alloc_buffer((ELEMENTS,), "float32", scope="local")
            other = T.sblock_alloc_buffer((ELEMENTS,), "float32", scope="local")   # (bn_relu) the addend
            acc = T.sblock_alloc_buffer((1,), "int32", scope="local")        # the byte
            top = T.sblock_alloc_buffer((1,), "int32", scope="local")        # max |y|'s bits
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    j = T.meta_var(cta * THREADS + tid)
                    if j < BYTES:
                        for h in T.unroll(2):
                            for i in T.vectorized(ELEMENTS // 2):
                                got[h * 4 + i] = src[j * ELEMENTS + h * 4 + i]
                        if BN:
                            for i in T.unroll(ELEMENTS):
                                ch = T.meta_var((j * ELEMENTS + i) // HW % c)
                                got[i] = exact("+", exact("*", exact("-", got[i], mean[ch], rn), scale[ch], rn),
                                                beta[ch], rn)
                        if ADD:
                            for h in T.unroll(2):
                                for i in T.vectorized(ELEMENTS // 2):
                                    other[h * 4 + i] = addend[j * ELEMENTS + h * 4 + i]
                            for i in T.unroll(ELEMENTS):
                                got[i] = exact("+", got[i], other[i], rn)
                        if RELU:
                            for i in T.unroll(ELEMENTS):
                                got[i] = relu_value(got[i])
                            for h in T.unroll(2):
                                for i in T.vectorized(ELEMENTS // 2):
                                    y[j * ELEMENTS + h * 4 + i] = got[h * 4 + i]
                        acc[0] = 0
                        top[0] = 0
                        for i in T.unroll(ELEMENTS):
                            if relu_passes(got[i]):
                                acc[0] = acc[0] | (1 << i)
                            top[0] = T.max(top[0], T.reinterpret("int32", got[i]) & ABS_BITS)
                        out[j] = T.Cast("uint8", acc[0])
                        part[j] = top[0]

    if BN and ADD:
        @T.prim_func(s_tir=True, private=True)
        def main(x: T.Buffer((NUMEL,), "float32", align=16), mean: T.Buffer((c,), "float32"),
                 scale: T.Buffer((c,), "float32"), beta: T.Buffer((c,), "float32"),
                 addend: T.Buffer((NUMEL,), "float32", align=16), y: T.Buffer((NUMEL,), "float32", align=16),
                 out: T.Buffer((BYTES,), "uint8"), part: T.Buffer((BYTES,), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(x, y, out, part, mean, scale, beta, addend)
    elif BN:
        @T.prim_func(s_tir=True, private=True)
        def main(x: T.Buffer((NUMEL,), "float32", align=16), mean: T.Buffer((c,), "float32"),
                 scale: T.Buffer((c,), "float32"), beta: T.Buffer((c,), "float32"),
                 y: T.Buffer((NUMEL,), "float32", align=16), out: T.Buffer((BYTES,), "uint8"),
                 part: T.Buffer((BYTES,), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(x, y, out, part, mean, scale, beta, None)
    elif RELU:
        @T.prim_func(s_tir=True, private=True)
        def main(x: T.Buffer((NUMEL,), "float32", align=16), y: T.Buffer((NUMEL,), "float32", align=16),
                 out: T.Buffer((BYTES,), "uint8"), part: T.Buffer((BYTES,), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(x, y, out, part, None, None, None, None)
    else:
        @T.prim_func(s_tir=True, private=True)
        def main(y: T.Buffer((NUMEL,), "float32", align=16), out: T.Buffer((BYTES,), "uint8"),
                 part: T.Buffer((BYTES,), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(y, None, out, part, None, None, None, None)

    return main
