"""The training step's int8 convs, their kernel chosen per conv by measurement.

Every int8 conv of a training step on the tensor cores -- the forward, ``dx`` (a forward conv
of the gradient with the flipped weight) and ``dw`` (the split-K conv of the input with the
gradient, ``schedules/training/grad_weight_mma.py``) -- is by default the ``mma.sync`` template
(``schedules/tensorcore/mma.py``) with int32 output and ``mma.default_decisions``: a heuristic
block tile, 2 x 2 warps and the deepest pipeline that fits.  Here each conv's choices are
measured on the GPU and the fastest kept.  A *choice* is a dict:

* ``{"family": "mma", "tiles": decisions, "stages": n}``: the template with these decisions
  (:func:`candidates`: every block tile of 32 / 64 / 128 rows and columns dividing the GEMM, its
  warps 2 x 2, and 4 x 2 / 2 x 4 for 128-wide tiles, the two longest K steps that fit the shared
  memory, each at its deepest pipeline; the default always among them);
* ``{"family": "wgmma", "config": {"bm", "bn", "stages"}}``: Hopper's warp-specialized TMA +
  ``wgmma`` kernel (``schedules/wgmma/conv2d.py``) with its int32 epilogue, on GPUs that have it,
  for the convs TMA im2col can gather in one slice (:func:`wgmma_choices`; built for
  ``sm_90a``).

:func:`search` builds all choices in parallel processes and times each as 20 calls captured in
a CUDA graph (``compare.measure.cuda_graph_ms``), its int32 output checked against the default's
bit for bit (a choice that differs is dropped, and said).  The table,
``tuning_logs/training-convs-<arch>.json`` (or the file ``$TVM_QCONV_CONV_TILES`` names), keeps
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
import dataclasses
import functools
import json
import multiprocessing
import os
import tempfile
import time
import warnings
from typing import Callable

import torch

from ..errors import InputError
from ..fileio import write_json
from ..schedules.tensorcore import mma
from ..schedules.workload import ConvWorkload

TABLE_ENV = "TVM_QCONV_CONV_TILES"
IMPL = "conv2d.nhwc32.mma"      # the registry implementation whose tiles are tabled
MIN_GAIN = 0.03                 # a candidate replaces the default only when >= 3 % faster
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TYPES = {"int8": torch.int8, "int32": torch.int32}


def table_path(arch: str) -> str:
    """``$TVM_QCONV_CONV_TILES``, else ``tuning_logs/training-convs-<arch>.json`` of the repository."""
    return os.environ.get(TABLE_ENV) or os.path.join(_REPO, "tuning_logs", f"training-convs-{arch}.json")


def key(wl: ConvWorkload) -> str:
    """A table key: the workload's fields, its split count left out (a split-K dw's count is part
    of its choice: :func:`choice_workload`)."""
    return json.dumps({**wl.to_dict(), "splits": 1}, sort_keys=True)


def choice_workload(wl: ConvWorkload, choice: dict | None) -> ConvWorkload:
    """The workload ``choice`` runs: ``wl`` with the choice's split count where it has one."""
    splits = (choice or {}).get("splits", wl.splits)
    return wl if splits == wl.splits else dataclasses.replace(wl, splits=splits)


def read_table(path: str) -> dict:
    """The table at ``path`` (``{"layers": [...]}``); an empty one where there is no file.

    Raises:
        InputError: a file that is not such a table.
    """
    if not os.path.exists(path):
        return {"layers": []}
    try:
        with open(path) as f:
            table = json.load(f)
        for row in table["layers"]:
            ConvWorkload.from_dict(row["workload"])
            if row["choice"] is not None and row["choice"]["family"] not in FAMILIES:
                raise ValueError(f"unknown family {row['choice']['family']!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path} is not a training-conv table ({type(err).__name__}: {err}): delete it (the "
                         f"convs then run their default tiles) or rebuild it with python tune.py --training") from err
    return table


FAMILIES = ("mma", "wgmma")


@functools.lru_cache(maxsize=8)
def _entries(path: str, stamp: tuple) -> tuple[str | None, dict[str, dict | None]]:
    table = read_table(path)
    return table.get("arch"), {key(ConvWorkload.from_dict(r["workload"])): r["choice"] for r in table["layers"]}


def lookup(wl: ConvWorkload, arch: str) -> dict | None:
    """The choice the table holds for ``wl`` on ``arch`` (whatever ``wl``'s split count; see
    :func:`choice_workload`); None where the default stays (no table, no entry, or the default
    measured fastest)."""
    path = table_path(arch)
    try:
        st = os.stat(path)
    except OSError:
        return None
    table_arch, entries = _entries(path, (st.st_mtime_ns, st.st_size))
    if table_arch is not None and table_arch != arch:      # measured on another GPU ($TVM_QCONV_CONV_TILES)
        return None
    return entries.get(key(wl))


def build_arch(choice: dict | None, arch: str) -> str:
    """The arch a choice is built for: ``sm_90a`` for wgmma (its instructions exist only there)."""
    return "sm_90a" if choice and choice["family"] == "wgmma" else arch


def schedule(func, choice: dict, target):
    """``func`` (``conv2d_nhwc_int32``'s PrimFunc, tagged with its workload) as ``choice``.

    Raises:
        mma.InvalidDecisions: template tiles that do not fit this GEMM or the shared memory.
        AssertionError: a wgmma config its kernel does not take.
    """
    import tvm

    from ..schedules.kernel import tirx_kernel
    from ..schedules.wgmma import conv2d as wgmma_conv2d
    from ..target import TargetInfo

    if choice["family"] == "wgmma":
        wl = ConvWorkload.of(func)
        assert wgmma_conv2d.supports(wl), wl
        kernel = wgmma_conv2d.conv2d_wgmma(wl, wgmma_conv2d.Config(**choice["config"], staged_store=False),
                                           TargetInfo.from_target(target).num_sm)
        return tirx_kernel(func, kernel)
    sch = tvm.s_tir.Schedule(func)
    mma.apply_mma_schedule(sch, choice["tiles"], choice["stages"])
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def gemm_extents(func) -> tuple[int, int, int]:
    import tvm
    return mma.gemm_extents(tvm.s_tir.Schedule(func))


def mma_choice(decisions: dict, stages: int) -> dict:
    return {"family": "mma", "tiles": decisions, "stages": stages}


def candidates(mp: int, op: int, k: int) -> list[dict]:
    """The template's choices :func:`search` measures for an ``(M_p, O_p, K)`` GEMM (module
    docstring); no duplicates."""
    mt, ot, kt = mp // 16, op // 16, k // 32
    out = []
    for bm in (128, 64, 32):
        for bn in (128, 64, 32):
            if mp % bm or op % bn:
                continue
            warps = [(2, 2)] + ([(4, 2)] if bm == 128 else []) + ([(2, 4)] if bn == 128 else [])
            for wm, wn in warps:
                fm, fn = bm // 16 // wm, bn // 16 // wn
                if not (1 <= fm <= mma.MAX_FRAGS and 1 <= fn <= mma.MAX_FRAGS):
                    continue
                fits = [(kk, s) for kk in (4, 2, 1) if kt % kk == 0 for s in sorted(mma.STAGE_CHOICES, reverse=True)
                        if (bm + bn) * (32 * kk + mma.SMEM_PAD) * s <= mma.DYN_SMEM_BUDGET and kt // kk >= s - 1]
                longest = []                    # the two longest K steps, each at its deepest pipeline
                for kk, s in fits:
                    if all(kk != c[0] for c in longest) and len(longest) < 2:
                        longest.append((kk, s))
                for kk, s in longest:
                    out.append(mma_choice({"m": [mt // (bm // 16), wm, fm], "o": [ot // (bn // 16), wn, fn],
                                           "k": [kt // kk, kk]}, s))
    return out


def wgmma_choices(wl: ConvWorkload) -> list[dict]:
    """The wgmma kernel's tiles for ``wl`` (``schedules/wgmma/space.py``, at least
    ``MIN_TILE_COLUMNS`` wide), none where its kernel cannot compute ``wl``."""
    from ..schedules.tensorcore.impls import MIN_IN_CHANNELS
    from ..schedules.wgmma import conv2d as wgmma_conv2d
    from ..schedules.wgmma import space
    from ..schedules.wgmma.impls import MIN_TILE_COLUMNS

    if wl.in_channels < MIN_IN_CHANNELS or not wgmma_conv2d.supports(wl):
        return []
    return [{"family": "wgmma", "config": {"bm": c.bm, "bn": c.bn, "stages": c.stages}}
            for c in space.candidate_configs(wl) if c.bn >= MIN_TILE_COLUMNS]


def wgmma_split_choices(wl: ConvWorkload, num_sm: int) -> list[dict]:
    """:func:`wgmma_choices` of a split-K ``wl`` (dw), each at ``wl``'s split count and at the
    counts that give the persistent grid about 2 and 4 tiles per SM (its two consumers take a
    tile each: a count chosen for mma.sync's grid can leave one idle), where the kernel takes them."""
    from ..schedules.wgmma import conv2d as wgmma_conv2d

    out = []
    for choice in wgmma_choices(wl):
        out.append(choice)
        if wl.splits == 1:
            continue
        per_slice = wgmma_conv2d.tiles(wl, wgmma_conv2d.Config(**choice["config"], staged_store=False))
        for want in (2 * num_sm, 4 * num_sm):
            splits = -(-want // per_slice)
            while splits < 4096 and not wgmma_conv2d.supports(dataclasses.replace(wl, splits=splits)):
                splits += 1
            if splits < 4096 and splits != wl.splits and all(c.get("splits") != splits or c["config"] !=
                                                              choice["config"] for c in out):
                out.append({**choice, "splits": splits})
    return out


def describe_choice(choice: dict | None) -> str:
    if choice is None:
        return "default"
    if choice["family"] == "wgmma":
        c = choice["config"]
        split = f", split {choice['splits']}" if "splits" in choice else ""
        return f"wgmma {c['bm']}x{c['bn']}, {c['stages']} stages{split}"
    d = choice["tiles"]
    return (f"mma {16 * d['m'][1] * d['m'][2]}x{16 * d['o'][1] * d['o'][2]}, warps {d['m'][1]}x{d['o'][1]}, "
            f"BK {32 * d['k'][1]}, {choice['stages']} stages")


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
    import tvm

    from .. import registry
    from . import tvm_kernels

    target = tvm_kernels.target_of(build_arch(next(iter(choices.values())), arch))
    impl = registry.get(IMPL)
    options = registry.compile_options([impl])

    def function(j: int):
        choice = choices[j]
        cw = choice_workload(wl, choice)
        func = (schedule(impl.compute(cw), choice, target) if choice else
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
    """Measure the choices of each workload on ``device`` (module docstring): the template's
    :func:`candidates`, and :func:`wgmma_choices` where the GPU has wgmma (compute capability 9.0);
    one row per workload measured before ``seconds`` ran out, each also handed to ``on_row`` as it
    is done.

    Row: ``workload``, ``describe``, ``gemm`` ``[M_p, O_p, K]`` (K of one slice), ``default`` and
    ``best`` (``{"choice", "ms"}``; ``best`` None where the default stays), ``measured`` (every
    choice's ``ms``, None for one that failed to build or gave other bits) and ``tops_default`` /
    ``tops_best`` on the padded GEMM, every slice (what the tensor cores execute)."""
    from ..compare.measure import cuda_graph_ms
    from ..target import TargetInfo
    from . import tvm_kernels

    timer = timer or (lambda fn: cuda_graph_ms(fn, reps=20, iters=5))
    arch = tvm_kernels.device_target(device)[1]
    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    deadline = None if seconds is None else time.monotonic() + seconds
    plans = []
    for wl in workloads:
        impl = tvm_kernels._impl("forward", wl, tvm_kernels.target_of(arch))
        if impl.name != IMPL:
            continue
        func = impl.compute(wl)
        mp, op, k = gemm_extents(func)
        default = mma_choice(*mma.default_decisions(mp, op, k, TargetInfo.from_target(
            tvm_kernels.target_of(arch)).num_sm))
        num_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else \
            TargetInfo.from_target(tvm_kernels.target_of(arch)).num_sm
        choices = [c for c in candidates(mp, op, k) if c != default] + (wgmma_split_choices(wl, num_sm) if hopper
                                                                         else [])
        plans.append((wl, func, (mp, op, k), [None] + choices, default))
    rows = []
    with tempfile.TemporaryDirectory(prefix="conv_tiles-") as tmp, concurrent.futures.ProcessPoolExecutor(
            max(1, workers or os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = []     # per workload: (library path, its indices, future) per group of one build arch
        for i, (wl, _, _, choices, _) in enumerate(plans):
            by_arch: dict[str, list[int]] = {}
            for j, choice in enumerate(choices):
                by_arch.setdefault(build_arch(choice, arch), []).append(j)
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
    """index -> the built kernel, or the reason it is missing, from :func:`_build_group`'s libraries."""
    import tvm

    from ..schedules.wgmma import tensormap  # noqa: F401  (registers the encoder the wgmma kernels' host code calls)

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
    from . import tvm_kernels

    g = torch.Generator(device=device).manual_seed(0)
    *inputs, out = _arguments(func, device, g)
    split = wl.splits > 1      # the default's output has a slice axis
    reference, measured = None, []
    kernels = _kernels_of(groups)
    for j, choice in enumerate(choices):
        fn = kernels[j]
        if isinstance(fn, str):      # a choice the kernels cannot build: skipped, said
            print(f"  {tvm_kernels.describe(wl)}: {describe_choice(choice)} did not build ({fn[:200]})", flush=True)
            measured.append(None)
            continue
        slices = choice_workload(wl, choice).splits      # a resplit dw's own count (1: no slice axis)
        shape = tuple(out.shape[1:]) if split else tuple(out.shape)
        acc = torch.zeros(((slices,) + shape) if slices > 1 else shape, dtype=out.dtype, device=device)

        def run(fn=fn, acc=acc, slices=slices):     # what the step runs: the kernel, the slices' int64 sum
            fn(*inputs, acc)
            return acc.sum(0) if slices > 1 else acc
        result = run().to(torch.int64)     # compared outside the timed call (a full pass of the output)
        if reference is None:
            reference = result.clone()
        elif not torch.equal(result, reference):
            print(f"  {tvm_kernels.describe(wl)}: {describe_choice(choice)} gives other sums than the default: "
                  "dropped", flush=True)
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
    print(f"  {row['describe']:<48} default {default_ms:8.4f} ms  best {best_ms:8.4f} ms "
          f"({default_ms / best_ms:4.2f}x, {row['tops_best']:6.1f} TOPS, {describe_choice(pick and pick[0])}) "
          f"of {len(measured)}", flush=True)
    return row


def merge_rows(path: str, rows: list[dict], meta: dict) -> None:
    """Put ``rows``' choices into the table at ``path`` (replacing the same workloads' entries),
    atomically."""
    table = read_table(path)
    by_key = {key(ConvWorkload.from_dict(r["workload"])): r for r in table["layers"]}
    for r in rows:
        best = r["best"]
        by_key[key(ConvWorkload.from_dict(r["workload"]))] = {
            "workload": r["workload"], "describe": r["describe"], "choice": best["choice"] if best else None,
            "ms": best["ms"] if best else r["default"]["ms"], "default_ms": r["default"]["ms"], **meta}
    table.update({k: v for k, v in meta.items() if k in ("arch", "tvm")})
    table["layers"] = sorted(by_key.values(), key=lambda r: r["describe"])
    write_json(path, table, indent=1)


# ----------------------------------------------------------------------------- a model's convs

MODELS = ("vgg16", "resnet50")


def training_workloads(model_name: str, batch: int, image_size: int, device: torch.device) -> list[ConvWorkload]:
    """Every int8 conv workload (forward, dx, dw) of one training step of ``model_name`` at
    ``batch`` on ``device``, from a dry run that builds and runs nothing (``tvm_kernels.kernel_jobs``)."""
    import torch.nn.functional as F

    from ..models import QuantizedVGG16, quantized_resnet50
    from . import tvm_kernels

    if model_name not in MODELS:
        raise InputError(f"--training tunes the training models {', '.join(MODELS)}; got {model_name!r}")
    num_classes = 1000
    model = (QuantizedVGG16(num_classes=num_classes, image_size=image_size, input_grad="int8", weight_grad="int8")
             if model_name == "vgg16" else quantized_resnet50(num_classes=num_classes, input_grad="int8",
                                                                weight_grad="int8")).to(device).train()
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    # with no table: the dw convs at their default split counts (a choice may change them)
    previous = os.environ.get(TABLE_ENV)
    os.environ[TABLE_ENV] = os.path.join(tempfile.gettempdir(), "tvm_qconv-no-conv-table.json")
    tvm_kernels._measured_splits.cache_clear()
    try:
        jobs = tvm_kernels.kernel_jobs(lambda: F.cross_entropy(model(x), labels).backward())
    finally:
        if previous is None:
            del os.environ[TABLE_ENV]
        else:
            os.environ[TABLE_ENV] = previous
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
    from . import tvm_kernels

    if not torch.cuda.is_available():
        raise InputError("tune.py --training measures on a CUDA GPU and none is visible: run it on the GPU machine")
    device = torch.device("cuda")
    arch = tvm_kernels.device_target(device)[1]
    path = table or table_path(arch)
    done = set() if redo else {key(ConvWorkload.from_dict(r["workload"])) for r in read_table(path)["layers"]}
    workloads = [wl for wl in training_workloads(model_name, batch, image_size, device) if key(wl) not in done]
    print(f"[tune --training] {model_name} batch {batch}: {len(workloads)} conv workloads to measure "
          f"({len(done)} already in {path})", flush=True)
    meta = {"arch": arch, "tvm": __import__("tvm").__version__, "device": torch.cuda.get_device_name(device),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rows = search(workloads, device, workers=workers, seconds=seconds,
                  on_row=lambda row: merge_rows(path, [row], meta))
    if rows:
        before = sum(r["default"]["ms"] for r in rows)
        after = sum((r["best"] or r["default"])["ms"] for r in rows)
        print(f"[tune --training] {len(rows)} workloads, once each: {before:.3f} ms at the default tiles, "
              f"{after:.3f} ms at the chosen ({before / after:.2f}x); table {path}", flush=True)
    else:
        warnings.warn("nothing measured")
    return rows
