"""Moved to :mod:`tvm_qconv.frontend.onnx_qdq` (issue 57: the frontends in one package); this name
stays for code that imports it."""
from .frontend.onnx_qdq import *  # noqa: F401,F403
from .frontend.onnx_qdq import FileScales, file_scales, is_qdq, point_ranges, strip_qdq  # noqa: F401
