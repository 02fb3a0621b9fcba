"""The training step's int8 convs, their kernel chosen per conv by measurement.

Every int8 conv of a training step on the tensor cores -- the forward, ``dx`` (a forward conv
of the gradient with the flipped weight) and ``dw`` (a split-K conv of the input with the
gradient) -- is by default one template's kernel at its default, heuristic tiles.  Here each
conv's *choices* (``schedules/training/conv_choices.py``: the template's other tiles, and on the
GPUs that have it another family's kernel) are measured on the GPU and the fastest kept.

:func:`search` builds all choices in parallel processes and times each as 20 calls captured in
a CUDA graph (``compare.measure.cuda_graph_ms``), its int32 output checked against the default's
bit for bit (a choice that differs is dropped, and said).  The table (:mod:`conv_table`:
``tuning_logs/training-convs-<arch>.json`` or the file ``$TVM_QCONV_CONV_TILES`` names) keeps
one entry per workload: its default's and its best choice's times and the choice
:mod:`tvm_kernels` then builds it with.  The best is taken only when it is at least
:data:`MIN_GAIN` faster than the default (timing noise is ~1 %); otherwise the entry says the
default stays.  The table is rewritten (atomically) after each workload: an interrupted search
keeps what it measured, and the same command goes on from there.

Workloads are matched by their exact shape (batch included): tune with the batch you train with.
The kernel cache key of a tabled workload includes its choice, so a changed entry rebuilds just
that kernel.

``python tune.py --training --model vgg16 --batch 32`` runs :func:`tune_model`.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
import tvm

from .. import registry
from ..compare.measure import cuda_graph_ms
from ..errors import InputError
from ..models import QuantizedVGG16, quantized_resnet50
from ..schedules.training import conv_choices
from ..schedules.workload import ConvWorkload
from ..target import TargetInfo
from . import conv_table, tvm_kernels

MIN_GAIN = 0.03                 # a candidate replaces the default only when >= 3 % faster
_TYPES = {"int8": torch.int8, "int32": torch.int32}


def choose(default_ms: float, measured: list[tuple[dict, float]]) -> tuple[dict, float] | None:
    """The fastest of ``measured`` ``(choice, ms)`` where it beats ``default_ms`` by
    :data:`MIN_GAIN` or more; None where the default stays."""
    if not measured:
        return None
    best = min(measured, key=lambda m: m[1])
    return best if best[1] <= default_ms * (1 - MIN_GAIN) else None


# ----------------------------------------------------------------------------- measuring

GROUP = 8     # choices compiled into one library: nvcc and TVM's pipeline pay their fixed costs once


def _build_group(wl: ConvWorkload, arch: str, choices: dict[int, dict | None], path: str) -> dict[int, str | None]:
    """A worker: the forward kernels of ``wl`` as ``choices`` (index -> choice, None: the default;
    all of one build arch) into one library at ``path``, kernel ``c<index>`` each.  8 kernels
    in one library took 0.9 s a kernel to lower and compile, one alone 1.8 s (nvcc's and the
    pipeline's fixed costs; this machine, 2026-11-29).  Where the library fails to build, each
    kernel is built alone into ``<path>.<index>.so``.  Returns index -> None (built) or the error."""
    target = tvm_kernels.target_of(conv_choices.build_arch(next(iter(choices.values())), arch))
    impl = registry.get(conv_choices.IMPL)
    options = registry.compile_options([impl])

    def function(j: int):
        choice = choices[j]
        cw = conv_table.choice_workload(wl, choice)
        func = (conv_choices.schedule(impl.compute(cw), choice, target) if choice else
                tvm_kernels._definition("forward", cw, target))
        return func.with_attr("global_symbol", f"c{j}")

    def build(indices, out: str) -> None:
        with target, tvm.transform.PassContext(opt_level=3, config=options["config"]):
            ex = tvm.compile(tvm.IRModule({f"c{j}": function(j) for j in indices}), target=target,
                             tir_pipeline=options["tir_pipeline"])
        ex.export_library(out)

    try:
        build(list(choices), path)
        return {j: None for j in choices}
    except Exception:  # noqa: BLE001  one bad kernel: the others alone
        errors = {}
        for j in choices:
            try:
                build([j], f"{path}.{j}.so")
                errors[j] = None
            except Exception as err:  # noqa: BLE001
                errors[j] = f"{type(err).__name__}: {err}"
        return errors


def _arguments(func, device: torch.device, generator: torch.Generator) -> list[torch.Tensor]:
    """Random int8 inputs and a zeroed output of ``func``'s parameter shapes."""
    args = []
    for p in func.params:     # TVM 0.27's tirx PrimFunc: each parameter is its buffer
        shape, dtype = [int(s) for s in p.shape], _TYPES[str(p.dtype)]
        if dtype == torch.int8:
            args.append(torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=generator))
        else:
            args.append(torch.zeros(shape, dtype=dtype, device=device))
    return args


def search(workloads: list[ConvWorkload], device: torch.device, *, workers: int | None = None,
           seconds: float | None = None, on_row: Callable[[dict], None] | None = None,
           timer: Callable | None = None) -> list[dict]:
    """Measure the choices of each workload on ``device`` (module docstring): those
    ``conv_choices.measured_choices`` gives for the GPU; one row per workload measured before
    ``seconds`` ran out, each also handed to ``on_row`` as it is done.

    Row: ``workload``, ``describe``, ``gemm`` ``[M_p, O_p, K]`` (K of one slice), ``default`` and
    ``best`` (``{"choice", "ms"}``; ``best`` None where the default stays), ``measured`` (every
    choice's ``ms``, None for one that failed to build or gave other bits) and ``tops_default`` /
    ``tops_best`` on the padded GEMM, every slice (what the tensor cores execute)."""
    timer = timer or (lambda fn: cuda_graph_ms(fn, reps=20, iters=5))
    arch = tvm_kernels.device_target(device)[1]
    capability = torch.cuda.get_device_capability(device)
    deadline = None if seconds is None else time.monotonic() + seconds
    plans = []
    for wl in workloads:
        impl = tvm_kernels._impl("forward", wl, tvm_kernels.target_of(arch))
        if impl.name != conv_choices.IMPL:
            continue
        func = impl.compute(wl)
        gemm = conv_choices.gemm_extents(func)
        default = conv_choices.default_choice(*gemm, TargetInfo.from_target(tvm_kernels.target_of(arch)).num_sm)
        num_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else \
            TargetInfo.from_target(tvm_kernels.target_of(arch)).num_sm
        choices = conv_choices.measured_choices(wl, gemm, default, capability, num_sm)
        plans.append((wl, func, gemm, [None] + choices, default))
    rows = []
    with tempfile.TemporaryDirectory(prefix="conv_tiles-") as tmp, concurrent.futures.ProcessPoolExecutor(
            max(1, workers or os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = []     # per workload: (library path, its indices, future) per group of one build arch
        for i, (wl, _, _, choices, _) in enumerate(plans):
            by_arch: dict[str, list[int]] = {}
            for j, choice in enumerate(choices):
                by_arch.setdefault(conv_choices.build_arch(choice, arch), []).append(j)
            groups = [idx[g:g + GROUP] for idx in by_arch.values() for g in range(0, len(idx), GROUP)]
            futures.append([(path := os.path.join(tmp, f"{i}-{n}.so"), idx,
                             pool.submit(_build_group, wl, arch, {j: choices[j] for j in idx}, path))
                            for n, idx in enumerate(groups)])
        try:
            for i, (wl, func, gemm, choices, default) in enumerate(plans):
                if deadline is not None and time.monotonic() > deadline:
                    print(f"[tune --training] time is up: {len(plans) - i} workloads left for the next run", flush=True)
                    break
                rows.append(_measure_one(wl, func, gemm, choices, default, futures[i], device, timer))
                if on_row is not None:
                    on_row(rows[-1])
        finally:
            pool.shutdown(cancel_futures=True)
    return rows


def _kernels_of(groups) -> dict[int, object]:
    """index -> the built kernel, or the reason it is missing, from :func:`_build_group`'s libraries
    (the functions their host code calls at run time are registered: ``tvm_kernels`` does it)."""
    found = {}
    for path, indices, future in groups:
        try:
            errors = future.result()
        except Exception as err:  # noqa: BLE001  the worker died: every kernel of its group is missing
            errors = {j: f"{type(err).__name__}: {err}" for j in indices}
        whole = all(e is None for e in errors.values()) and os.path.exists(path)
        for j in indices:
            if errors.get(j) is not None:
                found[j] = errors[j]
                continue
            try:
                found[j] = tvm.runtime.load_module(path if whole else f"{path}.{j}.so")[f"c{j}"]
            except Exception as err:  # noqa: BLE001  a library that does not load: that kernel is missing
                found[j] = f"{type(err).__name__}: {err}"
    return found


def _measure_one(wl, func, gemm, choices, default, groups, device, timer) -> dict:
    """One workload's choices, timed; a split-K workload's with the caller's sum over the slices
    (``tvm_kernels.weight_grad_by_conv``: int64), since a choice may change the slice count."""
    g = torch.Generator(device=device).manual_seed(0)
    *inputs, out = _arguments(func, device, g)
    split = wl.splits > 1      # the default's output has a slice axis
    reference, measured = None, []
    kernels = _kernels_of(groups)
    for j, choice in enumerate(choices):
        fn = kernels[j]
        if isinstance(fn, str):      # a choice the kernels cannot build: skipped, said
            print(f"  {tvm_kernels.describe(wl)}: {conv_choices.describe_choice(choice)} did not build "
                  f"({fn[:200]})", flush=True)
            measured.append(None)
            continue
        slices = conv_table.choice_workload(wl, choice).splits      # a resplit dw's own count (1: no slice axis)
        shape = tuple(out.shape[1:]) if split else tuple(out.shape)
        acc = torch.zeros(((slices,) + shape) if slices > 1 else shape, dtype=out.dtype, device=device)

        def run(fn=fn, acc=acc, slices=slices):     # what the step runs: the kernel, the slices' int64 sum
            fn(*inputs, acc)
            return acc.sum(0) if slices > 1 else acc
        result = run().to(torch.int64)     # compared outside the timed call (a full pass of the output)
        if reference is None:
            reference = result.clone()
        elif not torch.equal(result, reference):
            print(f"  {tvm_kernels.describe(wl)}: {conv_choices.describe_choice(choice)} gives other sums than the "
                  "default: dropped", flush=True)
            measured.append(None)
            continue
        measured.append(timer(run))
        del acc
    if measured[0] is None:
        raise RuntimeError(f"the default kernel of {tvm_kernels.describe(wl)} did not build or run")
    ops = 2 * gemm[0] * gemm[1] * gemm[2] * wl.splits     # gemm's K is one slice's
    default_ms = measured[0]
    pick = choose(default_ms, [(c, ms) for c, ms in zip(choices[1:], measured[1:]) if ms is not None])
    best_ms = pick[1] if pick else default_ms
    row = {"workload": wl.to_dict(), "describe": tvm_kernels.describe(wl), "gemm": list(gemm),
           "default": {"choice": default, "ms": default_ms},
           "best": None if pick is None else {"choice": pick[0], "ms": pick[1]},
           "measured": [{"choice": c or default, "ms": ms} for c, ms in zip(choices, measured)],
           "tops_default": ops / default_ms / 1e9, "tops_best": ops / best_ms / 1e9}
    picked = conv_choices.describe_choice(pick and pick[0])
    print(f"  {row['describe']:<48} default {default_ms:8.4f} ms  best {best_ms:8.4f} ms "
          f"({default_ms / best_ms:4.2f}x, {row['tops_best']:6.1f} TOPS, {picked}) of {len(measured)}", flush=True)
    return row


# ----------------------------------------------------------------------------- a model's convs

MODELS = ("vgg16", "resnet50")


def training_workloads(model_name: str, batch: int, image_size: int, device: torch.device) -> list[ConvWorkload]:
    """Every int8 conv workload (forward, dx, dw) of one training step of ``model_name`` at
    ``batch`` on ``device``, from a dry run that builds and runs nothing (``tvm_kernels.kernel_jobs``)."""
    if model_name not in MODELS:
        raise InputError(f"--training tunes the training models {', '.join(MODELS)}; got {model_name!r}")
    num_classes = 1000
    model = (QuantizedVGG16(num_classes=num_classes, image_size=image_size, input_grad="int8", weight_grad="int8")
             if model_name == "vgg16" else quantized_resnet50(num_classes=num_classes, input_grad="int8",
                                                                weight_grad="int8")).to(device).train()
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    # with no table: the dw convs at their default split counts (a choice may change them)
    previous = os.environ.get(conv_table.TABLE_ENV)
    os.environ[conv_table.TABLE_ENV] = os.path.join(tempfile.gettempdir(), "tvm_qconv-no-conv-table.json")
    tvm_kernels._measured_splits.cache_clear()
    try:
        jobs = tvm_kernels.kernel_jobs(lambda: F.cross_entropy(model(x), labels).backward())
    finally:
        if previous is None:
            del os.environ[conv_table.TABLE_ENV]
        else:
            os.environ[conv_table.TABLE_ENV] = previous
        tvm_kernels._measured_splits.cache_clear()
    seen, out = set(), []
    for kind, wl, _ in jobs:
        if kind == "forward" and wl not in seen:
            seen.add(wl)
            out.append(wl)
    return out


def tune_model(model_name: str, batch: int, image_size: int = 224, workers: int | None = None,
               seconds: float | None = None, redo: bool = False, table: str | None = None) -> list[dict]:
    """Measure the tiles of every training conv of ``model_name`` at ``batch`` on this machine's
    GPU and keep the choices in the table (module docstring); workloads already in the table are
    skipped unless ``redo``.  Returns the rows measured now."""
    if not torch.cuda.is_available():
        raise InputError("tune.py --training measures on a CUDA GPU and none is visible: run it on the GPU machine")
    device = torch.device("cuda")
    arch = tvm_kernels.device_target(device)[1]
    path = table or conv_table.table_path(arch)
    done = set() if redo else {conv_table.key(ConvWorkload.from_dict(r["workload"]))
                               for r in conv_table.read_table(path)["layers"]}
    workloads = [wl for wl in training_workloads(model_name, batch, image_size, device)
                 if conv_table.key(wl) not in done]
    print(f"[tune --training] {model_name} batch {batch}: {len(workloads)} conv workloads to measure "
          f"({len(done)} already in {path})", flush=True)
    meta = {"arch": arch, "tvm": tvm.__version__, "device": torch.cuda.get_device_name(device),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rows = search(workloads, device, workers=workers, seconds=seconds,
                  on_row=lambda row: conv_table.merge_rows(path, [row], meta))
    if rows:
        before = sum(r["default"]["ms"] for r in rows)
        after = sum((r["best"] or r["default"])["ms"] for r in rows)
        print(f"[tune --training] {len(rows)} workloads, once each: {before:.3f} ms at the default tiles, "
              f"{after:.3f} ms at the chosen ({before / after:.2f}x); table {path}", flush=True)
    else:
        warnings.warn("nothing measured")
    return rows
