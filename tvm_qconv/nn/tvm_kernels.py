"""The training path's TVM kernels: int8 conv forward, input and weight gradients on torch tensors.

Three compute definitions from ``schedules/``, compiled once per shape, cached in memory and
on disk, and called on torch tensors zero-copy (tvm-ffi takes them through DLPack):

============  =======================================================  ===================================
kind          kernel                                                   CUDA schedule
============  =======================================================  ===================================
``forward``   ``conv2d_nchw4c_int8(wl, requantize=False)`` int32 out   ``schedule_dp4a`` (``__dp4a``)
``grad_input``  ``conv2d_grad_input_int8``  float32 dx                 ``schedule_grad_input_cuda``
``grad_weight`` ``conv2d_grad_weight_int8`` float32 split-K dw         ``schedule_grad_weight_cuda``
============  =======================================================  ===================================

On CUDA they replace the forward int8 conv and both conv gradients (:func:`register`, called
lazily by :mod:`tvm_qconv.nn.functional` when the first CUDA tensor arrives: importing
``tvm_qconv`` neither imports TVM nor needs CUDA).  On the CPU the same definitions are built
unscheduled for llvm: slow, and used only by the tests, which run the autograd layer through
them to check everything this module does around the kernels (packing, groups, the linear-layer
layout, split-K sums) without a GPU.

Layout work happens in torch, on the device, in int8 where possible: NCHW int8 -> NCHW4c and
OIHW int8 -> OIHW4o4i before the forward kernel (1 byte per element), NCHW4c int32 -> NCHW
after it.  The gradient kernels take plain NCHW / OIHW through free views.

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
* **Groups** run as one kernel call per group on that group's packed slices (a grouped compute
  is the upgrade; no model here has groups).  The gradient kernels have a group axis.
* **Linear layers** arrive as 1x1 convs on 1x1 images (``H = W = 1``).  They run as a 1x1 conv
  on *one* 1 x N image (the batch becomes the width): the same result, but the forward
  schedule tiles 32 columns x 8 output-channel groups instead of one pixel per block.
* **Cache.** Key = kind, workload, target (arch), TVM version and a hash of the kernel source
  files (so editing a schedule rebuilds its kernels).  Each ``.so`` is written to a temp file
  and ``os.replace``d into place: an interrupted build never leaves a partial entry, and an
  entry that fails to load is rebuilt with a warning.  Directory: ``$TVM_QCONV_KERNEL_CACHE``,
  else ``~/.cache/tvm_qconv/kernels``.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

CACHE_ENV = "TVM_QCONV_KERNEL_CACHE"
ALIGNMENT = 64  # bytes; TVM's kAllocAlignment, which its kernels assume for every argument
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Files whose text defines each kind of kernel (this one included: it calls them).
_SOURCES = {
    "forward": ("schedules/conv2d_nchw4c_int8.py", "schedules/requantize.py", "schedules/conv2d_nchw4c_dp4a.py"),
    # The gradient kernels use conv_output_size and the dp4a file's loop helpers too.
    "grad_input": ("schedules/conv2d_grad_input_int8.py", "schedules/conv2d_nchw4c_int8.py",
                   "schedules/conv2d_nchw4c_dp4a.py"),
    "grad_weight": ("schedules/conv2d_grad_input_int8.py", "schedules/conv2d_grad_weight_int8.py",
                    "schedules/conv2d_nchw4c_int8.py", "schedules/conv2d_nchw4c_dp4a.py"),
}

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


def _source_hash(kind: str) -> str:
    h = hashlib.sha256()
    for rel in _SOURCES[kind] + ("tvm_qconv/nn/tvm_kernels.py",):
        with open(os.path.join(_REPO, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def device_target(device: torch.device) -> tuple[object, str]:
    """``(tvm target, short name)`` for a torch device: CUDA at the device's arch, or llvm.

    Cached: every kernel call looks its kernel up through this, and building a Target and
    querying the device capability each time would sit on the training step's hot path."""
    if device.type == "cuda":
        from ..build import make_target
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
        return make_target("cuda", arch), arch
    if device.type == "cpu":
        import tvm
        return tvm.target.Target("llvm"), "llvm"
    raise NotImplementedError(f"no TVM kernels for device type {device.type!r}")


def _definition(kind: str, wl, target):
    """The PrimFunc of one kernel: scheduled for CUDA, the bare compute definition for llvm."""
    cuda = target.kind.name == "cuda"
    if kind == "forward":
        from schedules.conv2d_nchw4c_int8 import conv2d_nchw4c_int8
        func = conv2d_nchw4c_int8(wl, requantize=False)
        if cuda:
            from schedules.conv2d_nchw4c_dp4a import schedule_dp4a
            func = schedule_dp4a(func, target)
    elif kind == "grad_input":
        from schedules.conv2d_grad_input_int8 import conv2d_grad_input_int8, schedule_grad_input_cuda
        func = conv2d_grad_input_int8(wl)
        if cuda:
            func = schedule_grad_input_cuda(func, target)
    elif kind == "grad_weight":
        from schedules.conv2d_grad_weight_int8 import conv2d_grad_weight_int8, schedule_grad_weight_cuda
        func = conv2d_grad_weight_int8(wl)
        if cuda:
            func = schedule_grad_weight_cuda(func, target)
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    return func


def symbol(kind: str) -> str:
    """The compiled function's name (its CUDA kernel is this + ``_kernel``)."""
    return f"tvm_qconv_{kind}"


def cache_key(kind: str, wl, arch: str) -> dict:
    """Everything a cached kernel depends on."""
    import tvm
    return {"kind": kind, "workload": wl.to_dict(), "arch": arch, "tvm": tvm.__version__,
            "source": _source_hash(kind)}


def cache_path(kind: str, wl, arch: str) -> str:
    key = json.dumps(cache_key(kind, wl, arch), sort_keys=True)
    return os.path.join(cache_dir(), f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.so")


def _build(kind: str, wl, target, path: str) -> None:
    """Compile one kernel and write it to ``path`` atomically (temp file in the same folder + rename)."""
    import tvm
    # Named per kind, so that profilers show e.g. ``tvm_qconv_grad_input_kernel``, not ``main_kernel``.
    func = _definition(kind, wl, target).with_attr("global_symbol", symbol(kind))
    with target:
        ex = tvm.compile(tvm.IRModule({symbol(kind): func}), target=target)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        ex.export_library(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def get_kernel(kind: str, wl, device: torch.device) -> Callable:
    """The compiled ``kind`` kernel for workload ``wl`` on ``device``: memory, then disk, then build.

    Args:
        kind: ``"forward"``, ``"grad_input"`` or ``"grad_weight"``.
        wl: ``Conv2dWorkload`` (forward) or ``ConvGradWorkload`` (gradients).
        device: the torch device the tensors live on.

    Returns:
        A tvm-ffi function taking the kernel's tensors (torch tensors work as they are).
    """
    target, arch = device_target(device)
    mem_key = (kind, wl, arch, device.index)
    fn = _kernels.get(mem_key)
    if fn is not None:
        return fn
    with _lock:
        fn = _kernels.get(mem_key)
        if fn is None:
            fn = _load_or_build(kind, wl, target, arch)
            _kernels[mem_key] = fn
    return fn


def _load_or_build(kind: str, wl, target, arch: str) -> Callable:
    import tvm
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


def describe(wl) -> str:
    """``wl.describe()`` plus the padding and dilation, which it leaves out."""
    pad = "" if wl.padding == (1, 1, 1, 1) else f" pad{wl.padding}"
    dil = "" if wl.dilation == (1, 1) else f" d{wl.dilation[0]}x{wl.dilation[1]}"
    return wl.describe() + pad + dil


def _call(kind: str, wl, device: torch.device, *tensors: torch.Tensor) -> None:
    """Run a kernel: inputs made ready for TVM (copied if needed), the output (last) written in place."""
    fn = get_kernel(kind, wl, device)
    *inputs, out = tensors
    if _ready(out) is not out:  # a copy would take the result away with it
        raise ValueError(f"{kind} output must be contiguous and {ALIGNMENT}-byte aligned")
    CALLS[(kind, describe(wl))] += 1
    fn(*[_ready(t) for t in inputs], out)


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


def _pack_input(x: torch.Tensor) -> torch.Tensor:
    """int8 [N, C, H, W] -> [N, C4/4, H, W, 4] (zero channels appended)."""
    n, c, h, w = x.shape
    xp = _pad_dim(x, 1, _ceil4(c))
    return xp.reshape(n, -1, 4, h, w).permute(0, 1, 3, 4, 2).contiguous()


def _pack_weight(w: torch.Tensor) -> torch.Tensor:
    """int8 [O, I, KH, KW] -> [O4/4, I4/4, KH, KW, 4o, 4i] (zero channels appended)."""
    o, i, kh, kw = w.shape
    wp = _pad_dim(_pad_dim(w, 0, _ceil4(o)), 1, _ceil4(i))
    return wp.reshape(-1, 4, _ceil4(i) // 4, 4, kh, kw).permute(0, 2, 4, 5, 1, 3).contiguous()


def _unpack_output(acc: torch.Tensor, channels: int) -> torch.Tensor:
    """int32 [N, O4/4, OH, OW, 4] -> [N, channels, OH, OW] (a view; padded channels dropped)."""
    n, oc, oh, ow, _ = acc.shape
    return acc.permute(0, 1, 4, 2, 3).reshape(n, oc * 4, oh, ow)[:, :channels]


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
        int32 NCHW accumulators on ``x_q``'s device: a strided view of the kernel's NCHW4c output
        for one group (``functional._forward`` makes it contiguous float in one pass), contiguous
        otherwise.
    """
    from schedules.conv2d_nchw4c_int8 import Conv2dWorkload
    if _is_dense(x_q.shape, w_q.shape[2:], stride, padding, dilation, groups):
        out = int8_conv(_rows_to_width(x_q), w_q, stride, padding, dilation, groups)
        return _width_to_rows(out)
    n, c, h, w = x_q.shape
    o, cg, kh, kw = w_q.shape
    og = o // groups
    wl = Conv2dWorkload(n, cg, h, w, og, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), relu=False)
    shape = (n, _ceil4(og) // 4, wl.out_height, wl.out_width, 4)
    if groups == 1:
        acc = torch.empty(shape, dtype=torch.int32, device=x_q.device)
        _call("forward", wl, x_q.device, _pack_input(x_q), _pack_weight(w_q), acc)
        return _unpack_output(acc, og)
    out = torch.empty((n, o, wl.out_height, wl.out_width), dtype=torch.int32, device=x_q.device)
    for g in range(groups):
        acc = torch.empty(shape, dtype=torch.int32, device=x_q.device)
        _call("forward", wl, x_q.device, _pack_input(x_q[:, g * cg:(g + 1) * cg]),
              _pack_weight(w_q[g * og:(g + 1) * og]), acc)
        out[:, g * og:(g + 1) * og] = _unpack_output(acc, og)
    return out


def conv_input_grad(grad: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_shape: Sequence[int],
                    stride, padding, dilation, groups: int) -> torch.Tensor:
    """``dx = conv_transpose(grad * s_w, w_q)`` through the TVM kernel (float32, NCHW).

    Args:
        grad: float32 NCHW output gradient (contiguous).
        w_q: int8 OIHW weight; w_scale: float32 (O,) per-channel scales.
        input_shape: (N, C, H, W) of the forward input.
        stride, padding (top, left, bottom, right), dilation, groups: the forward conv's.
    """
    from schedules.conv2d_grad_input_int8 import ConvGradWorkload
    if _is_dense(input_shape, w_q.shape[2:], stride, padding, dilation, groups):
        n, k = input_shape[:2]
        dx = conv_input_grad(_rows_to_width(grad), w_q, w_scale, (1, k, 1, n), stride, padding, dilation, groups)
        return _width_to_rows(dx)
    n, c, h, w = input_shape
    o, cg, kh, kw = w_q.shape
    wl = ConvGradWorkload(n, c, h, w, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups)
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
    from schedules.conv2d_grad_input_int8 import ConvGradWorkload
    from schedules.conv2d_grad_weight_int8 import weight_grad_splits
    o, cg, kh, kw = weight_shape
    if _is_dense(x_q.shape, (kh, kw), stride, padding, dilation, groups):
        return conv_weight_grad(_rows_to_width(x_q), x_scale, _rows_to_width(grad), weight_shape, stride, padding,
                                dilation, groups)
    n, c, h, w = x_q.shape
    wl = ConvGradWorkload(n, c, h, w, o, (kh, kw), tuple(stride), tuple(padding), tuple(dilation), groups)
    g_ = groups
    splits = weight_grad_splits(wl)
    part = torch.empty((splits, g_, o // g_, cg, kh, kw), dtype=torch.float32, device=grad.device)
    _call("grad_weight", wl, grad.device, grad.view(n, g_, o // g_, wl.out_height, wl.out_width),
          x_q.view(n, g_, cg, h, w), x_scale.to(torch.float32).reshape(1), part)
    dw = part[0] if splits == 1 else part.sum(dim=0)
    return dw.view(o, cg, kh, kw)


def register(device_type: str = "cuda") -> None:
    """Make these kernels compute the int8 conv and both gradients for ``device_type`` tensors."""
    from .functional import register_conv_grad_kernels, register_int8_conv_kernel
    register_int8_conv_kernel(device_type, int8_conv)
    register_conv_grad_kernels(device_type, conv_input_grad, conv_weight_grad)


def report() -> list[dict]:
    """Every kernel called so far: kind, workload, calls and build seconds (0 = loaded from disk)."""
    return [{"kind": k, "workload": d, "calls": n, "build_s": round(BUILD_SECONDS.get((k, d), 0.0), 2)}
            for (k, d), n in sorted(CALLS.items())]
