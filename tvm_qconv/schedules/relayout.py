"""int8 -> int8 layout conversion between two kernel families' layouts (e.g. NCHW4c -> NHWC).

The quantize pass inserts one only where a tensor's producer and consumer chose kernels of
different layouts; both sides share the tensor's scale, so this is a pure permutation (padded
channels of the destination are 0).  Written from the layouts' index maps
(``Layout.to_logical`` / ``to_packed``), so any pair of registered layouts converts; the
registry's ``relayout`` implementations (``conversion_kernels.py``) are made from it.
"""
from __future__ import annotations

from tvm import te, tirx

from .kernel import Layout, tagged
from .workload import RelayoutWorkload

KERNEL_NAME = "relayout_int8"


def relayout_compute(src: Layout, dst: Layout, shape: tuple[int, int, int, int]) -> tirx.PrimFunc:
    """Kernel: int8 ``src``-packed tensor of logical NCHW ``shape`` -> int8 ``dst``-packed."""
    n, c, h, w = shape
    x = te.placeholder(src.packed_shape(shape), "int8", name="X")

    def body(*index):
        b, ch, y, xx = dst.to_logical(index)
        read = x[src.to_packed(b, tirx.min(ch, c - 1), y, xx)]
        return tirx.if_then_else(ch < c, read, tirx.const(0, "int8"))

    out = te.compute(dst.packed_shape(shape), body, name="relayout")
    return te.create_prim_func([x, out]).with_attr(
        {"tvm_qconv.kernel": KERNEL_NAME, "tvm_qconv.relayout": f"{src.name}->{dst.name}"})


def relayout_name(src: Layout, dst: Layout) -> str:
    """The registry name of the relayout from ``src`` to ``dst`` (``conversion_kernels.Relayout``)."""
    return f"relayout.{src.name.lower()}_to_{dst.name.lower()}.generic"


def relayout_int8(src: Layout, dst: Layout, shape: tuple[int, int, int, int]) -> tirx.PrimFunc:
    """The registry's ``relayout`` kernel from ``src`` to ``dst`` (:func:`relayout_compute`, tagged
    as that implementation tags it); kept for callers that do not ask the registry yet::

        registry.select("relayout", RelayoutWorkload(shape, src.name, dst.name), target).compute(wl)
    """
    wl = RelayoutWorkload(shape, src.name, dst.name)
    return tagged(relayout_compute(src, dst, shape), relayout_name(src, dst), wl)
