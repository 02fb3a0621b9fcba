"""The quantization plan: where every decision of an int8 build is made, once.

    float graph (graph.py) + ranges (ranges/) + scheme (QuantConfig) + target + kernel chooser
      --plan_quantization (planner.py; one rule per operator family)--> QuantizationPlan (plan.py)
      --> lowering/relax.py (the TVM library)  |  lowering/onnx.py (ONNX Q/DQ)

The plan holds, for every layer, int8 or float and why, the kernel implementation, the scale,
zero point and layout of each int8 tensor it reads and writes, and its kernel's packed
arguments.  The backends read it and decide nothing, so a TVM library and an ONNX file of one
build agree layer by layer by construction, and an int8 operator is one planning rule here plus
one lowering per backend.  ``zero_points.py`` is the unsigned-activation policy, ``scales.py``
the scheme's numbers.
"""
from .plan import LayerPlan, QuantizationPlan, TensorQuant, TensorRead
from .planner import plan_quantization

__all__ = ["LayerPlan", "QuantizationPlan", "TensorQuant", "TensorRead", "plan_quantization"]
