"""The interface every kernel implementation fills in, and the one an activation layout fills in.

A *kernel implementation* is one way to run one op (``conv2d``, ``max_pool2d``, ...): its compute
definition, NumPy reference, default schedule, MetaSchedule search spaces and tuning seed, and
the layout of the int8 activations it reads and writes.  Implementations of one op differ by
*family* (``dp4a``, ``cpu``, ``generic``...): the family is how it runs, the layout what it
reads.  ``tvm_qconv/registry.py`` lists them all and picks one per layer; passes, the tuner and
the training kernels only ever talk to this interface.

Like a dlight rule, :meth:`KernelImpl.applies` says whether an implementation can run a workload
on a target, and returns False where it cannot, rather than raising.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import tvm
from tvm import tirx

IMPL_ATTR = "tvm_qconv.impl"          # PrimFunc attribute: the registry name of the implementation
KERNEL_ATTR = "tvm_qconv.kernel"      # PrimFunc attribute: the compute definition's name
WORKLOAD_ATTR = "tvm_qconv.workload"  # PrimFunc attribute: the workload (a dict literal)
TIRX_ATTR = "tvm_qconv.tirx"          # PrimFunc attribute: a hand-written TIRx kernel (lowered first)


class Layout:
    """An int8 activation layout: how float NCHW tensors enter and leave it.

    Attributes:
        name: e.g. ``NCHW4c``.
    """

    name: str = ""

    def packed_shape(self, shape: tuple[int, int, int, int]) -> tuple[int, ...]:
        """The int8 buffer shape of a float NCHW tensor of ``shape``."""
        raise NotImplementedError

    def logical_shape(self, packed: tuple[int, ...]) -> tuple[int, int, int, int]:
        """The NCHW shape of a packed buffer, its channels counted with the padding."""
        raise NotImplementedError

    def quantize(self, shape: tuple[int, int, int, int], scale: float, zero: int = 0) -> tirx.PrimFunc:
        """Kernel: float NCHW of ``shape`` -> int8 in this layout (round half to even, clamp);
        ``zero``: the zero point (0: symmetric, -128..127 unused -128; -128: unsigned, 0..255
        stored as -128..127; ``quantize.quantize_clamp``).

        The registry's ``quantize`` implementation of this layout computes it
        (``conversion_kernels.py``); kept for callers that do not ask the registry yet."""
        raise NotImplementedError

    def dequantize(self, packed: tuple[int, ...], channels: int, scale: float, zero: int = 0) -> tirx.PrimFunc:
        """Kernel: int8 in this layout -> float NCHW with ``channels`` channels, ``(q - zero) * scale``.

        The registry's ``dequantize`` implementation of this layout computes it; kept as
        :meth:`quantize` is."""
        raise NotImplementedError

    def pack(self, x: np.ndarray) -> np.ndarray:
        """NumPy NCHW -> this layout (channels zero-padded)."""
        raise NotImplementedError

    def to_logical(self, index: tuple) -> tuple:
        """TIR: the NCHW index ``(n, c, h, w)`` of the packed element at ``index``."""
        raise NotImplementedError

    def to_packed(self, n, c, h, w) -> tuple:
        """TIR: the packed index of NCHW element ``(n, c, h, w)``."""
        raise NotImplementedError

    def unpack(self, x: np.ndarray, channels: int) -> np.ndarray:
        """NumPy, this layout -> NCHW with ``channels`` channels."""
        raise NotImplementedError


class KernelImpl:
    """One implementation of one op.

    Attributes:
        name: unique registry name, ``<op>.<layout>.<family>`` (e.g. ``conv2d.nchw4c.dp4a``;
            the memory-bound kernels of ``layout_kernels.py``: ``<op>.<layout>``).
        op: the op it implements: a layer the quantize pass lowers (``conv2d``, ``dense``,
            ``max_pool2d``, ``avg_pool2d``, ``add``, ``concat``, ``channels``, ``lut``,
            ``affine``), a conversion it inserts (``quantize``, ``dequantize``, ``relayout``,
            ``quantize_rows``: ``conversion_kernels.py``), or a training kernel
            (``conv2d_grad_input``, ``conv2d_grad_weight``).
        layout: the layout of its int8 activations (``NCHW4c``), or ``NCHW`` / ``rows`` for
            kernels that take plain tensors; a conversion's: the int8 side's (a relayout's: the
            layout it writes).
        in_layout: the layout of its int8 input where it differs from its output's (the stem
            conv: NCHW4c in, NHWC32 out; a relayout); empty = ``layout``.  See :meth:`input_layout`.
        family: how it runs (``dp4a``, ``cpu``; ``generic``: plain TensorIR that every target
            runs, with its own CUDA schedule or dlight's, unscheduled on llvm).
        spaces: names of its MetaSchedule search spaces, the default first; empty = not tuned.
        search: how the tuner walks its spaces: ``evolutionary`` (MetaSchedule's evolutionary
            search: the decisions are trace decisions its mutators change) or ``replay_func``
            (each candidate runs the space's schedule function afresh: for spaces whose
            decisions become constants of the schedule, e.g. a layout, which a mutated trace
            would leave behind) or ``exhaustive`` (a space of :meth:`space_size` points, each
            measured once: :meth:`trace_point` writes point ``i``).
        own_task: its compute definition is another implementation's (the wgmma family's is
            the mma.sync family's): its tuning records are kept apart by naming the
            implementation in the task (``tvm_qconv/tuning/tasks.py``), so a database holds
            both families' measurements of a layer and the faster wins.
        instruction: the int8 instruction its math runs on, as ``benchmarks/int8_peaks.py``
            names the paths it measures (``dp4a``, ``mma.sync``): the peak that its "% of
            peak" figures refer to; empty = none measured.
        runs_on: the target it needs, in words for messages (``CUDA sm_80+``); empty = any.
        takes_table: (conv) its epilogue can end in a 256-entry table (``ConvWorkload.table``,
            ``epilogue_table.py``); ``registry.candidates`` offers only these for such a workload.
        takes_residual: (conv) its epilogue can end in the residual add after the conv
            (``ConvWorkload.residual``, ``epilogue_residual.py``); ``registry.candidates``
            offers only these for such a workload.
        takes_norm: (conv) its epilogue can end in the LayerNorm over channels after the conv
            (``ConvWorkload.norm``, ``tensorcore/depthwise_layer_norm.py``).
        takes_splits: (conv) it can split the reduction into slices stored on their own
            (``ConvWorkload.splits > 1``: the training path's weight gradient).
        follows_input: (conv) where a layer's int8 input already is in :meth:`input_layout`, the
            planner picks it before the registry's order (``Planner.pick``): a memory-bound kernel
            (depthwise, grouped, a conv of few channels) that would otherwise cost a relayout on
            each side.
    """

    name: str = ""
    op: str = ""
    layout: str = ""
    in_layout: str = ""
    family: str = ""
    spaces: tuple[str, ...] = ()
    search: str = "evolutionary"
    own_task: bool = False
    instruction: str = ""
    runs_on: str = ""
    takes_table: bool = False
    takes_residual: bool = False
    takes_norm: bool = False
    takes_splits: bool = False
    follows_input: bool = False

    def input_layout(self) -> str:
        """The layout its int8 input is read in (:attr:`in_layout`, else :attr:`layout`)."""
        return self.in_layout or self.layout

    def applies(self, wl, target) -> bool:
        """Whether this implementation runs ``wl`` on ``target`` (a ``TargetInfo``)."""
        raise NotImplementedError

    def preferred(self, wl, target) -> bool:
        """Whether, untuned, it should run ``wl`` where it comes first among the candidates
        (``registry.select``); a layer it :meth:`applies` to but does not prefer still gets it
        where a tuning database measured it faster."""
        return True

    def compute(self, wl) -> tirx.PrimFunc:
        """The unscheduled PrimFunc of ``wl``, with the ``tvm_qconv.*`` attributes set."""
        raise NotImplementedError

    def reference(self, wl, *args: np.ndarray) -> np.ndarray:
        """NumPy twin of :meth:`compute` on the same (packed) arguments."""
        raise NotImplementedError

    def pack_params(self, wl, *arrays: np.ndarray) -> list[np.ndarray]:
        """The kernel's constant arguments, packed for it from the layer's own arrays: the
        parameters of :meth:`compute` after its data inputs, in order, with their shapes and
        dtypes.  What ``arrays`` are depends on the op:

        - ``conv2d``: ``(weight, bias, mult, shift)``: the int8 weight ``[O, C / groups, kh, kw]``,
          the int32 bias at scale ``s_x * s_w[o]`` and the requantize multiplier and shift
          (int32 ``[O]``, ``requantize.quantize_multiplier``);
        - ``dense``: ``(weight, scale, bias)``: int8 ``[O, K]``, float32 ``[O]`` ``s_x * s_w[o]``,
          float32 ``[O]``;
        - ``channels``: ``(index,)``: int32 ``[out_channels]``, the input channel of each output one;
        - ``lut``: ``(table,)``: 256 int8, the output of input ``q`` at ``q + 128``;
        - ``affine``: ``(mult, shift, bias)`` per real channel (``requantize.affine_params``);
        - ``max_pool2d``, ``avg_pool2d``, ``add``, ``concat`` and the conversions: none (``[]``).

        Example: ``args = [x] + [relax.const(p) for p in impl.pack_params(wl, qw, bias, mult, shift)]``.
        """
        raise NotImplementedError(f"{self.name} does not pack {self.op} parameters")

    def out_shape(self, wl) -> tuple[int, ...]:
        """The shape of the kernel's output (the last parameter of :meth:`compute`): packed in
        :attr:`layout` for an int8 activation (its channels padded as the layout pads them);
        ``dense``: float ``[batch, out_features]``; ``dequantize``: float NCHW;
        ``quantize_rows``: int8 ``[N, k_padded]``."""
        raise NotImplementedError(f"{self.name} does not give its {self.op} output shape")

    def scratch(self, wl) -> list[tuple[tuple[int, ...], str]]:
        """(shape, dtype) of each output the kernel writes before its result (the compute
        definition's parameters between the inputs and the result), for its own use: e.g. the
        partial sums between the two CUDA kernels of a global pool.  The build allocates them as
        call outputs, so Relax plans their memory and a CUDA graph replays them; none by default."""
        return []

    def in_features_padded(self, wl) -> int:
        """``dense`` only: the K of the int8 input rows it reads (``QuantizeRowsWorkload.k_padded``:
        the input's ``quantize_rows`` pads K to it with zeros)."""
        raise NotImplementedError(f"{self.name} reads no quantized input rows ({self.op} is not dense)")

    def label(self, func: tirx.PrimFunc) -> str:
        """How the build report's schedule list (``ScheduleInt8Kernels.applied``) names a kernel of
        this implementation: its registry :attr:`name`."""
        return self.name

    def schedule(self, func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The default schedule (marked ``tir.is_scheduled``), or None: leave the function to
        dlight (CUDA) or unscheduled (llvm)."""
        return None

    def space_generator(self, space: str, func: tirx.PrimFunc, target: tvm.target.Target):
        """The MetaSchedule space generator named ``space`` (one of :attr:`spaces`) for the
        task ``func`` on ``target``."""
        raise ValueError(f"{self.name} has no search space {space!r}")

    def space_size(self, wl) -> int | None:
        """Points of its space for ``wl`` where the tuner measures every one (``search =
        "exhaustive"``); None: unbounded (sampled)."""
        return None

    def trace_point(self, sch: "tvm.s_tir.Schedule", wl, index: int) -> None:
        """``search = "exhaustive"``: schedule ``sch`` (the task's function) as point ``index``."""
        raise NotImplementedError(f"{self.name} has no exhaustive space")

    def realize(self, func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The kernel a replayed trace of this implementation stands for, where the trace only
        records decisions (the wgmma family's config), without attributes (:func:`tirx_kernel`
        gives it ``func``'s); None: ``func`` is the kernel itself."""
        return None

    def decision(self, scheduled: tirx.PrimFunc) -> str:
        """What a replayed trace decided, for the build report where it is not the loops
        (the wgmma family's tile); empty by default."""
        return ""

    def tuned(self, scheduled: tirx.PrimFunc, func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
        """The function a build uses for ``func`` (a layer's compute definition, with its
        attributes), given ``scheduled``: a tuning record's trace replayed on it."""
        kernel = self.realize(scheduled, target)
        if kernel is not None:
            return tirx_kernel(func, kernel)
        # Keep the Relax module's attributes (no global_symbol "main": that name is taken).
        return scheduled.without_attr("global_symbol").with_attr(dict(func.attrs, **{"tir.is_scheduled": True}))

    def tuning_target(self, target: tvm.target.Target) -> tvm.target.Target:
        """The target its candidates are checked against while tuning (e.g. with the dynamic
        shared memory limit the kernels opt into); ``target`` by default."""
        return target

    def compile_options(self) -> dict | None:
        """What ``tvm.compile`` needs for a module holding these kernels: ``tir_pipeline`` and
        PassContext ``config`` entries; None when TVM's defaults do."""
        return None

    def seed(self, sch: "tvm.s_tir.Schedule", target: tvm.target.Target, wl=None) -> None:
        """Schedule ``sch`` with the default decisions *as a trace of the default space*, so
        that tuning can start from the default schedule.

        ``wl`` is the task's workload: the tuner's function has no ``tvm_qconv.*`` attributes
        (``tvm_qconv/tuning/tasks.py``), so what the loops do not show (groups) comes from it;
        None: read it off the function's attributes, where it has them."""
        raise NotImplementedError(f"{self.name} has no tuning seed")

    def prepare(self) -> None:
        """Register what parsing this implementation's traces needs (tensor intrinsics)."""

    def tag(self, func: tirx.PrimFunc, wl) -> tirx.PrimFunc:
        """``func`` with the attributes that name this implementation and its workload."""
        return tagged(func, self.name, wl)


def tagged(func: tirx.PrimFunc, name: str, wl) -> tirx.PrimFunc:
    """``func`` with the attributes that name implementation ``name`` and its workload ``wl``
    (:meth:`KernelImpl.tag`)."""
    attrs = {IMPL_ATTR: name}
    if wl is not None and hasattr(wl, "to_dict"):
        attrs[WORKLOAD_ATTR] = str(wl.to_dict())
    return func.with_attr(attrs)


def no_constants(impl: KernelImpl, arrays: tuple) -> list:
    """``pack_params`` of a kernel whose only arguments are its activations: nothing to pack."""
    if arrays:
        raise TypeError(f"{impl.name} takes no constants, got {len(arrays)} arrays")
    return []


def tirx_kernel(func: tirx.PrimFunc, kernel: tirx.PrimFunc) -> tirx.PrimFunc:
    """A hand-written TIRx ``kernel`` in place of the compute definition ``func``: ``func``'s
    attributes (implementation, workload), marked TIRx (lowered first by the tensor-core
    pipeline) and scheduled -- ``tirx.is_scheduled`` is the mark dlight reads (its rules would
    parse a TIRx kernel as S-TIR)."""
    attrs = {k: v for k, v in func.attrs.items()}
    attrs.update({TIRX_ATTR: True, "tir.is_scheduled": True, "tirx.is_scheduled": True})
    return kernel.with_attr(attrs)


def parse_written_kernel(src: str) -> tirx.PrimFunc:
    """The PrimFunc of the TVMScript ``src`` of a kernel written out with thread loops, its body
    (every line after ``T.func_attr``) put in a root block: Relax's analyses of the functions a
    ``call_tir`` calls (``RewriteDataflowReshape``) and dlight's rules expect one."""
    if src.count("@T.prim_func(private=True)") != 1 or src.count("T.func_attr(") != 1:
        raise ValueError("a written-out kernel's source has one '@T.prim_func(private=True)' and one "
                         "'T.func_attr(' line, after which its body starts")
    lines = src.strip("\n").replace("@T.prim_func(private=True)", "@T.prim_func(private=True, s_tir=True)").split("\n")
    at = next(i for i, line in enumerate(lines) if "T.func_attr(" in line) + 1
    body = ["    " + line if line.strip() else line for line in lines[at:]]
    return tvm.script.from_source("\n".join(lines[:at] + ['    with T.sblock("root"):'] + body) + "\n")


def written_kernel(func: tirx.PrimFunc, kernel: tirx.PrimFunc) -> tirx.PrimFunc:
    """A kernel written out in TVMScript (thread loops in a root block: ``tensorcore/affine.py``) in place of
    the compute definition ``func``: ``func``'s attributes, marked scheduled for ScheduleInt8Kernels
    (``tir.is_scheduled``) and for dlight (``tirx.is_scheduled``: its rules look for a root block and
    raise on a function without one)."""
    attrs = {k: v for k, v in func.attrs.items()}
    attrs.update({"tir.is_scheduled": True, "tirx.is_scheduled": True})
    return kernel.with_attr(attrs)


def impl_name(func) -> str | None:
    """The registry name of the implementation a PrimFunc was made by, or None."""
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None or IMPL_ATTR not in func.attrs:
        return None
    return str(func.attrs[IMPL_ATTR])


def load_tensor_intrin_file(stem: str):
    """``tvm.s_tir.tensor_intrin.<stem>`` without the package ``__init__``, which builds every
    target's intrinsics (the whole package takes 20-120 s to import on a small box; one file a
    few seconds).  The file is loaded under its real module name, so a later import of the whole
    package reuses it instead of registering the same intrinsics twice (which would raise)."""
    name = f"tvm.s_tir.tensor_intrin.{stem}"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin", f"{stem}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
