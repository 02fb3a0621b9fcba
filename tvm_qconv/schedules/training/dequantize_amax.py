"""The training path's ``dequantize`` from NHWC32 that also writes its output's range: each thread
dequantizes 8 channels of a pixel (scale, bias, ReLU: ``elementwise.dequantize``, the same bits)
and writes the bits of ``max |out|`` over them to ``part`` (int32 ``[N, C / 8, H, W]``,
``elementwise.abs_bits``: an integer max, exact where a float max under --use_fast_math flushes
subnormals and drops NaN), so ``part.amax().view(float32)`` is ``batch_amax(out)``.

Why: every int8 layer observes its float output's range each training step (its record, and the
next layer's quantization range where the output is the next input), which was one more pass over
the output in torch (``aminmax``, 4 bytes an element read): VGG16's 13 conv outputs at batch 128,
~1.2 ms of its step's 2.9 ms of range reductions, ResNet-50's 53 about half of its 3.5 ms at batch
128 (H200, 2026-11-29, the profiles in performance.md).  Here the range costs a write of half a
byte an element and a reduction reading it back.

Written as scheduled S-TIR (``tensorcore/pool.py`` says why not TIRx); the threads as
``elementwise``'s staged ``dequantize`` (consecutive threads on consecutive pixels: coalesced NCHW
stores; 8 channels a thread, two 16-byte loads of the accumulators).  ``tests/test_grad_kernels.py``
runs it on a CPU twin against ``elementwise.dequantize``'s compute.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..tensorcore.layout import ceil32
from .elementwise_bits import ABS_BITS
from .exact_float import exact

CHANNELS = 8        # a thread's channels of one pixel: one 32-byte sector of int32 accumulators
THREADS = 256


def supports(wl) -> bool:
    """NHWC32 accumulators and whole 8-channel groups."""
    return wl.kind == "dequantize" and wl.layout == "nhwc32" and wl.shape[1] % CHANNELS == 0


def dequantize_amax_kernel(wl, rn: bool = True):
    """The CUDA kernel of ``elementwise.dequantize(wl, rn)`` with ``wl.amax`` (same parameters, same
    bits); ``rn``: CUDA's correctly rounded intrinsics (``False``: float64 rounded once, for the CPU
    twin)."""
    if not (supports(wl) and wl.amax):
        raise ValueError(f"dequantize_amax_kernel takes NHWC32 dequantizes of whole {CHANNELS}-channel groups "
                         f"with amax: {wl}")
    N, C, H, W = wl.shape
    CP, CV = ceil32(C), C // CHANNELS
    SC = C if wl.per_channel else 1
    TOTAL = N * CV * H * W
    GRID = (TOTAL + THREADS - 1) // THREADS
    BIAS, RELU = wl.bias, wl.relu
    S = 1 if wl.per_channel else 0      # the scale's stride: one per channel, or one

    def value(a, s, b):
        """``elementwise.dequantize``'s element: ``a * s [+ b]``, ReLU, correctly rounded."""
        v = exact("*", a.astype("float32"), s, rn)
        if b is not None:
            v = exact("+", v, b, rn)
        return tirx.max(v, tirx.const(0.0, "float32")) if RELU else v

    @T.macro
    def body(acc, scale, bias, out, part):
        with T.sblock("root"):
            got = T.sblock_alloc_buffer((CHANNELS,), "int32", scope="local")
            val = T.sblock_alloc_buffer((CHANNELS,), "float32", scope="local")
            top = T.sblock_alloc_buffer((1,), "int32", scope="local")      # max |v|'s bits
            for cta in T.thread_binding(GRID, thread="blockIdx.x"):
                for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                    t = T.meta_var(cta * THREADS + tid)          # (image, channel group, row, column)
                    if t < TOTAL:
                        x = T.meta_var(t % W)
                        y = T.meta_var(t // W % H)
                        g = T.meta_var(t // (W * H) % CV)
                        b = T.meta_var(t // (W * H * CV))
                        for h in T.unroll(2):
                            for l in T.vectorized(CHANNELS // 2):
                                got[h * 4 + l] = acc[b, y, x, g * CHANNELS + h * 4 + l]
                        top[0] = 0
                        for l in T.unroll(CHANNELS):
                            c = T.meta_var(g * CHANNELS + l)
                            if BIAS:
                                val[l] = value(got[l], scale[c * S], bias[c])
                            else:
                                val[l] = value(got[l], scale[c * S], None)
                            out[b, c, y, x] = val[l]
                            top[0] = T.max(top[0], T.reinterpret("int32", val[l]) & ABS_BITS)
                        part[b, g, y, x] = top[0]

    if BIAS:
        @T.prim_func(s_tir=True, private=True)
        def main(acc: T.Buffer((N, H, W, CP), "int32", align=16), scale: T.Buffer((SC,), "float32"),
                 bias: T.Buffer((C,), "float32"), out: T.Buffer((N, C, H, W), "float32"),
                 part: T.Buffer((N, CV, H, W), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(acc, scale, bias, out, part)
    else:
        @T.prim_func(s_tir=True, private=True)
        def main(acc: T.Buffer((N, H, W, CP), "int32", align=16), scale: T.Buffer((SC,), "float32"),
                 out: T.Buffer((N, C, H, W), "float32"), part: T.Buffer((N, CV, H, W), "int32")):
            T.func_attr({"tirx.noalias": True})
            body(acc, scale, None, out, part)

    return main
