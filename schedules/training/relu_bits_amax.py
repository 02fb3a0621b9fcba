"""The training path's ``relu_bits`` that also writes its input's range: each thread reads 8
elements of ``y`` (two 16-byte loads), writes their byte of bits (``elementwise.relu_bits``, the
same bits) and ``max |y|`` over them to ``part`` (``[numel / 8]``), so ``part.amax()`` is
``batch_amax(y)``.

Why: ``CompactReLU`` keeps the bits of its output for backward, and the next layer, an int8 conv,
observes the same output's range to quantize it: in ResNet-50 that was a second full pass over
every ReLU output in torch (``aminmax``, 4 bytes an element; about half of the 3.5 ms of range
reductions in a b128 step, H200, 2026-11-29).  Here it costs a write of half a byte an element.

Written as scheduled S-TIR (``tensorcore/pool.py`` says why not TIRx) for ``numel`` a multiple of 8
(:func:`supports`); ``tests/test_grad_kernels.py`` runs it on a CPU twin against the compute.
"""
from __future__ import annotations

from tvm.script import tirx as T

ELEMENTS = 8        # a thread's elements: one byte of bits, two 16-byte loads
THREADS = 256


def supports(wl) -> bool:
    """Whole bytes of bits: ``numel`` a multiple of 8."""
    n, c, h, w = wl.shape
    return wl.kind == "relu_bits" and n * c * h * w % ELEMENTS == 0


def relu_bits_amax_kernel(wl):
    """The CUDA kernel of ``elementwise.relu_bits(wl)`` with ``wl.amax`` (same parameters, same bits)."""
    if not (supports(wl) and wl.amax):
        raise ValueError(f"relu_bits_amax_kernel takes relu_bits of whole bytes with amax: {wl}")
    n, c, h, w = wl.shape
    NUMEL = n * c * h * w
    BYTES = NUMEL // ELEMENTS
    GRID = (BYTES + THREADS - 1) // THREADS

    @T.prim_func(s_tir=True, private=True)
    def main(y: T.Buffer((NUMEL,), "float32", align=16), out: T.Buffer((BYTES,), "uint8"),
             part: T.Buffer((BYTES,), "float32")):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            got = T.sblock_alloc_buffer((ELEMENTS,), "float32", scope="local")
            acc = T.sblock_alloc_buffer((1,), "int32", scope="local")        # the byte
            top = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    j = T.meta_var(cta * THREADS + tid)
                    if j < BYTES:
                        for h in T.unroll(2):
                            for i in T.vectorized(ELEMENTS // 2):
                                got[h * 4 + i] = y[j * ELEMENTS + h * 4 + i]
                        acc[0] = 0
                        top[0] = T.float32(0)
                        for i in T.unroll(ELEMENTS):
                            # y > 0 as its bits, as elementwise.relu_bits (exact for subnormals)
                            if T.reinterpret("int32", got[i]) > 0:
                                acc[0] = acc[0] | (1 << i)
                            top[0] = T.max(top[0], T.fabs(got[i]))
                        out[j] = T.Cast("uint8", acc[0])
                        part[j] = top[0]

    return main
