"""The kernel registry: every kernel implementation the project has, and how one is picked.

Open this first.  An implementation (``tvm_qconv.schedules.kernel.KernelImpl``) is one way to
run one op: compute definition, NumPy reference, default schedule, search spaces, tuning seed,
and the layout of the int8 activations it reads and writes.  The quantize pass asks
:func:`select` which implementation runs each layer on the build's target (so a layer's
activation layout is the chosen kernel's), the schedule pass and the tuner look the chosen one
up by the name it left on the PrimFunc (:func:`of_func`), and the training path asks for its
conv and gradient kernels the same way.  Nothing outside ``schedules/`` names a family
(``tests/test_structure.py`` checks it).

The conversions the pass inserts (quantize, dequantize, relayout, a linear layer's input rows)
are implementations too, picked the same way::

    wl = QuantizeWorkload(shape, scale, zero)
    impl = registry.select("quantize", wl, target, layout="NHWC32")
    func, shape = impl.compute(wl), impl.out_shape(wl)   # the PrimFunc (its tvm_qconv.impl set)

Adding a family is one folder under ``schedules/`` whose implementations are listed here.
"""
from __future__ import annotations

import tvm
from tvm import tirx as tvm_tirx
from tvm.s_tir import dlight as dl

from .schedules import dense_int8
from .schedules.conversion_kernels import relayout_kernels
from .schedules.kernel import KernelImpl, Layout, impl_name, tirx_kernel
from .schedules.nchw4c import impls as nchw4c
from .schedules.nchw4c import layout as nchw4c_layout
from .schedules.stem import impls as stem
from .schedules.tensorcore import impls as tensorcore
from .schedules.tensorcore import layout as tensorcore_layout
from .schedules.training import grad_input, grad_weight
from .schedules.wgmma import impls as wgmma
from .target import TargetInfo

LAYOUTS: dict[str, Layout] = {m.LAYOUT.name: m.LAYOUT for m in (nchw4c_layout, tensorcore_layout)}

# In priority order per op: select() takes the first that applies and is preferred untuned,
# unless told otherwise (a tuning database's measured pick).  For conv2d: depthwise (in the
# tensor cores' NHWC32 on sm_80+, where the convs around it run; else NCHW4c), then Hopper's
# wgmma (sm_90a), then int8 tensor cores (sm_80+, 16+ input channels), then the stem conv
# (sm_80+, 1-4 input channels: dp4a into the tensor cores' layout), then grouped convs as GEMMs on
# the tensor cores (sm_80+, groups of 16-32, 64 or 128 channels: measured faster there), then grouped
# convs in NHWC32 on dp4a (sm_80+, group widths a multiple of 4: no relayouts around them), then dp4a
# (CUDA), then the CPU kernel.
IMPLEMENTATIONS: tuple[KernelImpl, ...] = (
    tensorcore.CONV2D_DEPTHWISE,
    nchw4c.CONV2D_DEPTHWISE,
    wgmma.CONV2D_WGMMA,
    tensorcore.CONV2D_MMA,
    stem.CONV2D_STEM,
    tensorcore.CONV2D_GROUPED_MMA,
    tensorcore.CONV2D_GROUPED,
    *(impl for impl in nchw4c.IMPLEMENTATIONS if impl is not nchw4c.CONV2D_DEPTHWISE),
    *(impl for impl in tensorcore.IMPLEMENTATIONS
      if impl not in (tensorcore.CONV2D_MMA, tensorcore.CONV2D_DEPTHWISE, tensorcore.CONV2D_GROUPED,
                      tensorcore.CONV2D_GROUPED_MMA)),
    dense_int8.DENSE,
    grad_input.GRAD_INPUT,
    grad_weight.GRAD_WEIGHT,
    # The conversions the quantize pass inserts (``schedules/conversion_kernels.py``): float <->
    # int8 in each layout, int8 between every two layouts, a linear layer's input rows.  One
    # implementation per op and layout (pair), so select() takes it by ``layout=``; none has a
    # search space: never a tuning task (tunable()), always its own schedule or dlight's.
    nchw4c_layout.QUANTIZE, tensorcore_layout.QUANTIZE, nchw4c_layout.DEQUANTIZE, tensorcore_layout.DEQUANTIZE,
    *relayout_kernels(LAYOUTS.values()),
    dense_int8.QUANTIZE_ROWS,
)

_BY_NAME = {impl.name: impl for impl in IMPLEMENTATIONS}
assert len(_BY_NAME) == len(IMPLEMENTATIONS), "two implementations share a name"


def get(name: str) -> KernelImpl:
    """The implementation registered as ``name``.

    Raises:
        KeyError: no such implementation (the message lists the registered ones).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no kernel implementation {name!r}; registered: {sorted(_BY_NAME)}") from None


def of_func(func) -> KernelImpl | None:
    """The implementation a PrimFunc was made by (its ``tvm_qconv.impl`` attribute), or None."""
    name = impl_name(func)
    return None if name is None else get(name)


def candidates(op: str, wl, target: TargetInfo, layout: str | None = None) -> list[KernelImpl]:
    """Every implementation of ``op`` that runs ``wl`` on ``target`` (in ``layout`` if given),
    in priority order."""
    return [impl for impl in IMPLEMENTATIONS
            if impl.op == op and (layout is None or impl.layout == layout) and impl.applies(wl, target)
            and (impl.takes_table or not getattr(wl, "table", False))
            and (impl.takes_residual or not getattr(wl, "residual", ()))
            and (impl.takes_norm or not getattr(wl, "norm", ()))
            and (impl.takes_splits or getattr(wl, "splits", 1) == 1)]


def select(op: str, wl, target: TargetInfo, layout: str | None = None,
           prefer: str | None = None) -> KernelImpl | None:
    """The implementation that runs ``wl``: ``prefer`` (a name, e.g. from a tuning database)
    when it applies, else the first candidate that is ``preferred`` untuned (else the first);
    None when no implementation applies."""
    found = candidates(op, wl, target, layout)
    for impl in found:
        if impl.name == prefer:
            return impl
    return next((impl for impl in found if impl.preferred(wl, target)), found[0] if found else None)


def layout(name: str) -> Layout:
    """The activation layout called ``name``."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise KeyError(f"no layout {name!r}; registered: {sorted(LAYOUTS)}") from None


def tunable() -> list[KernelImpl]:
    """The implementations that have search spaces."""
    return [impl for impl in IMPLEMENTATIONS if impl.spaces]


def realize(mod, target):
    """A copy of ``mod`` with every function that a decision-only trace stands for replaced by
    its kernel (``KernelImpl.realize``: the wgmma family's tuning candidates); the tuner's
    builder calls it."""
    out = mod.clone()
    for gv, func in mod.functions.items():
        for impl in tunable():
            kernel = impl.realize(func, target) if isinstance(func, tvm_tirx.PrimFunc) else None
            if kernel is not None:
                out[gv] = tirx_kernel(func, kernel)
                break
    return out


def compile_options(impls=None) -> dict:
    """Merged ``tvm.compile`` options of ``impls`` (default: every implementation): the one
    custom TIR pipeline they need, if any, and their PassContext config entries."""
    pipeline, config = "default", {}
    for impl in IMPLEMENTATIONS if impls is None else impls:
        options = impl.compile_options()
        if not options:
            continue
        if options.get("tir_pipeline", "default") != "default":
            if pipeline not in ("default", options["tir_pipeline"]):
                raise ValueError(f"{impl.name} needs TIR pipeline {options['tir_pipeline']}, another needs {pipeline}")
            pipeline = options["tir_pipeline"]
        config.update(options.get("config", {}))
    return dict(tir_pipeline=pipeline, config=config)


def compile_kernel(impl: KernelImpl, wl, target):
    """One kernel on its own: ``impl``'s compute for ``wl`` with its default schedule, compiled for
    ``target`` (a ``tvm.target.Target``) with the options it needs; returns the runtime module
    (``main``).  A kernel whose implementation leaves it to dlight gets, on CUDA, the rules the
    Relax CUDA pipeline applies in a model build.  For benchmarks and tests: models are built by
    ``tvm_qconv.build``."""
    options = compile_options([impl])
    func = impl.compute(wl)
    scheduled = impl.schedule(func, target)
    mod = tvm.IRModule({"main": scheduled or func})
    with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        if scheduled is None and target.kind.name == "cuda":
            mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
        return tvm.compile(mod, target=target, tir_pipeline=options["tir_pipeline"])
