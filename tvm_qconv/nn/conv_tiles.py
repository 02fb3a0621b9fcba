"""The training step's int8 convs with their tiles chosen per layer by measurement.

Every int8 conv of a training step on the tensor cores -- the forward, ``dx`` (a forward conv
of the gradient with the flipped weight) and ``dw`` (the split-K conv of the input with the
gradient, ``schedules/training/grad_weight_mma.py``) -- is the ``mma.sync`` template
(``schedules/tensorcore/mma.py``) with int32 output.  Untuned it takes
``mma.default_decisions``: a heuristic block tile, 2 x 2 warps and the deepest pipeline that
fits.  Here the template's tiles are measured per workload on the GPU and the fastest kept:

* :func:`candidates`: every block tile of 32 / 64 / 128 rows and columns dividing the GEMM, its
  warps 2 x 2 (and 4 x 2 / 2 x 4 for 128-wide tiles), the two longest K steps that fit the
  shared memory, each with its deepest pipeline; the default always among them.
* :func:`search`: all candidates built in parallel processes, each timed as 20 calls captured
  in a CUDA graph (``compare.measure.cuda_graph_ms``), its int32 output checked against the
  default's bit for bit (a candidate that differs is dropped, and said).
* The table, ``tuning_logs/training-convs-<arch>.json`` (or the file ``$TVM_QCONV_CONV_TILES``
  names), keeps one entry per workload: its default's and its best candidate's times, and the
  tiles :mod:`tvm_kernels` then builds it with.  The best is taken only when it is at least
  :data:`MIN_GAIN` faster than the default (timing noise is ~1 %); otherwise the entry says the
  default stays.  The table is rewritten (atomically) after each workload: an interrupted search
  keeps what it measured, and the same command goes on from there.

Workloads are matched by their exact shape (batch included): tune with the batch you train with.
The kernel cache key of a tabled workload includes its tiles, so a changed entry rebuilds just
that kernel.

``python tune.py --training --model vgg16 --batch 32`` runs :func:`tune_model`.
"""
from __future__ import annotations

import concurrent.futures
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
    return json.dumps(wl.to_dict(), sort_keys=True)


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
            _ = row["tiles"], row["stages"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path} is not a training-conv tile table ({type(err).__name__}: {err}): delete it (the "
                         f"convs then run their default tiles) or rebuild it with python tune.py --training") from err
    return table


@functools.lru_cache(maxsize=8)
def _entries(path: str, stamp: tuple) -> dict[str, tuple[dict, int] | None]:
    return {key(ConvWorkload.from_dict(r["workload"])): (r["tiles"], r["stages"]) if r["tiles"] else None
            for r in read_table(path)["layers"]}


def lookup(wl: ConvWorkload, arch: str) -> tuple[dict, int] | None:
    """``(decisions, stages)`` the table holds for ``wl`` on ``arch``; None where the default stays
    (no table, no entry, or the default measured fastest)."""
    path = table_path(arch)
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _entries(path, (st.st_mtime_ns, st.st_size)).get(key(wl))


def schedule(func, decisions: dict, stages: int):
    """``func`` (``conv2d_nhwc_int32``'s PrimFunc) on the template with these tiles.

    Raises:
        mma.InvalidDecisions: tiles that do not fit this GEMM or the shared memory.
    """
    import tvm
    sch = tvm.s_tir.Schedule(func)
    mma.apply_mma_schedule(sch, decisions, stages)
    return sch.mod["main"].with_attr("tir.is_scheduled", True)


def gemm_extents(func) -> tuple[int, int, int]:
    import tvm
    return mma.gemm_extents(tvm.s_tir.Schedule(func))


def candidates(mp: int, op: int, k: int) -> list[tuple[dict, int]]:
    """The tiles :func:`search` measures for an ``(M_p, O_p, K)`` GEMM (module docstring), each
    ``(decisions, stages)`` as ``mma.apply_mma_schedule`` takes them; no duplicates."""
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
                    out.append(({"m": [mt // (bm // 16), wm, fm], "o": [ot // (bn // 16), wn, fn],
                                 "k": [kt // kk, kk]}, s))
    return out


def choose(default_ms: float, measured: list[tuple[dict, int, float]]) -> tuple[dict, int, float] | None:
    """The fastest of ``measured`` ``(decisions, stages, ms)`` where it beats ``default_ms`` by
    :data:`MIN_GAIN` or more; None where the default stays."""
    if not measured:
        return None
    best = min(measured, key=lambda m: m[2])
    return best if best[2] <= default_ms * (1 - MIN_GAIN) else None


# ----------------------------------------------------------------------------- measuring

def _build_candidate(wl: ConvWorkload, arch: str, tiles, path: str) -> float:
    """A worker: the forward kernel of ``wl`` with ``tiles`` (None: the default) into ``path``."""
    from . import tvm_kernels
    t0 = time.perf_counter()
    tvm_kernels._build("forward", wl, tvm_kernels.target_of(arch), path, tiles=tiles or False)
    return time.perf_counter() - t0


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
    """Measure :func:`candidates` of each workload on ``device`` (module docstring); one row per
    workload measured before ``seconds`` ran out, each also handed to ``on_row`` as it is done.

    Row: ``workload``, ``describe``, ``gemm`` ``[M_p, O_p, K]``, ``default`` and ``best``
    (``{"tiles", "stages", "ms"}``; ``best`` None where the default stays), ``measured`` (every
    candidate's ``ms``, None for one that failed to build or gave other bits) and ``tops_default``
    / ``tops_best`` on the padded GEMM, every slice (what the tensor cores execute)."""
    from ..compare.measure import cuda_graph_ms
    from ..target import TargetInfo
    from . import tvm_kernels

    timer = timer or (lambda fn: cuda_graph_ms(fn, reps=20, iters=5))
    arch = tvm_kernels.device_target(device)[1]
    deadline = None if seconds is None else time.monotonic() + seconds
    plans = []
    for wl in workloads:
        impl = tvm_kernels._impl("forward", wl, tvm_kernels.target_of(arch))
        if impl.name != IMPL:
            continue
        func = impl.compute(wl)
        mp, op, k = gemm_extents(func)
        default = mma.default_decisions(mp, op, k, TargetInfo.from_target(tvm_kernels.target_of(arch)).num_sm)
        cands = [c for c in candidates(mp, op, k) if c != (default[0], default[1])]
        plans.append((wl, func, (mp, op, k), [None] + cands, default))
    rows = []
    with tempfile.TemporaryDirectory(prefix="conv_tiles-") as tmp, concurrent.futures.ProcessPoolExecutor(
            max(1, workers or os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [[pool.submit(_build_candidate, wl, arch, tiles, os.path.join(tmp, f"{i}-{j}.so"))
                    for j, tiles in enumerate(tiles_list)] for i, (wl, _, _, tiles_list, _) in enumerate(plans)]
        try:
            for i, (wl, func, gemm, tiles_list, default) in enumerate(plans):
                if deadline is not None and time.monotonic() > deadline:
                    print(f"[tune --training] time is up: {len(plans) - i} workloads left for the next run", flush=True)
                    break
                rows.append(_measure_one(wl, func, gemm, tiles_list, default, futures[i], tmp, i, device, timer))
                if on_row is not None:
                    on_row(rows[-1])
        finally:
            pool.shutdown(cancel_futures=True)
    return rows


def _measure_one(wl, func, gemm, tiles_list, default, futures, tmp, i, device, timer) -> dict:
    import tvm
    from . import tvm_kernels

    g = torch.Generator(device=device).manual_seed(0)
    args = _arguments(func, device, g)
    reference, measured = None, []
    for j, (tiles, future) in enumerate(zip(tiles_list, futures)):
        try:
            future.result()
            fn = tvm.runtime.load_module(os.path.join(tmp, f"{i}-{j}.so"))[tvm_kernels.symbol("forward")]
        except Exception as err:  # noqa: BLE001  a candidate the template cannot build: skipped, said
            print(f"  {tvm_kernels.describe(wl)}: tiles {tiles} did not build ({type(err).__name__})", flush=True)
            measured.append(None)
            continue
        args[-1].zero_()
        fn(*args)
        if reference is None:
            reference = args[-1].clone()
        elif not torch.equal(args[-1], reference):
            print(f"  {tvm_kernels.describe(wl)}: tiles {tiles} give other sums than the default: dropped", flush=True)
            measured.append(None)
            continue
        measured.append(timer(lambda: fn(*args)))
    if measured[0] is None:
        raise RuntimeError(f"the default kernel of {tvm_kernels.describe(wl)} did not build or run")
    ops = 2 * gemm[0] * gemm[1] * gemm[2] * wl.splits     # gemm's K is one slice's
    default_ms = measured[0]
    pick = choose(default_ms, [(t[0], t[1], ms) for t, ms in zip(tiles_list[1:], measured[1:]) if ms is not None])
    best_ms = pick[2] if pick else default_ms
    row = {"workload": wl.to_dict(), "describe": tvm_kernels.describe(wl), "gemm": list(gemm),
           "default": {"tiles": default[0], "stages": default[1], "ms": default_ms},
           "best": None if pick is None else {"tiles": pick[0], "stages": pick[1], "ms": pick[2]},
           "measured": [{"tiles": t[0] if t else default[0], "stages": t[1] if t else default[1], "ms": ms}
                        for t, ms in zip(tiles_list, measured)],
           "tops_default": ops / default_ms / 1e9, "tops_best": ops / best_ms / 1e9}
    print(f"  {row['describe']:<48} default {default_ms:8.4f} ms  best {best_ms:8.4f} ms "
          f"({default_ms / best_ms:4.2f}x, {row['tops_best']:6.1f} TOPS) of {len(measured)} candidates", flush=True)
    return row


def merge_rows(path: str, rows: list[dict], meta: dict) -> None:
    """Put ``rows``' choices into the table at ``path`` (replacing the same workloads' entries),
    atomically."""
    table = read_table(path)
    by_key = {key(ConvWorkload.from_dict(r["workload"])): r for r in table["layers"]}
    for r in rows:
        best = r["best"]
        by_key[key(ConvWorkload.from_dict(r["workload"]))] = {
            "workload": r["workload"], "describe": r["describe"],
            "tiles": best["tiles"] if best else None, "stages": best["stages"] if best else None,
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
    jobs = tvm_kernels.kernel_jobs(lambda: F.cross_entropy(model(x), labels).backward())
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
