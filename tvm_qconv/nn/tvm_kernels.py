"""The training path's TVM kernels: int8 conv forward, input and weight gradients on torch tensors.

Three kernels, asked of the kernel registry (``tvm_qconv/registry.py``) for the tensors'
device, compiled once per shape, cached in memory and on disk, and called on torch tensors
zero-copy (tvm-ffi takes them through DLPack):

===============  =======================  =======================================================
kind             registry op              what
===============  =======================  =======================================================
``forward``      ``conv2d``, int32 out    the int8 conv's accumulator (on CUDA: ``mma.sync`` tensor cores
                                          for one group of 16+ input channels, else the dp4a family)
``grad_input``   ``conv2d_grad_input``    float32 dx from int8 weights
``grad_weight``  ``conv2d_grad_weight``   float32 split-K partial dw from the int8 input
===============  =======================  =======================================================

All three take one :class:`~tvm_qconv.schedules.workload.ConvWorkload` (groups included).  The
int8 weight gradient (``weight_grad="int8"``) is a ``forward`` kernel too: the split-K int32 conv
of the input with the int8 gradient (``schedules/training/grad_weight_mma.py``,
:func:`int8_weight_grad`).  Two more kinds, ``quantize`` and ``dequantize``, are the one-pass
elementwise kernels around the int8 convs (``schedules/training/elementwise.py``: runtime scales,
the torch operations' bits): :func:`quantize`, :func:`int8_conv_dequantized`.

On CUDA they replace the forward int8 conv and both conv gradients (:func:`register`, called
lazily by :mod:`tvm_qconv.nn.functional` when the first CUDA tensor arrives: importing
``tvm_qconv`` neither imports TVM nor needs CUDA).  On the CPU the same definitions are built
unscheduled for llvm: slow, and used only by the tests, which run the autograd layer through
them to check everything this module does around the kernels (packing, groups, the linear-layer
layout, split-K sums) without a GPU.

Layout work happens in torch, on the device, in int8 where possible: before the forward kernel
NCHW int8 -> NHWC32 and OIHW int8 -> [O_p, KH*KW*C_p] for the tensor cores (or NCHW4c /
OIHW4o4i for dp4a: :func:`forward_layout` says which the registry picked), 1 byte per element;
after it the int32 accumulators are a strided NCHW view that ``functional`` turns into float
NCHW in its one conversion pass.  The gradient kernels take plain NCHW / OIHW through free views.

Details that matter:

* **Streams.** A tvm-ffi call whose arguments are torch CUDA tensors sets TVM's stream for the
  call to torch's *current* stream (tvm-ffi asks torch through ``__dlpack_c_exchange_api__``),
  and TVM's CUDA runtime launches there: the kernels are ordered with the surrounding torch
  ops on that stream, with no synchronization, also under ``torch.cuda.stream(s)``.
* **Memory.** Every buffer a kernel touches is a torch tensor passed in (outputs and the
  split-K partial sums included): TVM-allocated intermediates would bypass PyTorch's caching
  allocator and its memory statistics.  The CUDA schedules keep their staging buffers in
  shared memory and registers (a CPU test checks that no global buffer is allocated).
* **Compact and aligned arrays.** TVM rejects non-compact arrays, and its kernels assume
  64-byte aligned data (an llvm kernel given a 4-byte aligned view segfaulted): every tensor
  passed is contiguous and aligned, copied when not (:func:`_ready`).  ``functional`` already
  makes inputs and gradients contiguous, so in practice only group slices are copied.
* **Groups** run in one call: the forward's packing pads each group's channels to a multiple
  of 4 on their own, so its NCHW4c blocks never mix groups (``schedules/nchw4c/conv2d.py``);
  the gradient kernels have a group axis.
* **Linear layers** arrive as 1x1 convs on 1x1 images (``H = W = 1``).  They run as a 1x1 conv
  on *one* 1 x N image (the batch becomes the width): the same result, but the forward
  schedule tiles 32 columns x 8 output-channel groups instead of one pixel per block.
* **Cache.** Key = kind, workload, target (arch), TVM version and a hash of the kernels' source
  files (every file of ``schedules/`` and this one: editing a schedule rebuilds the kernels).
  Each ``.so`` is written to a temp file and ``os.replace``d into place: an interrupted build never leaves a partial entry, and an
  entry that fails to load is rebuilt with a warning.  Directory: ``$TVM_QCONV_KERNEL_CACHE``,
  else ``~/.cache/tvm_qconv/kernels``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
import tvm

from .. import registry, schedules
from ..fileio import atomic_path
from ..schedules import runtime_functions
from ..schedules.training import bn_channel, conv_choices, dequantize_amax, elementwise, relu_bits_amax
from ..schedules.training.grad_weight import weight_grad_splits
from ..schedules.requantize import QMIN
from ..schedules.workload import ConvWorkload
from ..target import TargetInfo, make_target
from . import conv_table
from . import max_pool as max_pool2x2
from .batch_norm import grad_apply, grad_coefficients, grad_sums, normalize_relu, train_stats
from .functional import (ELEMENTWISE_KERNELS, INT8_WEIGHT_GRAD_KERNELS, conv_scales_torch, flipped_transposed_torch,
                         grad_stats_torch, int8_conv_dequantized_torch, known_amax, mask_torch, note_amax,
                         quantize_grad_torch, quantize_torch, register_conv_grad_kernels, register_int8_conv_kernel,
                         relu_bits_torch, relu_with_bits_torch, scale_sums_torch, update_range_torch)

# The functions kernels call at run time (the TMA encoder of a tabled Hopper conv): this process
# runs the kernels it builds.
runtime_functions.register()

CACHE_ENV = "TVM_QCONV_KERNEL_CACHE"
# A forward in this layout reads channels last ([N, H, W, C_p], C padded to 32: the int8 tensor
# cores' kernels, the measured choices' among them); in any other, NCHW4c blocks (dp4a).
CHANNELS_LAST_LAYOUT = conv_choices.LAYOUT
ALIGNMENT = 64  # bytes; TVM's kAllocAlignment, which its kernels assume for every argument
_SCHEDULES_DIR = os.path.dirname(os.path.abspath(schedules.__file__))
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# beside schedules/: what picks, tables and targets the kernels
_PACKAGE_SOURCES = ("nn/tvm_kernels.py", "nn/conv_table.py", "registry.py", "target.py")

# The registry op each kind of kernel is.
OPS = {"forward": "conv2d", "grad_input": "conv2d_grad_input", "grad_weight": "conv2d_grad_weight"}

# (kind, workload description) -> calls, for "which kernels ran" reports.
CALLS: collections.Counter = collections.Counter()
# (kind, workload description) -> seconds spent building (0 when loaded from disk).
BUILD_SECONDS: dict[tuple[str, str], float] = {}

_kernels: dict[tuple, Callable] = {}
_lock = threading.Lock()


# ----------------------------------------------------------------------------- compile + cache

def cache_dir() -> str:
    """The kernel cache folder: ``$TVM_QCONV_KERNEL_CACHE`` or ``~/.cache/tvm_qconv/kernels``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tvm_qconv", "kernels")


def source_hash(schedules_dir: str = _SCHEDULES_DIR, package_dir: str = _PACKAGE_DIR) -> str:
    """A hash of every ``.py`` file under ``schedules_dir``, of this module and of the modules that
    pick and target the kernels (``registry.py``, ``target.py``): the text that defines them (a
    changed schedule, helper, compute definition, selection or target description rebuilds them)."""
    h = hashlib.sha256()
    files = sorted(os.path.relpath(os.path.join(d, f), schedules_dir)
                   for d, _, names in os.walk(schedules_dir) for f in names if f.endswith(".py"))
    for rel in files:
        with open(os.path.join(schedules_dir, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    for rel in _PACKAGE_SOURCES:
        with open(os.path.join(package_dir, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    return source_hash()


@functools.lru_cache(maxsize=None)
def device_target(device: torch.device) -> tuple[object, str]:
    """``(tvm target, short name)`` for a torch device: CUDA at the device's arch, or llvm.

    Cached: every kernel call looks its kernel up through this, and building a Target and
    querying the device capability each time would sit on the training step's hot path."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
        return target_of(arch), arch
    if device.type == "cpu":
        return target_of("llvm"), "llvm"
    raise NotImplementedError(f"no TVM kernels for device type {device.type!r}")


def target_of(arch: str):
    """The TVM target of :func:`device_target`'s short name: CUDA at ``sm_XY``, or llvm."""
    return make_target("cuda", arch) if arch.startswith("sm_") else tvm.target.Target("llvm")


def _impl(kind: str, wl: ConvWorkload, target):
    """The registry's implementation of one kernel for the target."""
    if kind not in OPS:
        raise ValueError(f"unknown kernel kind {kind!r}; kinds: {sorted(OPS)}")
    impl = registry.select(OPS[kind], wl, TargetInfo.from_target(target))
    if impl is None:
        raise NotImplementedError(f"no {OPS[kind]} kernel for {wl.describe()} on {target}")
    return impl


def _definition(kind: str, wl: ConvWorkload, target, choice=None):
    """The PrimFunc of one kernel: the registry's implementation for the target, scheduled by
    its default schedule where it has one (llvm: the bare compute definition), or, for a
    tensor-core forward, as ``choice`` (the measured table's, :mod:`conv_table`: one of
    ``conv_choices``; a table entry the kernels no longer take is warned about and the default
    used).

    Raises:
        NotImplementedError: a forward kernel that does not take the ``(data, weight, out)`` that
            :func:`int8_conv` packs (a new int32 conv that needs its own packing).
    """
    if kind in elementwise.KINDS:
        return elementwise.definition(wl, target)
    # a measured choice is one of the mma template's compute (tabled for it), whatever the registry
    # would pick on its build arch
    impl = registry.get(conv_choices.IMPL) if choice else _impl(kind, wl, target)
    func = impl.compute(wl)
    if kind == "forward" and len(func.params) != 3:
        raise NotImplementedError(f"{impl.name} takes {len(func.params)} arguments for {wl.describe()}; the training "
                                  f"forward passes (data, weight, out) packed for {impl.layout}: teach int8_conv its "
                                  "packing")
    if choice:
        try:
            return conv_choices.schedule(func, choice, target)
        except conv_choices.INVALID_CHOICE as err:
            warnings.warn(f"the tile table's entry for {describe(wl)} ({conv_choices.describe_choice(choice)}) does "
                          f"not fit the kernels ({err}): built with the default tiles; run python tune.py --training "
                          "again")
    return impl.schedule(func, target) or func


def _choice(kind: str, wl, arch: str):
    """The measured choice of a forward kernel (``conv_table.lookup``) where it is for ``wl``'s
    split count (a split-K dw's choice may change the count: :func:`int8_weight_grad` asks for the
    chosen one), None otherwise and for other kinds."""
    if kind != "forward" or not isinstance(wl, ConvWorkload):
        return None
    choice = conv_table.lookup(wl, arch)
    return choice if conv_table.choice_workload(wl, choice) == wl else None


@functools.lru_cache(maxsize=None)
def forward_layout(wl: ConvWorkload, device: torch.device) -> str:
    """The activation layout of the forward kernel the registry picks for ``wl`` on ``device``:
    ``NHWC32`` (int8 tensor cores, ``mma.sync``: one group, 16+ input channels) or ``NCHW4c`` (dp4a)."""
    return _impl("forward", wl, device_target(device)[0]).layout


def symbol(kind: str) -> str:
    """The compiled function's name (its CUDA kernel is this + ``_kernel``)."""
    return f"tvm_qconv_{kind}"


def cache_key(kind: str, wl, arch: str) -> dict:
    """Everything a cached kernel depends on."""
    key = {"kind": kind, "workload": wl.to_dict(), "arch": arch, "tvm": tvm.__version__, "source": _source_hash()}
    choice = _choice(kind, wl, arch)
    if choice:      # only where tabled: the default kernels keep their cache entries
        key["choice"] = choice
    return key


def cache_path(kind: str, wl, arch: str) -> str:
    key = json.dumps(cache_key(kind, wl, arch), sort_keys=True)
    return os.path.join(cache_dir(), f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.so")


def _build(kind: str, wl, target, path: str) -> None:
    """Compile one kernel and write it to ``path`` atomically: a forward with a measured choice
    (:mod:`conv_table`, the same lookup as its cache key) as that choice, for its arch
    (``conv_choices.build_arch``)."""
    choice = _choice(kind, wl, str(target.attrs["arch"])) if target.kind.name == "cuda" else None
    if choice:
        target = target_of(conv_choices.build_arch(choice, str(target.attrs["arch"])))
    # Named per kind, so that profilers show e.g. ``tvm_qconv_grad_input_kernel``, not ``main_kernel``.
    func = _definition(kind, wl, target, choice).with_attr("global_symbol", symbol(kind))
    # the implementation's own pipeline and PassContext entries (the mma template's async copies)
    options = registry.compile_options([] if kind in elementwise.KINDS else
                                       [registry.get(conv_choices.IMPL) if choice else _impl(kind, wl, target)])
    with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
        ex = tvm.compile(tvm.IRModule({symbol(kind): func}), target=target, tir_pipeline=options["tir_pipeline"])
    with atomic_path(path, suffix=".so") as tmp:
        ex.export_library(tmp)


def get_kernel(kind: str, wl, device: torch.device) -> Callable:
    """The compiled ``kind`` kernel for workload ``wl`` on ``device``: memory, then disk, then build.

    Args:
        kind: ``"forward"``, ``"grad_input"`` or ``"grad_weight"``.
        wl: the layer's ``ConvWorkload`` (int32 out for the forward).
        device: the torch device the tensors live on.

    Returns:
        A tvm-ffi function taking the kernel's tensors (torch tensors work as they are).
    """
    target, arch = device_target(device)
    mem_key = (kind, wl, arch, device.index)
    fn = _kernels.get(mem_key)
    if _recording is not None and (_record_all or (fn is None and not os.path.exists(cache_path(kind, wl, arch)))):
        _recording.add((kind, wl, arch))    # a dry run (prebuild, kernel_jobs): remembered, not built, not run
        return _skip
    if fn is not None:
        return fn
    with _lock:
        fn = _kernels.get(mem_key)
        if fn is None:
            fn = _load_or_build(kind, wl, target, arch)
            _kernels[mem_key] = fn
    return fn


def _load_or_build(kind: str, wl, target, arch: str) -> Callable:
    path = cache_path(kind, wl, arch)
    t0 = time.perf_counter()
    if os.path.exists(path):
        try:
            fn = tvm.runtime.load_module(path)[symbol(kind)]
            BUILD_SECONDS.setdefault((kind, describe(wl)), 0.0)
            return fn
        except Exception as e:  # truncated, foreign or stale file: rebuild it
            warnings.warn(f"kernel cache entry {path} does not load ({type(e).__name__}: {e}); rebuilding it")
            os.remove(path)
    _build(kind, wl, target, path)
    fn = tvm.runtime.load_module(path)[symbol(kind)]
    BUILD_SECONDS[(kind, describe(wl))] = time.perf_counter() - t0
    return fn


# ----------------------------------------------------------------------------- parallel prebuild

_recording: set | None = None     # (kind, workload, arch) a prebuild's dry run asked for
_record_all = False               # kernel_jobs: record the cached kernels too


def _skip(*tensors) -> None:
    """A kernel in prebuild's dry run: writes nothing."""


def prebuild(dry_run: Callable[[], object], workers: int | None = None) -> dict:
    """Compile, in parallel, every kernel ``dry_run()`` calls that the disk cache lacks.

    The first step of a model otherwise builds its kernels one after another as it meets them
    (VGG16's 123 at batch 32 took 165 s of a training benchmark's first step, ResNet-50's 206 at
    batch 128 219 s; prebuilt on a 16-core host, 29 s and 36 s: H200 host, 2026-11-28).  Here ``dry_run`` runs once with those kernels replaced by no-ops
    that only note their workloads (shapes and flags are all a kernel depends on, and a step that
    can be captured in a CUDA graph makes no decision on values), then ``workers`` processes build
    them into the cache, from which the real step loads them.

    The dry run's results are garbage (every missing kernel's output is left unwritten): run it on
    a copy of the model (``copy.deepcopy``) and throw its gradients and statistics away.

    Args:
        dry_run: the work whose kernels to build, e.g. a forward and backward of a copy of the model.
        workers: build processes (default: the CPU count, at most one per kernel).

    Returns:
        ``{"built": [(kind, workload)], "failed": [(kind, workload, error)], "seconds": wall time}``
        (workloads as :func:`report` names them); a kernel that failed to build here is built (and
        its error raised) by the step that calls it.
    """
    import concurrent.futures
    import multiprocessing

    global _recording
    t0 = time.perf_counter()
    calls = CALLS.copy()
    _recording = set()
    try:
        dry_run()
    finally:
        jobs, _recording = sorted(_recording, key=lambda j: (j[0], describe(j[1]), j[2])), None
        CALLS.clear()
        CALLS.update(calls)
    built, failed = [], []
    if jobs:
        workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_build_into_cache, *job): job for job in jobs}
            try:
                for future in concurrent.futures.as_completed(futures):
                    kind, wl, _ = futures[future]
                    try:
                        BUILD_SECONDS[(kind, describe(wl))] = future.result()
                        built.append((kind, describe(wl)))
                    except Exception as e:  # the step that calls it builds it again and raises there
                        failed.append((kind, describe(wl), f"{type(e).__name__}: {e}"))
            except BaseException:          # interrupted: finished entries stay, the rest never start
                pool.shutdown(cancel_futures=True)
                raise
    return {"built": sorted(built), "failed": failed, "seconds": time.perf_counter() - t0}


def kernel_jobs(dry_run: Callable[[], object]) -> list[tuple[str, object, str]]:
    """Every ``(kind, workload, arch)`` ``dry_run()`` calls, cached or not; nothing is built, and
    no kernel runs (results are garbage, as in :func:`prebuild`'s dry run)."""
    global _recording, _record_all
    calls = CALLS.copy()
    _recording, _record_all = set(), True
    try:
        dry_run()
        return sorted(_recording, key=lambda j: (j[0], describe(j[1]), j[2]))
    finally:
        _recording, _record_all = None, False
        CALLS.clear()
        CALLS.update(calls)


def _build_into_cache(kind: str, wl, arch: str) -> float:
    """A prebuild worker: one kernel into the disk cache (atomically); its build seconds."""
    t0 = time.perf_counter()
    path = cache_path(kind, wl, arch)
    if not os.path.exists(path):
        _build(kind, wl, target_of(arch), path)
    return time.perf_counter() - t0


def describe(wl) -> str:
    """``wl.describe()`` plus a conv's padding, which it leaves out."""
    if not isinstance(wl, ConvWorkload):
        return wl.describe()
    return wl.describe() + ("" if wl.padding == (1, 1, 1, 1) else f" pad{wl.padding}")


def _call(kind: str, wl, device: torch.device, *tensors: torch.Tensor, outputs: int = 1) -> None:
    """Run a kernel: inputs made ready for TVM (copied if needed), the ``outputs`` last tensors
    written in place."""
    fn = get_kernel(kind, wl, device)
    inputs, outs = tensors[:-outputs], tensors[-outputs:]
    if any(_ready(out) is not out for out in outs):  # a copy would take the result away with it
        raise ValueError(f"{kind} outputs must be contiguous and {ALIGNMENT}-byte aligned")
    CALLS[(kind, describe(wl))] += 1
    fn(*[_ready(t) for t in inputs], *outs)


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if TVM can take it as it is (compact, 64-byte aligned), else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- layouts

def _ceil4(c: int) -> int:
    return (c + 3) // 4 * 4


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad axis ``dim`` of ``t`` to ``size`` (no copy when it already is)."""
    extra = size - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t, pad)


def _pack_input(x: torch.Tensor, groups: int) -> torch.Tensor:
    """int8 [N, C, H, W] -> [N, G*cgb, H, W, 4]: each group's channels zero-padded to a multiple
    of 4 on their own (plain NCHW4c when they already are one)."""
    n, c, h, w = x.shape
    xp = _pad_dim(x.reshape(n, groups, c // groups, h, w), 2, _ceil4(c // groups))
    return xp.reshape(n, -1, 4, h, w).permute(0, 1, 3, 4, 2).contiguous()


def _pack_weight(w: torch.Tensor, groups: int) -> torch.Tensor:
    """int8 [O, I, KH, KW] -> [G*ogb, cgb, KH, KW, 4o, 4i], each group's channels zero-padded."""
    o, i, kh, kw = w.shape
    wp = _pad_dim(_pad_dim(w.reshape(groups, o // groups, i, kh, kw), 1, _ceil4(o // groups)), 2, _ceil4(i))
    return wp.reshape(-1, 4, _ceil4(i) // 4, 4, kh, kw).permute(0, 2, 4, 5, 1, 3).contiguous()


def _ceil32(c: int) -> int:
    return (c + 31) // 32 * 32


def _pack_input_nhwc32(x: torch.Tensor, transpose: bool = False, pad_rows: bool = False) -> torch.Tensor:
    """int8 [N, C, H, W] -> [N, H, W, C_p], channels zero-padded to a multiple of 32 (the
    tensor-core family's activation layout, ``schedules/tensorcore/layout.py``); ``transpose``:
    [C, H, W, N_p], the batch as the channels (``pad_rows``: C padded to 32 too).  One kernel
    (``elementwise.pack``): torch's ``permute(...).contiguous()`` reads a byte per feature map."""
    wl = elementwise.ElementwiseWorkload("pack", tuple(x.shape), transpose=transpose, pad_rows=pad_rows)
    n, c, h, w = x.shape
    rows, cols = (c, n) if transpose else (n, c)
    out = torch.empty((_ceil32(rows) if pad_rows else rows, h, w, _ceil32(cols)), dtype=torch.int8, device=x.device)
    _call("pack", wl, x.device, x, out)
    return out


def _pack_weight_nhwc32(w: torch.Tensor) -> torch.Tensor:
    """int8 [O, C, KH, KW] -> [O_p, KH*KW*C_p] (``schedules/tensorcore/conv2d.py``'s ``pack_weight``)."""
    o, c, kh, kw = w.shape
    wp = _pad_dim(_pad_dim(w.permute(0, 2, 3, 1), 3, _ceil32(c)), 0, _ceil32(o))
    return wp.reshape(_ceil32(o), -1).contiguous()


def _unpack_output(acc: torch.Tensor, channels: int, groups: int) -> torch.Tensor:
    """int32 [N, G*ogb, OH, OW, 4] -> [N, channels, OH, OW] (padded channels dropped)."""
    n, oc, oh, ow, _ = acc.shape
    per_group = oc * 4 // groups
    out = acc.permute(0, 1, 4, 2, 3).reshape(n, groups, per_group, oh, ow)[:, :, :channels // groups]
    return out.reshape(n, channels, oh, ow)


def _is_dense(shape: Sequence[int], kernel, stride, padding, dilation, groups: int) -> bool:
    """A linear layer in conv clothes, batch > 1 (batch 1 is already one 1 x 1 image): 1x1 kernel
    on a 1x1 image, no padding, one group."""
    return (shape[0] > 1 and shape[2] == shape[3] == 1 and tuple(kernel) == (1, 1) and tuple(stride) == (1, 1)
            and tuple(padding) == (0, 0, 0, 0) and groups == 1)


def _rows_to_width(t: torch.Tensor) -> torch.Tensor:
    """[N, K, 1, 1] -> [1, K, 1, N]: the batch of a linear layer as the width of one image."""
    n, k = t.shape[:2]
    return t.reshape(n, k).t().contiguous().view(1, k, 1, n)


def _width_to_rows(t: torch.Tensor) -> torch.Tensor:
    """[1, K, 1, N] -> [N, K, 1, 1], contiguous."""
    k, n = t.shape[1], t.shape[3]
    return t.reshape(k, n).t().contiguous().view(n, k, 1, 1)


# ----------------------------------------------------------------------------- the three ops

def forward_workload(x_shape, w_shape, stride, padding, dilation, groups: int) -> ConvWorkload:
    """The forward kernel's workload (int32 out) of a conv of these shapes and arguments."""
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    return ConvWorkload(n, c, h, w, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups,
                        activation="none", act_min=QMIN, out_dtype="int32")


def int8_conv(x_q: torch.Tensor, w_q: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int, int, int],
              dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """Exact int8 x int8 -> int32 conv through the TVM kernel: ``functional.int8_conv_cpu``'s contract.

    Args:
        x_q: int8 NCHW input (contiguous).
        w_q: int8 OIHW weight, ``I = C / groups``.
        stride, dilation: (h, w).
        padding: (top, left, bottom, right).
        groups: conv groups.

    Returns:
        int32 NCHW accumulators on ``x_q``'s device.
    """
    if _is_dense(x_q.shape, w_q.shape[2:], stride, padding, dilation, groups):
        out = int8_conv(_rows_to_width(x_q), w_q, stride, padding, dilation, groups)
        return _width_to_rows(out)
    n, c, h, w = x_q.shape
    o = w_q.shape[0]
    wl = forward_workload(x_q.shape, w_q.shape, stride, padding, dilation, groups)
    if forward_layout(wl, x_q.device) == CHANNELS_LAST_LAYOUT:    # int8 tensor cores: [N, OH, OW, O_p] accumulators
        acc = torch.empty((n, wl.out_height, wl.out_width, _ceil32(o)), dtype=torch.int32, device=x_q.device)
        _call("forward", wl, x_q.device, _pack_input_nhwc32(x_q), _pack_weight_nhwc32(w_q), acc)
        return acc[..., :o].permute(0, 3, 1, 2)
    shape = (n, groups * _ceil4(o // groups) // 4, wl.out_height, wl.out_width, 4)
    acc = torch.empty(shape, dtype=torch.int32, device=x_q.device)
    _call("forward", wl, x_q.device, _pack_input(x_q, groups), _pack_weight(w_q, groups), acc)
    return _unpack_output(acc, o, groups)


def conv_input_grad(grad: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_shape: Sequence[int],
                    stride, padding, dilation, groups: int) -> torch.Tensor:
    """``dx = conv_transpose(grad * s_w, w_q)`` through the TVM kernel (float32, NCHW).

    Args:
        grad: float32 NCHW output gradient (contiguous).
        w_q: int8 OIHW weight; w_scale: float32 (O,) per-channel scales.
        input_shape: (N, C, H, W) of the forward input.
        stride, padding (top, left, bottom, right), dilation, groups: the forward conv's.
    """
    if _is_dense(input_shape, w_q.shape[2:], stride, padding, dilation, groups):
        n, k = input_shape[:2]
        dx = conv_input_grad(_rows_to_width(grad), w_q, w_scale, (1, k, 1, n), stride, padding, dilation, groups)
        return _width_to_rows(dx)
    n, c, h, w = input_shape
    o, cg, kh, kw = w_q.shape
    wl = ConvWorkload(n, c, h, w, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups)
    g_ = groups
    dx = torch.empty((n, c, h, w), dtype=torch.float32, device=grad.device)
    _call("grad_input", wl, grad.device, grad.view(n, g_, o // g_, wl.out_height, wl.out_width),
          w_q.view(g_, o // g_, cg, kh, kw), w_scale.to(torch.float32).view(g_, o // g_), dx.view(n, g_, cg, h, w))
    return dx


def conv_weight_grad(x_q: torch.Tensor, x_scale: torch.Tensor, grad: torch.Tensor, weight_shape: Sequence[int],
                     stride, padding, dilation, groups: int) -> torch.Tensor:
    """``dw = correlate(grad, x_q) * s_x`` through the TVM kernel (float32, OIHW).

    Args:
        x_q: int8 NCHW forward input; x_scale: its 0-d float32 scale.
        grad: float32 NCHW output gradient (contiguous).
        weight_shape: (O, C / groups, KH, KW).
        stride, padding (top, left, bottom, right), dilation, groups: the forward conv's.
    """
    o, cg, kh, kw = weight_shape
    if _is_dense(x_q.shape, (kh, kw), stride, padding, dilation, groups):
        return conv_weight_grad(_rows_to_width(x_q), x_scale, _rows_to_width(grad), weight_shape, stride, padding,
                                dilation, groups)
    n, c, h, w = x_q.shape
    wl = ConvWorkload(n, c, h, w, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups)
    g_ = groups
    splits = weight_grad_splits(wl)
    part = torch.empty((splits, g_, o // g_, cg, kh, kw), dtype=torch.float32, device=grad.device)
    _call("grad_weight", wl, grad.device, grad.view(n, g_, o // g_, wl.out_height, wl.out_width),
          x_q.view(n, g_, cg, h, w), x_scale.to(torch.float32).reshape(1), part)
    dw = part[0] if splits == 1 else part.sum(dim=0)
    return dw.view(o, cg, kh, kw)


def quantize(x: torch.Tensor, scale: torch.Tensor, mult: torch.Tensor | None = None) -> torch.Tensor:
    """``functional.quantize_torch`` in one kernel (``elementwise.quantize``): float32 NCHW ``x``
    -> int8 NCHW, ``scale`` 0-d or ``(C,)``, ``mult`` None or ``(C,)``."""
    if x.dim() != 4 or x.dtype != torch.float32:
        return quantize_torch(x, scale, mult)
    wl = elementwise.ElementwiseWorkload("quantize", tuple(x.shape), per_channel=scale.dim() == 1,
                                         mult=mult is not None)
    out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    extra = [] if mult is None else [mult.to(torch.float32)]
    _call("quantize", wl, x.device, x, scale.to(torch.float32).reshape(-1), *extra, out)
    return out


def int8_conv_dequantized(x_q: torch.Tensor, w_q: torch.Tensor, stride, padding, dilation, groups: int,
                          scale: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False,
                          note_range: bool = True, addend: torch.Tensor | None = None) -> torch.Tensor:
    """``functional.int8_conv_dequantized_torch``: the conv's accumulators (NHWC32 on the tensor
    cores, NCHW4c on dp4a) go to float NCHW in one kernel (``elementwise.dequantize``: scale, bias,
    ReLU); linear layers and grouped convs of group widths not a multiple of 4 through torch.
    From NHWC32 in whole 8-channel groups the kernel also writes the output's range, noted for
    ``functional.batch_amax`` (``dequantize_amax``: the layer's output observation, and the next
    layer's input range where the output is its input, without a pass of their own); in eval too,
    where nothing reads it (half a byte an element written and reduced); not with ``note_range=False``
    (an input gradient's: nothing takes its range) or an ``addend`` (added last, in the same kernel)."""
    wl = forward_workload(x_q.shape, w_q.shape, stride, padding, dilation, groups)
    n, o = x_q.shape[0], w_q.shape[0]
    if _is_dense(x_q.shape, w_q.shape[2:], stride, padding, dilation, groups) or (groups > 1 and (o // groups) % 4):
        return int8_conv_dequantized_torch(x_q, w_q, stride, padding, dilation, groups, scale, bias, relu, note_range,
                                           addend)
    layout = forward_layout(wl, x_q.device)    # the registry's name: the dequantizing kernel's, lowercase
    if layout == CHANNELS_LAST_LAYOUT:
        acc = torch.empty((n, wl.out_height, wl.out_width, _ceil32(o)), dtype=torch.int32, device=x_q.device)
        _call("forward", wl, x_q.device, _pack_input_nhwc32(x_q), _pack_weight_nhwc32(w_q), acc)
    else:   # dp4a's: one group, or groups of whole 4-channel blocks (no padding between groups)
        acc = torch.empty((n, _ceil4(o) // 4, wl.out_height, wl.out_width, 4), dtype=torch.int32, device=x_q.device)
        _call("forward", wl, x_q.device, _pack_input(x_q, groups), _pack_weight(w_q, groups), acc)
    shape = (n, o, wl.out_height, wl.out_width)
    dq = elementwise.ElementwiseWorkload("dequantize", shape, per_channel=scale.dim() == 1, layout=layout.lower(),
                                         bias=bias is not None, relu=relu, addend=addend is not None)
    dq = dataclasses.replace(dq, amax=note_range and addend is None and dequantize_amax.supports(dq))
    out = torch.empty(shape, dtype=torch.float32, device=x_q.device)
    extra = ([] if bias is None else [bias]) + ([] if addend is None else [addend])
    part = [torch.empty((n, o // dequantize_amax.CHANNELS) + shape[2:], dtype=torch.int32, device=x_q.device)
            ] if dq.amax else []
    _call("dequantize", dq, x_q.device, acc, scale.to(torch.float32).reshape(-1), *extra, out, *part,
          outputs=1 + len(part))
    if part:
        _note_range(out, part[0])
    return out


def _note_range(t: torch.Tensor, part: torch.Tensor) -> None:
    """Note ``max|t|`` for ``functional.batch_amax`` from a kernel's int32 partial maxima of |t|'s
    bits (``elementwise_bits.abs_bits``: an integer max, NaN above inf)."""
    note_amax(t, part.amax().view(torch.float32))


def relu_bits(y: torch.Tensor) -> torch.Tensor:
    """``functional.relu_bits_torch`` in one kernel (``elementwise.relu_bits``).  ``y`` is a tensor
    a layer has just made (the fused conv's ReLU output): where its range is not known yet (a dp4a
    conv's, whose dequantizing kernel does not write it) and its elements fill whole bytes, the
    kernel also writes the range, noted for ``functional.batch_amax`` (``relu_bits_amax``)."""
    if y.dim() != 4 or y.dtype != torch.float32:
        return relu_bits_torch(y)
    wl = elementwise.ElementwiseWorkload("relu_bits", tuple(y.shape))
    wl = dataclasses.replace(wl, amax=relu_bits_amax.supports(wl) and known_amax(y) is None)
    out = torch.empty(((y.numel() + 7) // 8,), dtype=torch.uint8, device=y.device)
    part = [torch.empty((y.numel() // 8,), dtype=torch.int32, device=y.device)] if wl.amax else []
    _call("relu_bits", wl, y.device, y.reshape(-1), out, *part, outputs=1 + len(part))
    if part:
        _note_range(y, part[0])
    return out


def relu_with_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``functional.relu_with_bits_torch`` in one kernel (``elementwise.relu``: ``relu(x)``, its
    bits and its range, noted for ``functional.batch_amax``) where ``x`` fills whole bytes of bits."""
    if x.dim() != 4 or x.dtype != torch.float32 or x.numel() % relu_bits_amax.ELEMENTS:
        return relu_with_bits_torch(x)
    wl = elementwise.ElementwiseWorkload("relu", tuple(x.shape))
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bits = torch.empty((x.numel() // 8,), dtype=torch.uint8, device=x.device)
    part = torch.empty((x.numel() // 8,), dtype=torch.int32, device=x.device)
    _call("relu", wl, x.device, x.reshape(-1), y.view(-1), bits, part, outputs=3)
    _note_range(y, part)
    return y, bits


def mask(g: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``functional.mask_torch`` in one kernel (``elementwise.mask``)."""
    if g.dim() != 4 or g.dtype != torch.float32:
        return mask_torch(g, bits)
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    _call("mask", elementwise.ElementwiseWorkload("mask", tuple(g.shape)), g.device, g.reshape(-1), bits,
          out.view(-1))
    return out


def grad_stats(g: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``functional.grad_stats_torch`` in one pass over ``g`` (``elementwise.grad_stats``), its
    partials finished in one more kernel (``elementwise.grad_finish``; by torch above
    ``bn_channel.MAX_PARTIALS`` a channel): ``max|g|`` bit-identical, ``sum g`` accumulated in float64."""
    if g.dim() != 4 or g.dtype != torch.float32:
        return grad_stats_torch(g, bits)
    wl = elementwise.ElementwiseWorkload("grad_stats", tuple(g.shape), relu=bits is not None)
    blocks, threads, _ = elementwise.stats_grid(g.shape)
    amax = torch.empty((g.shape[1], blocks, threads), dtype=torch.float32, device=g.device)
    total = torch.empty(amax.shape, dtype=torch.float64, device=g.device)
    flat = g.reshape(-1) if elementwise.quads(g.shape) else g    # the kernel's g (elementwise.grad_stats)
    _call("grad_stats", wl, g.device, _ready(flat), *([] if bits is None else [bits]), amax, total, outputs=2)
    c, k = g.shape[1], blocks * threads
    if not bn_channel.adds_in_kernel(k):
        return amax.amax(dim=(1, 2)), total.sum(dim=(1, 2)).to(torch.float32)
    g_amax, g_sum = (torch.empty((c,), dtype=torch.float32, device=g.device) for _ in range(2))
    _call("grad_finish", elementwise.ElementwiseWorkload("grad_finish", tuple(g.shape), partials=k), g.device,
          amax.view(c, k), total.view(c, k), g_amax, g_sum, outputs=2)
    return g_amax, g_sum


def _bn_sums(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``sum y`` and ``sum y * y`` a channel of float32 NCHW ``y`` as the ``bn_stats``
    kernel's ``[C, K]`` per-thread partials (``bn_finish`` adds them)."""
    wl = elementwise.ElementwiseWorkload("bn_stats", tuple(y.shape))
    blocks, threads, _ = elementwise.stats_grid(y.shape)
    s1 = torch.empty((y.shape[1], blocks * threads), dtype=torch.float64, device=y.device)
    s2 = torch.empty_like(s1)
    _call("bn_stats", wl, y.device, _ready(y.reshape(-1) if elementwise.quads(y.shape) else y),
          s1.view(-1, blocks, threads), s2.view(-1, blocks, threads), outputs=2)
    return s1, s2


def _partials_for_kernel(s1: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 sums ``[C]`` or partials ``[C, K]`` as ``bn_finish`` / ``bn_coeffs`` take them, with
    their workload's ``partials``: added by torch first unless ``bn_channel.adds_in_kernel(K)`` (a
    block a channel would read them alone: ResNet-50 b128's stem, 64 blocks of 800 KB)."""
    if s1.dim() == 1:
        return s1, s2, 1
    if not bn_channel.adds_in_kernel(s1.shape[1]):
        return s1.sum(dim=1), s2.sum(dim=1), 1
    return s1, s2, s1.shape[1]


def _channel_vectors(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous() for t in tensors)


def bn_train_stats(y: torch.Tensor, gamma: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                   eps: float, momentum: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch_norm.train_stats``: the sums' partials in one pass over ``y`` (``bn_stats``), then in
    one kernel a block a channel the sums, the statistics, ``gamma * invstd`` and the running
    statistics (written in place; ``elementwise.bn_finish``) instead of two torch reductions and
    ~20 torch launches of one-channel vectors."""
    if y.dim() != 4 or y.dtype != torch.float32 or not _channel_vectors(gamma, running_mean, running_var):
        return train_stats(y, gamma, running_mean, running_var, eps, momentum)
    s1, s2, k = _partials_for_kernel(*_bn_sums(y))
    wl = elementwise.ElementwiseWorkload("bn_finish", tuple(y.shape), eps=float(eps), momentum=float(momentum),
                                         partials=k)
    mean, invstd, scale = (torch.empty_like(running_mean) for _ in range(3))
    # the running statistics are inputs and outputs both: one thread reads its channel's, then writes it
    _call("bn_finish", wl, y.device, s1, s2, gamma.detach(), running_mean, running_var,
          mean, invstd, scale, running_mean, running_var, outputs=5)
    return mean, invstd, scale


def bn_coeffs(s1: torch.Tensor, s2: torch.Tensor, gamma: torch.Tensor, invstd: torch.Tensor, m: int
              ) -> tuple[torch.Tensor, ...]:
    """``batch_norm.grad_coefficients`` in one kernel a channel (``elementwise.bn_coeffs``); ``s1``,
    ``s2`` the float64 sums ``[C]`` or, from :func:`bn_grad_sums`, their ``[C, K]`` partials, which
    the kernel adds (a block a channel)."""
    if s1.dtype != torch.float64 or s2.dtype != torch.float64 or not _channel_vectors(gamma, invstd):
        return grad_coefficients(s1, s2, gamma, invstd, m)     # adds partials itself
    s1, s2, k = _partials_for_kernel(s1, s2)
    c = gamma.shape[0]
    wl = elementwise.ElementwiseWorkload("bn_coeffs", (m, c, 1, 1), partials=k)   # M a channel, as N x 1 x 1
    outs = [torch.empty_like(invstd) for _ in range(5)]
    _call("bn_coeffs", wl, s1.device, s1.contiguous(), s2.contiguous(), gamma, invstd, *outs, outputs=5)
    return tuple(outs)


def _scalar(t: torch.Tensor, device: torch.device) -> bool:
    return t.dtype == torch.float32 and t.dim() == 0 and t.device == device


def update_range(buf: torch.Tensor, m: torch.Tensor, momentum: float) -> None:
    """``functional.update_range_torch`` in one kernel (``elementwise.range_ema``), ``buf`` written
    in place (by the kernel: ``buf._version`` does not move, which nothing reads for a range
    buffer, never saved for backward)."""
    if not (_scalar(buf, buf.device) and _scalar(m, buf.device) and _ready(buf) is buf):
        return update_range_torch(buf, m, momentum)
    wl = elementwise.ElementwiseWorkload("range_ema", (1, 1, 1, 1), momentum=float(momentum))
    # buf is an input and the output both: the one thread reads it, then writes it
    _call("range_ema", wl, buf.device, buf.view(1), m.contiguous().view(1), buf.view(1))


def conv_scales(amax: torch.Tensor, w_amax: torch.Tensor, times: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``functional.conv_scales_torch`` in one kernel (``elementwise.conv_scales``): ``s_x`` (0-d,
    a view of one of the kernel's ``[O]`` copies), ``s_w`` and ``s_x * s_w`` (``times * s_w``)."""
    device = w_amax.device
    if not (_scalar(amax, device) and _channel_vectors(w_amax) and (times is None or _scalar(times, device))):
        return conv_scales_torch(amax, w_amax, times)
    o = w_amax.shape[0]
    wl = elementwise.ElementwiseWorkload("conv_scales", (1, o, 1, 1), mult=times is not None)
    outs = [torch.empty_like(w_amax) for _ in range(3)]
    extra = [] if times is None else [times.detach().contiguous().view(1)]
    _call("conv_scales", wl, device, amax.detach().contiguous().view(1), w_amax.detach(), *extra, *outs, outputs=3)
    return outs[0][0], outs[1], outs[2]


def bn_relu(y: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, beta: torch.Tensor,
            addend: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_norm.normalize_relu`` in one kernel (``elementwise.bn_relu``: the output, its bits
    and its range, noted for ``functional.batch_amax``) where ``y`` fills whole bytes of bits."""
    if y.dim() != 4 or y.dtype != torch.float32 or y.numel() % relu_bits_amax.ELEMENTS:
        return normalize_relu(y, mean, scale, beta, addend)
    wl = elementwise.ElementwiseWorkload("bn_relu", tuple(y.shape), addend=addend is not None)
    out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    bits = torch.empty((y.numel() // 8,), dtype=torch.uint8, device=y.device)
    part = torch.empty((y.numel() // 8,), dtype=torch.int32, device=y.device)
    coeffs = [t.to(torch.float32).contiguous() for t in (mean, scale, beta)]
    _call("bn_relu", wl, y.device, y.reshape(-1), *coeffs, *([] if addend is None else [addend.reshape(-1)]),
          out.view(-1), bits, part, outputs=3)
    _note_range(out, part)
    return out, bits


def bn_grad_sums(g: torch.Tensor, bits: torch.Tensor, y: torch.Tensor, mean: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_norm.grad_sums`` in one pass over ``g``, its bits and ``y`` (``elementwise.bn_grad_sums``),
    as ``[C, K]`` float64 per-thread partials, which :func:`bn_coeffs` adds (``batch_norm``'s
    backward hands them over as they are)."""
    if g.dim() != 4 or g.dtype != torch.float32 or y.dtype != torch.float32:
        return grad_sums(g, bits, y, mean)
    wl = elementwise.ElementwiseWorkload("bn_grad_sums", tuple(g.shape))
    blocks, threads, _ = elementwise.stats_grid(g.shape)
    s1 = torch.empty((g.shape[1], blocks * threads), dtype=torch.float64, device=g.device)
    s2 = torch.empty_like(s1)
    four = elementwise.quads(g.shape)
    _call("bn_grad_sums", wl, g.device, _ready(g.reshape(-1) if four else g), _ready(y.reshape(-1) if four else y),
          bits, mean.to(torch.float32), s1.view(-1, blocks, threads), s2.view(-1, blocks, threads), outputs=2)
    return s1, s2


def bn_grad(g: torch.Tensor, bits: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, a: torch.Tensor,
            b: torch.Tensor, c: torch.Tensor, want_dz: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``batch_norm.grad_apply`` in one pass (``elementwise.bn_grad``): ``dy`` [and ``dz``]."""
    if g.dim() != 4 or g.dtype != torch.float32 or y.dtype != torch.float32:
        dy, dz = grad_apply(g, bits, y, mean, a, b, c)
        return dy, (dz if want_dz else None)
    wl = elementwise.ElementwiseWorkload("bn_grad", tuple(g.shape), addend=want_dz)
    outs = [torch.empty(g.shape, dtype=torch.float32, device=g.device) for _ in range(1 + want_dz)]
    coeffs = [t.to(torch.float32).contiguous() for t in (mean, a, b, c)]
    _call("bn_grad", wl, g.device, _ready(g).view(-1), bits, _ready(y).view(-1), *coeffs,
          *[o.view(-1) for o in outs], outputs=len(outs))     # flat, as the kernel takes them
    return outs[0], (outs[1] if want_dz else None)


def quantize_grad(g: torch.Tensor, bits: torch.Tensor | None, s_dx: torch.Tensor | None, mult: torch.Tensor | None,
                  s_dw: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``functional.quantize_grad_torch`` in one pass over ``g`` (``elementwise.quantize_grad``)."""
    if g.dim() != 4 or g.dtype != torch.float32 or (s_dx is None and s_dw is None):
        return quantize_grad_torch(g, bits, s_dx, mult, s_dw)
    wl = elementwise.ElementwiseWorkload("quantize_grad", tuple(g.shape), relu=bits is not None,
                                         dx=s_dx is not None, dw=s_dw is not None)
    outs = [torch.empty(g.shape, dtype=torch.int8, device=g.device) for _ in range(wl.dx + wl.dw)]
    args = ([g] + ([] if bits is None else [bits])
            + ([s_dx.to(torch.float32).reshape(1), mult.to(torch.float32)] if wl.dx else [])
            + ([s_dw.to(torch.float32)] if wl.dw else []))
    _call("quantize_grad", wl, g.device, *args, *outs, outputs=len(outs))
    return (outs[0] if wl.dx else None), (outs[-1] if wl.dw else None)


def max_pool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``max_pool.max_pool2x2_torch`` in one kernel (``elementwise.max_pool``)."""
    if x.dim() != 4 or x.dtype != torch.float32 or min(x.shape[2:]) < max_pool2x2.POOL:
        return max_pool2x2.max_pool2x2_torch(x)
    n, c, h, w = x.shape
    out = torch.empty((n, c, h // 2, w // 2), dtype=torch.float32, device=x.device)
    index = torch.empty(out.shape, dtype=torch.uint8, device=x.device)
    _call("max_pool", elementwise.ElementwiseWorkload("max_pool", tuple(x.shape)), x.device, x, out, index,
          outputs=2)
    return out, index


def max_pool_grad(g: torch.Tensor, index: torch.Tensor, input_shape) -> torch.Tensor:
    """``max_pool.max_pool2x2_grad_torch`` in one kernel (``elementwise.max_pool_grad``)."""
    if g.dim() != 4 or g.dtype != torch.float32:
        return max_pool2x2.max_pool2x2_grad_torch(g, index, input_shape)
    dx = torch.empty(tuple(input_shape), dtype=torch.float32, device=g.device)
    _call("max_pool_grad", elementwise.ElementwiseWorkload("max_pool_grad", tuple(input_shape)), g.device, g, index,
          dx)
    return dx


def flip_transpose(w_q: torch.Tensor, groups: int) -> torch.Tensor:
    """``functional.flipped_transposed_torch`` in one kernel (``elementwise.flip_transpose``) where
    there is one group and the shape takes whole tiles (``elementwise.flip_transpose_tiles``);
    torch otherwise.  The ``[C, O, KH, KW]`` result is a view of the kernel's ``[C, KH, KW, O]``:
    the layout ``_pack_weight_nhwc32`` reads as it is (no copy where the channels are whole 32s)."""
    if groups != 1 or w_q.dtype != torch.int8 or not elementwise.flip_transpose_tiles(tuple(w_q.shape)):
        return flipped_transposed_torch(w_q, groups)
    o, c, kh, kw = w_q.shape
    out = torch.empty((c, kh, kw, o), dtype=torch.int8, device=w_q.device)
    _call("flip_transpose", elementwise.ElementwiseWorkload("flip_transpose", tuple(w_q.shape)), w_q.device,
          _ready(w_q), out)
    return out.permute(0, 3, 1, 2)


def scale_sums(sums: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``functional.scale_sums_torch`` in one kernel (``elementwise.scale_sums``) where ``sums`` is
    :func:`int8_weight_grad`'s int32 OIHW view of a contiguous ``[C, KH, KW, O]`` and the shape
    takes whole tiles (``elementwise.scale_sums_tiles``); torch otherwise."""
    if (sums.dtype != torch.int32 or sums.dim() != 4 or not sums.permute(1, 2, 3, 0).is_contiguous()
            or not elementwise.scale_sums_tiles(tuple(sums.shape))):
        return scale_sums_torch(sums, scale)
    base = sums.permute(1, 2, 3, 0)
    o = sums.shape[0]
    dw = torch.empty(sums.shape, dtype=torch.float32, device=sums.device)
    _call("scale_sums", elementwise.ElementwiseWorkload("scale_sums", tuple(sums.shape)), sums.device,
          base.reshape(-1, o), scale.to(torch.float32).reshape(-1), dw.view(o, -1))
    return dw


def int8_weight_grad(x_q: torch.Tensor, g_q: torch.Tensor, weight_shape: Sequence[int], stride, padding, dilation,
                     groups: int) -> torch.Tensor | None:
    """The int8 weight gradient's exact sums ``sum_{n, y, x} g_q * x_q`` (OIHW; int32 from one slice, int64 where slices are added) on the int8
    tensor cores: ``functional.int8_weight_grad_cpu``'s contract; None for a conv they cannot take
    (``conv_choices.weight_grad_conv``).

    The conv of the input with the gradient as its kernel (``schedules/training/grad_weight_mma.py``):
    ``x_q`` packed with its channels as the batch (``[C, H, W, N_p]``), ``g_q`` with its output
    channels as the kernel's (``[O_p, OH*OW*N_p]``), both int8 copies; the kernel stores each
    split's int32 sums ``[S, C, KH', KW', O_p]``, added here in int64.
    """
    o, _, kh, kw = weight_shape
    wl = ConvWorkload(*x_q.shape, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups,
                      activation="none", act_min=QMIN, out_dtype="int32")
    conv = conv_choices.weight_grad_conv(wl, _target_info(x_q.device))
    if conv is None:
        return None
    conv = _measured_splits(conv, x_q.device)
    return weight_grad_by_conv(conv, x_q, g_q, weight_shape)


@functools.lru_cache(maxsize=None)
def _measured_splits(conv: ConvWorkload, device: torch.device) -> ConvWorkload:
    """``conv`` with the split count its measured choice runs (``conv_table.choice_workload``).
    Cached per process: a table rewritten by a search during training is read by the next run."""
    arch = device_target(device)[1]
    return conv_table.choice_workload(conv, conv_table.lookup(conv, arch))


def weight_grad_by_conv(conv: ConvWorkload, x_q: torch.Tensor, g_q: torch.Tensor,
                        weight_shape: Sequence[int]) -> torch.Tensor:
    """:func:`int8_weight_grad` through the forward kernel of ``conv`` (``weight_grad_conv``'s
    workload) on ``x_q``'s device, whatever target planned it (the CPU tests run a CUDA plan's
    workload on llvm)."""
    o, _, kh, kw = weight_shape
    splits = (conv.splits,) if conv.splits > 1 else ()
    acc = torch.empty(splits + (conv.batch, conv.out_height, conv.out_width, _ceil32(o)), dtype=torch.int32,
                      device=x_q.device)
    gradient = _pack_input_nhwc32(g_q, transpose=True, pad_rows=True)     # [O_p, OH, OW, N_p]
    _call("forward", conv, x_q.device, _pack_input_nhwc32(x_q, transpose=True), gradient.view(gradient.shape[0], -1),
          acc)
    acc = acc.sum(0) if splits else acc     # one slice: exact in int32; slices added in int64
    return acc[:, :kh, :kw, :o].permute(3, 0, 1, 2)


@functools.lru_cache(maxsize=None)
def _target_info(device: torch.device) -> TargetInfo:
    return TargetInfo.from_target(device_target(device)[0])


def register(device_type: str = "cuda") -> None:
    """Make these kernels compute the int8 conv and both gradients for ``device_type`` tensors."""
    register_int8_conv_kernel(device_type, int8_conv)
    register_conv_grad_kernels(device_type, conv_input_grad, conv_weight_grad)
    INT8_WEIGHT_GRAD_KERNELS[device_type] = int8_weight_grad
    ELEMENTWISE_KERNELS[device_type] = {"quantize": quantize, "int8_conv_dequantized": int8_conv_dequantized,
                                        "relu_bits": relu_bits, "relu_with_bits": relu_with_bits, "mask": mask,
                                        "grad_stats": grad_stats,
                                        "quantize_grad": quantize_grad, "max_pool": max_pool,
                                        "max_pool_grad": max_pool_grad, "scale_sums": scale_sums,
                                        "flip_transpose": flip_transpose,
                                        "bn_train_stats": bn_train_stats,
                                        "bn_coeffs": bn_coeffs, "bn_relu": bn_relu,
                                        "bn_grad_sums": bn_grad_sums, "bn_grad": bn_grad,
                                        "update_range": update_range, "conv_scales": conv_scales}


def report() -> list[dict]:
    """Every kernel called so far: kind, workload, calls and build seconds (0 = loaded from disk)."""
    return [{"kind": k, "workload": d, "calls": n, "build_s": round(BUILD_SECONDS.get((k, d), 0.0), 2)}
            for (k, d), n in sorted(CALLS.items())]
