"""Test helpers: conv workloads written as the old positional tuple, plus groups; random layer data."""
import numpy as np

from tvm_qconv.schedules.requantize import quantize_multiplier
from tvm_qconv.schedules.workload import ConvWorkload


def conv_wl(batch, in_channels, height, width, out_channels, kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1),
            dilation=(1, 1), relu=True, groups=1, out_dtype="int8") -> ConvWorkload:
    """A ConvWorkload with ReLU (``relu=True``) or no activation."""
    return ConvWorkload.with_activation("relu" if relu else "none", batch=batch, in_channels=in_channels,
                                        height=height, width=width, out_channels=out_channels, kernel=kernel,
                                        stride=stride, padding=padding, dilation=dilation, groups=groups,
                                        out_dtype=out_dtype)


def random_conv_args(wl: ConvWorkload, seed=0):
    """Unpacked random int8 input (NCHW) and weight (OIHW), int32 bias and requantize multipliers
    that spread the outputs over the int8 range: ``(x, w, bias, mult, shift)``."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = rng.integers(-127, 128, (wl.out_channels, wl.in_channels, *wl.kernel)).astype(np.int8)
    bias = rng.integers(-(1 << 14), 1 << 14, wl.out_channels).astype(np.int32)
    k = wl.in_channels * wl.kernel[0] * wl.kernel[1]
    mult, shift = quantize_multiplier(100.0 / (128 * 128 * np.sqrt(k) / 3) * rng.uniform(0.5, 2.0, wl.out_channels))
    return x, w, bias, mult, shift


def slow_requantize_args(wl: ConvWorkload, seed=0):
    """Like :func:`random_conv_args`, but data on which a CUDA epilogue must keep the 64-bit
    requantize (``requantize_i32_ok`` false for some channels): multipliers in [1/4, 1) (shift <=
    32) on even channels and a bias beyond 2**30 on channel 1, with inputs and weights in {-1, 0, 1}
    so that most outputs still land inside the int8 range instead of clipping."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = rng.integers(-1, 2, (wl.out_channels, wl.in_channels, *wl.kernel)).astype(np.int8)
    bias = rng.integers(-20, 21, wl.out_channels).astype(np.int32)
    bias[1] = (1 << 30) + 5
    even = np.arange(wl.out_channels) % 2 == 0
    m = np.where(even, rng.uniform(0.26, 0.99, wl.out_channels), rng.uniform(0.01, 0.2, wl.out_channels))
    mult, shift = quantize_multiplier(m * 16 / np.sqrt(wl.in_channels * wl.kernel[0] * wl.kernel[1]))
    assert shift[even].min() <= 32 or not even.any(), shift
    return x, w, bias, mult, shift
