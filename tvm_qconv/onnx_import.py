"""Moved to :mod:`tvm_qconv.frontend.onnx_model` (issue 57: the frontends in one package); this
name stays for code that imports it."""
from .frontend.onnx_model import OnnxExported, OnnxModel, is_onnx_path  # noqa: F401
