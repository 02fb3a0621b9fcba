"""tvm_qconv: an int8 compiler for convolutional networks on Apache TVM, with a PyTorch training path.

Compile: :func:`tvm_qconv.build.compile_model`; run: :class:`tvm_qconv.runtime.CompiledModel`;
train: :mod:`tvm_qconv.nn` (int8 conv modules with a custom backward).  The kernels are in
:mod:`tvm_qconv.schedules`, picked through :mod:`tvm_qconv.registry`.
"""
import os

from .config import PRESETS, QuantConfig
from .errors import InputError

_NN = ("QuantizedConv2d", "QuantizedConv2dReLU", "TorchConv2d", "TorchConv2dReLU")

__all__ = ["PRESETS", "InputError", "QuantConfig", *_NN]

# schedules/ and models/ sit at the repository root (the user's layout) as tvm_qconv.schedules and
# .models: a wheel installs them in this folder (pyproject's package-dir).  In the source tree
# (PYTHONPATH=. on the GPU machine; the editable install) the root joins __path__, the import system's
# own list of where submodules are: found lazily, one module per file, no finder of ours.  It also
# reaches the root's other names (tvm_qconv.deploy, .tests), which nothing imports; putting the two
# subpackages in sys.modules instead would run models/__init__ (torch) on every `import tvm_qconv`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "schedules")) and os.path.isfile(os.path.join(_ROOT, "pyproject.toml")):
    __path__.append(_ROOT)


def __getattr__(name):
    # nn imports torch (~1-3 s) on first use: every CLI imports this package before parsing its arguments
    if name in _NN:
        from . import nn
        return getattr(nn, name)
    raise AttributeError(f"module 'tvm_qconv' has no attribute {name!r}")
