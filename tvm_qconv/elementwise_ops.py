"""The elementwise operators a lookup-table region may hold: one table, read by everything that
handles such a region.

    graph.py          which Relax ops a ``lut`` layer's region may take (``ELEMENTWISE``)
    lut_table.py      each op in NumPy, to tabulate the region on its 256 input values
    lowering/onnx.py  each op as ONNX: the node named here, or ``ONNXEmitter.op_<name>`` (a composite)

Adding an op is one row here (and an ``op_<name>`` method where ONNX has no single node for it);
``tests/test_elementwise_ops.py`` runs every row's ONNX form in ONNX Runtime against its NumPy form,
so no op can be tabulated and not exported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

_ERF = np.vectorize(math.erf, otypes=[np.float64])


@dataclass(frozen=True)
class ElementwiseOp:
    """One operator of a table region.

    Attributes:
        name: the Relax op (``relax.sigmoid``).
        operands: how many of the call's arguments it reads (a clip: its tensor and two bounds).
        numpy: its float64 NumPy form, on those operands (arrays or Python scalars).
        onnx: the ONNX operator with the same operands, or None where the ONNX lowering writes a
            composite (``ONNXEmitter.op_<name>``: silu, the gelus, clip's bounds as inputs).
    """

    name: str
    operands: int
    numpy: Callable
    onnx: str | None


OPS: dict[str, ElementwiseOp] = {op.name: op for op in (
    ElementwiseOp("relax.sigmoid", 1, lambda x: 1.0 / (1.0 + np.exp(-x)), "Sigmoid"),
    ElementwiseOp("relax.tanh", 1, np.tanh, "Tanh"),
    ElementwiseOp("relax.nn.silu", 1, lambda x: x / (1.0 + np.exp(-x)), None),
    ElementwiseOp("relax.nn.gelu", 1, lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))), None),
    ElementwiseOp("relax.nn.gelu_tanh", 1,
                  lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))), None),
    ElementwiseOp("relax.nn.relu", 1, lambda x: np.maximum(x, 0.0), "Relu"),
    ElementwiseOp("relax.clip", 3, np.clip, None),
    ElementwiseOp("relax.negative", 1, np.negative, "Neg"),
    ElementwiseOp("relax.exp", 1, np.exp, "Exp"),
    ElementwiseOp("relax.erf", 1, _ERF, "Erf"),
    ElementwiseOp("relax.add", 2, np.add, "Add"),
    ElementwiseOp("relax.subtract", 2, np.subtract, "Sub"),
    ElementwiseOp("relax.multiply", 2, np.multiply, "Mul"),
    ElementwiseOp("relax.divide", 2, np.divide, "Div"),
    ElementwiseOp("relax.minimum", 2, np.minimum, "Min"),
    ElementwiseOp("relax.maximum", 2, np.maximum, "Max"),
)}

ELEMENTWISE: tuple[str, ...] = tuple(OPS)
