"""The conversion kernels, as registry implementations: where int8 meets float, and where two
kernel families' layouts meet.

=================  ========================  ===============================================
op                 workload                  kernel
=================  ========================  ===============================================
``quantize``       ``QuantizeWorkload``      float NCHW -> int8 in a layout (the model input,
                                             a float op's output read by an int8 layer)
``dequantize``     ``DequantizeWorkload``    int8 in a layout -> float NCHW (before the
                                             classifier's flatten, an op with no int8 kernel)
``relayout``       ``RelayoutWorkload``      int8 in layout A -> int8 in layout B (a family
                                             boundary; the same scale on both sides)
``quantize_rows``  ``QuantizeRowsWorkload``  a linear layer's float input [N, K] -> int8
                                             rows [N, K_p], K zero-padded as its dense
                                             kernel reads
=================  ========================  ===============================================

The workloads are in ``workload.py``.  Quantize and dequantize have one implementation per
layout, made with the layout (``nchw4c/layout.py``, ``tensorcore/layout.py``: so its
``Layout.quantize`` computes the registered kernel) from its compute definitions and its family's
own CUDA schedule, if any; a relayout has one per ordered pair of registered layouts
(:func:`relayout_kernels`, written from the layouts' index maps: ``relayout.py``);
``quantize_rows`` one for all (``dense_int8.QUANTIZE_ROWS``, made there with its compute).
Family ``generic``: every target runs them.  None has a search space, so none is ever a tuning
task.  The classes are here and the objects with their computes, so that this module imports
none of the modules that make them.

Each keeps the name its kernel always had (``tvm_qconv.kernel``: ``quantize_pack``,
``dequantize_unpack_nhwc32``, ``relayout_int8``...), which is the Relax function's name and what
the build report's schedule list calls it (:meth:`Conversion.label`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import tirx

from .kernel import KERNEL_ATTR, KernelImpl, Layout, no_constants
from .quantize import quantize_clamp, quantize_ref
from .relayout import relayout_compute, relayout_name
from .workload import DequantizeWorkload, QuantizeRowsWorkload, QuantizeWorkload, RelayoutWorkload

# A schedule of one conversion kernel: (func, target) -> scheduled PrimFunc, or None (dlight / unscheduled)
Schedule = Callable[[tirx.PrimFunc, tvm.target.Target], "tirx.PrimFunc | None"]


class Conversion(KernelImpl):
    """A conversion kernel: runs on every target, has no constants and no search space.

    Attributes:
        kernel: the name its compute gives the PrimFunc (``tvm_qconv.kernel``).
    """

    family = "generic"
    kernel: str = ""

    def __init__(self, schedule: Schedule | None = None):
        self._schedule = schedule

    def applies(self, wl, target) -> bool:
        return True

    def pack_params(self, wl, *arrays) -> list[np.ndarray]:
        """None: a conversion's only argument is the tensor it converts."""
        return no_constants(self, arrays)

    def schedule(self, func, target):
        return self._schedule(func, target) if self._schedule is not None else None

    def label(self, func) -> str:
        """The kernel's own name, as the build report named conversions before they were
        implementations (``quantize_pack``, ``relayout_int8``)."""
        return str(func.attrs[KERNEL_ATTR])


class Quantize(Conversion):
    """float NCHW -> int8 in ``packing``, by ``compute(shape, scale, zero)``: the layout's own
    definition (``nchw4c/layout.py``'s ``quantize_pack``), kept as it was."""

    op = "quantize"

    def __init__(self, packing: Layout, kernel: str, compute: Callable[..., tirx.PrimFunc],
                 schedule: Schedule | None = None):
        super().__init__(schedule)
        self.packing, self.layout, self.kernel = packing, packing.name, kernel
        self.name = f"quantize.{packing.name.lower()}.generic"
        self._compute = compute

    def compute(self, wl: QuantizeWorkload):
        return self.tag(self._compute(wl.shape, wl.scale, wl.zero), wl)

    def reference(self, wl: QuantizeWorkload, x: np.ndarray) -> np.ndarray:
        return self.packing.pack(quantize_ref(x, wl.scale, *quantize_clamp(wl.zero)))

    def out_shape(self, wl: QuantizeWorkload) -> tuple[int, ...]:
        return tuple(self.packing.packed_shape(wl.shape))


class Dequantize(Conversion):
    """int8 in ``packing`` -> float NCHW, by ``compute(packed_shape, channels, scale, zero)``."""

    op = "dequantize"

    def __init__(self, packing: Layout, kernel: str, compute: Callable[..., tirx.PrimFunc],
                 schedule: Schedule | None = None):
        super().__init__(schedule)
        self.packing, self.layout, self.kernel = packing, packing.name, kernel
        self.name = f"dequantize.{packing.name.lower()}.generic"
        self._compute = compute

    def compute(self, wl: DequantizeWorkload):
        return self.tag(self._compute(wl.packed_shape, wl.channels, wl.scale, wl.zero), wl)

    def reference(self, wl: DequantizeWorkload, q: np.ndarray) -> np.ndarray:
        # (q - zero) * float32(scale) in float64 is exact (8 x 24 bits): one rounding, the kernel's
        v = self.packing.unpack(q, wl.channels).astype(np.float64) - wl.zero
        return (v * np.float64(np.float32(wl.scale))).astype(np.float32)

    def out_shape(self, wl: DequantizeWorkload) -> tuple[int, ...]:
        n, _, h, w = self.packing.logical_shape(wl.packed_shape)
        return (n, wl.channels, h, w)


class Relayout(Conversion):
    """int8 in ``src`` -> int8 in ``dst`` (``relayout.py``): reads ``src``, writes ``dst`` (its
    :attr:`layout`), so a registry query by layout finds the relayout *into* that layout."""

    op = "relayout"
    kernel = "relayout_int8"

    def __init__(self, src: Layout, dst: Layout):
        super().__init__()
        self.src, self.dst = src, dst
        self.layout, self.in_layout = dst.name, src.name
        self.name = relayout_name(src, dst)

    def applies(self, wl: RelayoutWorkload, target) -> bool:
        return (wl.src, wl.dst) == (self.src.name, self.dst.name)

    def compute(self, wl: RelayoutWorkload):
        return self.tag(relayout_compute(self.src, self.dst, wl.shape), wl)

    def reference(self, wl: RelayoutWorkload, x: np.ndarray) -> np.ndarray:
        return self.dst.pack(self.src.unpack(x, wl.shape[1]))

    def out_shape(self, wl: RelayoutWorkload) -> tuple[int, ...]:
        return tuple(self.dst.packed_shape(wl.shape))


def relayout_kernels(layouts) -> tuple[Relayout, ...]:
    """A relayout for every ordered pair of distinct ``layouts`` (Layout objects)."""
    layouts = list(layouts)
    return tuple(Relayout(src, dst) for src in layouts for dst in layouts if src is not dst)


class QuantizeRows(Conversion):
    """A linear layer's float input [N, K] -> int8 rows [N, K_p], by ``compute(shape, scale,
    k_padded, zero)`` (``dense_int8.quantize_rows_compute``)."""

    name = "quantize_rows.rows.generic"
    op = "quantize_rows"
    layout = "rows"
    kernel = "quantize_rows"

    def __init__(self, compute: Callable[..., tirx.PrimFunc]):
        super().__init__()
        self._compute = compute

    def compute(self, wl: QuantizeRowsWorkload):
        return self.tag(self._compute(wl.shape, wl.scale, wl.k_padded, wl.zero), wl)

    def reference(self, wl: QuantizeRowsWorkload, x: np.ndarray) -> np.ndarray:
        out = np.zeros(self.out_shape(wl), np.int8)
        out[:, :wl.shape[1]] = quantize_ref(x, wl.scale, *quantize_clamp(wl.zero))
        return out

    def out_shape(self, wl: QuantizeRowsWorkload) -> tuple[int, ...]:
        return (wl.shape[0], wl.k_padded)
