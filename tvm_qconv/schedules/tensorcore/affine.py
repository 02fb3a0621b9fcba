"""The affine (inference BatchNorm, ``affine_int8.py``) of the NHWC32 layout on CUDA, written out:
each thread takes 16 channels (one 128-bit vector) of up to ``MAX_PIXELS`` pixels, with their
multipliers, shifts and biases loaded once into registers; the concatenated inputs of DenseNet's
BatchNorm (``AffineWorkload.inputs``) are read in place, the input chosen once per vector.

Why not the elementwise schedule (``elementwise_int8.schedule_elementwise``): over a concat's inputs
its compute picks each byte's input through a chain of selects, one per input, and loads it
alone, and every byte loads its three int32 parameters: DenseNet-121's 62 affines ran at ~0.3 TB/s
on an H100 (3.77 of 5.76 ms of kernels at batch 64, ``docs/results/kernel_profile_densenet121_b64_
h100_concat_in_affine.json``).  Here a thread moves 16 bytes per load and store, and its 192 bytes
of parameters are read once for all its pixels.

Grid: the output is ``pixels x vectors`` (16 channels each); thread ``t`` takes vector ``t % V`` of
pixels ``q, q + Q, ..., q + (P - 1) Q`` with ``q = t // V`` and ``Q = ceil(pixels / P)``, so a warp
reads and writes consecutive 16-byte runs of each pixel row and consecutive rows.  ``P`` is the
largest of 1..MAX_PIXELS that leaves ``MIN_THREADS`` threads (a small batch keeps every SM busy).

Takes: every input's channels a multiple of 16 (a vector then lies in one input; DenseNet's are
multiples of 32), indices within int32.  Anything else keeps the elementwise schedule.  The
arithmetic is the compute definition's, so CUDA and CPU builds agree bit for bit.
"""
from __future__ import annotations

import tvm

from ..kernel import parse_written_kernel
from ..workload import AffineWorkload
from .layout import ceil32

VEC = 16             # channels per vector: one 128-bit load
THREADS = 256
MAX_PIXELS = 8
MIN_THREADS = 65536  # 132 SMs x ~500: below it a larger P would leave SMs idle


def channel_runs(wl: AffineWorkload) -> list[tuple[int, int]] | None:
    """Per input: (its real channels, its row length in bytes); None where a vector would straddle
    two inputs (a channel count not a multiple of 16)."""
    cp = wl.shape[-1]
    if not wl.inputs:
        return [(cp, cp)]
    if any(c % VEC for c in wl.inputs):
        return None
    return [(c, ceil32(c)) for c in wl.inputs]


def pixels_per_thread(threads_at_one: int) -> int:
    """P: as many pixels per thread as keep at least ``MIN_THREADS`` threads, 1..MAX_PIXELS."""
    return max(1, min(MAX_PIXELS, threads_at_one // MIN_THREADS))


def affine_kernel(wl: AffineWorkload) -> tvm.tirx.PrimFunc | None:
    """The kernel for ``wl`` (NHWC32 packed shape ``[N, H, W, C_p]``), or None where it does not
    apply (module docstring)."""
    runs = channel_runs(wl)
    n, h, w, cp = wl.shape
    pixels = n * h * w
    if runs is None or pixels * max(cp, *(row for _, row in runs)) >= 2 ** 31:
        return None
    vectors = cp // VEC
    p = pixels_per_thread(vectors * pixels)
    groups = -(-pixels // p)          # Q: pixel groups, one thread's pixels q + j * Q
    threads = vectors * groups
    blocks = -(-threads // THREADS)

    params, flat, loads = [], [], []
    start = 0                          # first vector of the input
    for i, (c, row) in enumerate(runs):
        params.append(f'X{i}: T.Buffer(({n}, {h}, {w}, {row}), "int8", align=16)')
        flat.append(f'x{i} = T.decl_buffer(({pixels * row},), "int8", data=X{i}.data, align=16)')
        loads.append((start + c // VEC, f"x{i}[px * {row} + (v - {start}) * {VEC} + l]"))
        start += c // VEC
    # the vector's input: an if-chain over the inputs' last vectors; past the last input (the
    # output's padded channels) the byte is 0, which the padded parameters (0, 1, 0) keep at out_zero
    # (stored byte by byte: a vectorized int8 constant prints as a make_int4 of 16 values)
    chain, indent = [], " " * 24
    for k, (end, load) in enumerate(loads):
        chain += [f"{indent}{'if' if k == 0 else 'elif'} v < {end}:",
                  f"{indent}    for l in T.vectorized({VEC}):", f"{indent}        xv[l] = {load}"]
    chain += [f"{indent}else:", f"{indent}    for l in T.unroll({VEC}):", f"{indent}        xv[l] = T.int8(0)"]
    chain = "\n".join(chain)
    params = ",\n         ".join(params)
    flat = "\n    ".join(flat)
    src = f'''
@T.prim_func(private=True)
def main({params},
         Mult: T.Buffer(({cp},), "int32", align=16), Shift: T.Buffer(({cp},), "int32", align=16),
         Bias: T.Buffer(({cp},), "int32", align=16), Out: T.Buffer(({n}, {h}, {w}, {cp}), "int8", align=16)):
    T.func_attr({{"tir.noalias": True}})
    {flat}
    y = T.decl_buffer(({pixels * cp},), "int8", data=Out.data, align=16)
    for bx in T.thread_binding({blocks}, thread="blockIdx.x"):
        for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):
            m = T.alloc_buffer(({VEC},), "int32", scope="local")
            s = T.alloc_buffer(({VEC},), "int32", scope="local")
            b = T.alloc_buffer(({VEC},), "int32", scope="local")
            xv = T.alloc_buffer(({VEC},), "int8", scope="local")
            yv = T.alloc_buffer(({VEC},), "int8", scope="local")
            if bx * {THREADS} + tx < {threads}:
                v = (bx * {THREADS} + tx) % {vectors}
                q = (bx * {THREADS} + tx) // {vectors}
                for a in T.unroll({VEC // 4}):
                    for l in T.vectorized(4):
                        m[a * 4 + l] = Mult[v * {VEC} + a * 4 + l]
                        s[a * 4 + l] = Shift[v * {VEC} + a * 4 + l]
                        b[a * 4 + l] = Bias[v * {VEC} + a * 4 + l]
                for j in T.unroll({p}):
                    px = q + j * {groups}
                    if px < {pixels}:
{chain}
                        for l in T.unroll({VEC}):
                            yv[l] = T.Cast("int8", T.max(T.min(T.shift_right(
                                T.Cast("int32", xv[l]) * m[l] + b[l] + T.shift_left(1, s[l] - 1), s[l])
                                + {wl.out_zero}, {wl.act_max}), {wl.act_min}))
                        for l in T.vectorized({VEC}):
                            y[px * {cp} + v * {VEC} + l] = yv[l]
'''
    return parse_written_kernel(src)
