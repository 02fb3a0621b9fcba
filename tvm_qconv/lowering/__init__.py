"""The backends of a quantization plan (``tvm_qconv/quantization``): ``relax.py`` lowers it to the
int8 Relax module the TVM library is compiled from, ``onnx.py`` writes it as an ONNX graph with
QuantizeLinear / DequantizeLinear.  Neither decides anything the plan does not say."""
from .relax import LowerToRelax

__all__ = ["LowerToRelax"]
