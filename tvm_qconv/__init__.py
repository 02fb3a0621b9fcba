"""tvm_qconv: an int8 compiler for convolutional networks on Apache TVM, with a PyTorch training path.

Compile: :func:`tvm_qconv.build.compile_model`; run: :class:`tvm_qconv.runtime.CompiledModel`;
train: :mod:`tvm_qconv.nn` (int8 conv modules with a custom backward).  The kernels are in
:mod:`tvm_qconv.schedules`, picked through :mod:`tvm_qconv.registry`.
"""
import importlib.abc
import importlib.util
import os
import sys

from .config import PRESETS, QuantConfig
from .errors import InputError

_NN = ("QuantizedConv2d", "QuantizedConv2dReLU", "TorchConv2d", "TorchConv2dReLU")

__all__ = ["PRESETS", "InputError", "QuantConfig", *_NN]

# The user's layout keeps schedules/ and models/ at the repository root; pyproject's
# package-dir installs them as tvm_qconv.schedules / tvm_qconv.models (never as top-level
# packages, whose names other projects use too).  From a source tree that is not installed
# (PYTHONPATH=., as on the GPU machine) this finder gives the same two names the same folders.
_SOURCE_PACKAGES = ("schedules", "models")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        folder = os.path.join(_ROOT, name)
        if parent != __name__ or name not in _SOURCE_PACKAGES or not os.path.isdir(folder):
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    sys.meta_path.append(_SourceTreeFinder())


def __getattr__(name):
    # The torch modules load on first use: ``deploy.py run`` needs the TVM runtime only.
    if name in _NN:
        from . import nn
        return getattr(nn, name)
    raise AttributeError(f"module 'tvm_qconv' has no attribute {name!r}")
