"""Test helper: conv workloads written as the old positional tuple, plus groups."""
from tvm_qconv.schedules.workload import ConvWorkload


def conv_wl(batch, in_channels, height, width, out_channels, kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1),
            dilation=(1, 1), relu=True, groups=1, out_dtype="int8") -> ConvWorkload:
    """A ConvWorkload with ReLU (``relu=True``) or no activation."""
    return ConvWorkload.with_activation("relu" if relu else "none", batch=batch, in_channels=in_channels,
                                        height=height, width=width, out_channels=out_channels, kernel=kernel,
                                        stride=stride, padding=padding, dilation=dilation, groups=groups,
                                        out_dtype=out_dtype)
