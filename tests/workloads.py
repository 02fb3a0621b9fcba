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
