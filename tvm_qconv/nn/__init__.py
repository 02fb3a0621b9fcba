"""PyTorch training path: int8 quantization-aware conv / linear layers and their float twins.

``from tvm_qconv.nn import QuantizedConv2dReLU`` is a drop-in ``nn.Conv2d`` + ReLU whose forward
runs in int8 and whose backward keeps int8 tensors (see :mod:`tvm_qconv.nn.functional`).
"""
from .functional import (
    QuantizedConv2dFunction,
    batch_amax,
    quantize_per_tensor,
    quantize_weight,
    quantized_conv2d,
    quantized_linear,
    register_int8_conv_kernel,
)
from .max_pool import CompactMaxPool2d
from .relu import CompactReLU
from .modules import (
    QuantizedConv2d,
    QuantizedConv2dReLU,
    QuantizedLinear,
    TorchConv2d,
    TorchConv2dReLU,
    TorchLinear,
    learned_amax,
    load_float_state_dict,
    set_range_records,
    to_float_state_dict,
)

__all__ = [
    "QuantizedConv2d",
    "QuantizedConv2dReLU",
    "QuantizedLinear",
    "TorchConv2d",
    "TorchConv2dReLU",
    "TorchLinear",
    "CompactMaxPool2d",
    "CompactReLU",
    "QuantizedConv2dFunction",
    "quantized_conv2d",
    "quantized_linear",
    "quantize_per_tensor",
    "quantize_weight",
    "batch_amax",
    "register_int8_conv_kernel",
    "learned_amax",
    "to_float_state_dict",
    "load_float_state_dict",
    "set_range_records",
]
