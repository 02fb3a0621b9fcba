"""tvm_qconv: an int8 compiler for convolutional networks on Apache TVM, with a PyTorch training path.

The public API, importable from here (docs/usage.md, "Console scripts and Python API")::

    import tvm_qconv
    res = tvm_qconv.compile_model("resnet18", "r18.so", options=tvm_qconv.BuildOptions(target="llvm"),
                                  config=tvm_qconv.PRESETS["int8"])
    logits = tvm_qconv.CompiledModel(res.lib_path)(tvm_qconv.skimage_photos(224)[:1])

Compile: :func:`compile_model` (:mod:`tvm_qconv.build`) with :class:`BuildOptions`, a
:class:`QuantConfig` (or a named preset of :data:`PRESETS`) and a range source such as
:class:`Calibrate`; run: :class:`CompiledModel`; export: :func:`export_onnx`; train:
:mod:`tvm_qconv.nn` (int8 conv modules with a custom backward).  The kernels are in
:mod:`tvm_qconv.schedules`, picked through :mod:`tvm_qconv.registry`; the console scripts in
:mod:`tvm_qconv.cli`.
"""
from .config import PRESETS, QuantConfig
from .errors import InputError
from .lazy import lazy_exports
from .moved import install as _install_moved_paths

_install_moved_paths()   # the module paths issue 57 moved (tvm_qconv/moved.py)

# Name -> the module it lives in, imported on first use (PEP 562): the compiler brings TVM and
# torch (~2-9 s), the nn modules torch, scikit-image's photos scikit-image, and every console
# script imports this package before parsing its flags (--help answers in ~0.1 s).
_LAZY = {
    "compile_model": "build", "BuildOptions": "build",
    "Calibrate": "ranges.sources",
    "CompiledModel": "runtime.compiled_model",
    "export_onnx": "onnx_export",
    "skimage_photos": "data",
    **dict.fromkeys(("QuantizedConv2d", "QuantizedConv2dReLU", "TorchConv2d", "TorchConv2dReLU"), "nn"),
}

__all__ = ["PRESETS", "InputError", "QuantConfig", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())   # (tvm_qconv/lazy.py)
