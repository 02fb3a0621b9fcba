"""The channel scale (squeeze-excite's gated multiply, ``scale_int8.py``) of the NHWC32 layout on CUDA,
written out: each thread takes 16 channels (one 128-bit vector) of up to ``MAX_PIXELS`` pixels of one
image, with the 16 factors computed once into registers.

Why not the elementwise schedule: it computes every byte's factor again -- for a gate table, a load
of the gate's int8 and one of the float table per byte -- and the float64 arithmetic with it; at
batch 64 on an H200 EfficientNet-B0's 16 scales ran at 1.3-1.5 TB/s, 238 of its 1,838 us of kernels
(``docs/results/kernel_profile_efficientnet_b0_b64_h200_tables_in_epilogues.json``).

The arithmetic is the compute definition's, bit for bit.  With a gate table (squeeze-excite's
sigmoid or hard-sigmoid) it is integer: each channel's fixed-point factor ``T[Q + 128]`` is loaded once
and every byte costs a multiply-add and a shift (``scale_int8.py``).  With a float gate it is float64:
there ``v = (x - z_x) * g`` is exact (a 9-bit integer times a float32), ``v * m`` rounds once, and
``* 2**e`` is exact.  Here the factor ``f = g * m * 2**e`` is formed once per channel, exactly (a 24-bit
float32 mantissa times a 24-bit integer fits float64's 53 bits, and a power of two only moves the
exponent), and ``(x - z_x) * f`` rounds once: the same exact product ``(x - z_x) * g * m * 2**e``
rounded to float64, since scaling by a power of two commutes with rounding.  The rest (``nearbyint``,
the zero point, the clamp, 0 on the padded channels) is the compute's.  The float64 form is bound by
its conversions (three a byte, at 16 a clock per SM), which is why the gate table went to fixed point.

Grid: image ``n``, vector ``v`` (16 channels) and pixel group ``q`` per thread: thread ``t`` takes
vector ``t % V`` of pixels ``q, q + Q, ..., q + (P - 1) Q`` of its image, ``Q = ceil(HW / P)``; ``P``
the largest of 1..MAX_PIXELS that leaves ``MIN_THREADS`` threads.
"""
from __future__ import annotations

import tvm

from ..kernel import parse_written_kernel
from ..scale_int8 import rescale_parts
from ..workload import ScaleWorkload
from .affine import MAX_PIXELS, MIN_THREADS, THREADS, VEC
from .layout import ceil32


def scale_kernel(wl: ScaleWorkload) -> tvm.tirx.PrimFunc | None:
    """The kernel for ``wl`` (NHWC32 ``[N, H, W, C_p]``), same arguments as ``scale_int8``'s compute:
    ``(X, Q, T, Out)`` with a gate table, ``(X, G, Out)`` without; None where indices would pass int32."""
    n, h, w = wl.shape
    cp, hw = ceil32(wl.channels), h * w
    if n * hw * cp >= 2 ** 31:
        return None
    vectors = cp // VEC
    p = max(1, min(MAX_PIXELS, n * hw * vectors // MIN_THREADS))
    groups = -(-hw // p)               # Q: pixel groups of an image, one thread's pixels q + j * Q
    threads = n * groups * vectors
    blocks = -(-threads // THREADS)
    c = wl.channels
    lo = -127 if wl.out_zero == 0 else -128
    if wl.gate_table:   # integer: the channel's fixed-point factor, then a multiply-add and a shift
        s = wl.gate_shift
        gate_params = f'Q: T.Buffer(({n}, 1, 1, {cp}), "int8"), T_: T.Buffer((256,), "int32"),'
        factor_dtype = "int32"
        factor = f'T_[T.Cast("int32", Q[b, 0, 0, T.min(v * {VEC} + l, {c - 1})]) + 128]'
        value = (f'T.shift_right((T.Cast("int32", xv[l]) - {wl.in_zero}) * f[l] + {1 << (s - 1)}, {s}) '
                 f'+ {wl.out_zero}')
        clamp = f"T.max(T.min({value}, 127), {lo})"
    else:               # float64: the factor g * m * 2**e, exact (module docstring)
        m, e = rescale_parts(wl.rescale)
        # by or through a power of two of at least 1, as the compute does: an integer, printed exactly
        power = f"* T.float64({2.0 ** e!r})" if e >= 0 else f"/ T.float64({2.0 ** -e!r})"
        gate_params = f'G: T.Buffer(({n}, {c}, 1, 1), "float32"),'
        factor_dtype = "float64"
        factor = f'T.Cast("float64", G[b, T.min(v * {VEC} + l, {c - 1}), 0, 0]) * T.float64({m}) {power}'
        clamp = (f"T.max(T.min(T.nearbyint((T.Cast(\"float64\", xv[l]) - T.float64({wl.in_zero})) * f[l]) "
                 f"+ T.float64({wl.out_zero}), T.float64(127)), T.float64({lo}))")
    src = f'''
@T.prim_func(private=True)
def main(X: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16), {gate_params}
         Out: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16)):
    T.func_attr({{"tir.noalias": True}})
    x = T.decl_buffer(({n * hw * cp},), "int8", data=X.data, align=16)
    y = T.decl_buffer(({n * hw * cp},), "int8", data=Out.data, align=16)
    for bx in T.thread_binding({blocks}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            f = T.alloc_buffer(({VEC},), "{factor_dtype}", scope="local")
            xv = T.alloc_buffer(({VEC},), "int8", scope="local")
            yv = T.alloc_buffer(({VEC},), "int8", scope="local")
            if bx * {THREADS} + tx < {threads}:
                v = (bx * {THREADS} + tx) % {vectors}
                q = (bx * {THREADS} + tx) // {vectors} % {groups}
                b = (bx * {THREADS} + tx) // {vectors * groups}
                for l in T.unroll({VEC}):
                    f[l] = {factor}
                for j in T.unroll({p}):
                    px = q + j * {groups}
                    if px < {hw}:
                        for l in T.vectorized({VEC}):
                            xv[l] = x[(b * {hw} + px) * {cp} + v * {VEC} + l]
                        for l in T.unroll({VEC}):
                            yv[l] = T.if_then_else(v * {VEC} + l < {c}, T.Cast("int8", {clamp}), T.int8(0))
                        for l in T.vectorized({VEC}):
                            y[(b * {hw} + px) * {cp} + v * {VEC} + l] = yv[l]
'''
    return parse_written_kernel(src)
