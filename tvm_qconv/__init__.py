"""tvm_qconv: an int8 compiler for convolutional networks on Apache TVM, with a PyTorch training path.

Compile: :func:`tvm_qconv.build.compile_model`; run: :class:`tvm_qconv.runtime.CompiledModel`;
train: :mod:`tvm_qconv.nn` (int8 conv modules with a custom backward).
"""
from .config import PRESETS, QuantConfig
from .errors import InputError

_NN = ("QuantizedConv2d", "QuantizedConv2dReLU", "TorchConv2d", "TorchConv2dReLU")

__all__ = ["PRESETS", "InputError", "QuantConfig", *_NN]


def __getattr__(name):
    # The torch modules load on first use: ``deploy.py run`` needs the TVM runtime only.
    if name in _NN:
        from . import nn
        return getattr(nn, name)
    raise AttributeError(f"module 'tvm_qconv' has no attribute {name!r}")
