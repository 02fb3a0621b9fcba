"""``compare``: the project's int8 library beside every baseline, one after another on one device.

    calibrate once (the ranges every int8 row uses) --> build the libraries (parallel workers)
      --> export the Q/DQ ONNX model --> per batch, per baseline: prepare, time, agreement
      --> <out>/compare_<model>.json (after every row), .md (the tables), .png (the chart)

Every row runs the same float weights (a seeded random init unless ``weights``) on the same
real photos, and is compared with fp32 PyTorch (TF32 off) on those photos.
"""
from __future__ import annotations

import dataclasses
import os
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
import tvm

from .. import interrupts, model_check
from ..runtime.artifact import read_meta
from ..build import BuildOptions, _categories
from ..cli import first_line
from ..config import QuantConfig
from ..data import skimage_photos
from ..errors import InputError
from ..evaluate import topk_accuracy
from ..fileio import check_output_folder
from ..frontend import as_frontend, load_model
from ..graph import static_shape
from ..labelled_images import labelled_images, read_batch
from ..onnx_export import export_onnx
from .. import pipeline
from ..pipeline import BuildState
from ..ranges.sources import Calibrate, GivenRanges
from ..target import TargetInfo, device_arch, make_target
from ..tuning.job import model_stem
from . import report
from .baselines import BASELINE_KEYS, Baseline, Forward, Unavailable, baselines, set_tf32
from .builds import Built, BuildJob, build_libraries
from .measure import agreement, device_memory_used_mib, mark_wrong, release_device_memory, time_calls

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class CompareOptions:
    """What ``deploy.py compare`` runs.

    Attributes:
        model: a torchvision classifier name, ``path/to/file.py:factory`` or an ONNX file (float: the
            PyTorch rows are skipped and the reference is ONNX Runtime's fp32; Q/DQ: built with its
            scales, and ONNX Runtime's rows run the file itself).
        weights: a state-dict file or torchvision weight name; None: random init seeded by ``seed``.
        num_classes: classifier width for random init.
        batches: the batch sizes, each a table.
        image_size: input height = width; None: an ONNX file's own where it fixes one, else 224.
        device: ``cuda`` or ``cpu``; None: cuda where there is a GPU.
        arch: CUDA arch of the int8 builds; None: the GPU's own, with every instruction
            (``sm_90a`` on an H100 / H200: the wgmma family).
        libs: the user's built libraries, each timed in the slot of its batch size (and CUDA
            graphs or not) instead of a new build.
        tuning_log: a tuning database folder, or a folder of ``<model>-b<N>-<arch>`` ones
            (``tuning_logs/``), for the int8 builds.
        baselines: the rows to run, by key (:data:`BASELINE_KEYS`); None: all.
        config: the quantization scheme; calib_dir: calibration images (default: the photos).
        input_sets: distinct inputs each row cycles through (so the L2 cache does not hold the input).
        budget_s: seconds of timed calls per row (at least 3 calls, at most 200).
        jobs: int8 builds in parallel.
        agreement_floor_db: a row whose logits' SQNR against fp32 PyTorch is under this is marked
            ``wrong``: timed, shown, but left out of the summary and the chart (its outputs are
            not the model's).  int8 rows of random-init zoo models reach 16-33 dB, float rows 40+.
        data, labels, classes: a labelled image folder (``labelled_images``): every comparable row
            also gets its top-1 / top-5 on it, and so does the reference.
        seed: torch's seed before a random init.
        out_dir: where the JSON, markdown and PNG go; work_dir: libraries and the ONNX model.
    """

    model: str = "vgg16"
    weights: str | None = None
    num_classes: int | None = None
    batches: tuple[int, ...] = (1, 16, 64)
    image_size: int | None = None
    device: str | None = None
    arch: str | None = None
    libs: tuple[str, ...] = ()
    tuning_log: str | None = None
    baselines: tuple[str, ...] | None = None
    config: QuantConfig = field(default_factory=QuantConfig)
    calib_dir: str | None = None
    input_sets: int = 4
    budget_s: float = 3.0
    jobs: int = 1
    agreement_floor_db: float = 10.0
    data: str | None = None
    labels: str | None = None
    classes: str | None = None
    seed: int = 0
    out_dir: str = "results"
    work_dir: str = "/tmp/tvm_qconv_compare"

    def __post_init__(self):
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "libs", tuple(self.libs))
        if not self.batches or any(int(b) != b or b < 1 for b in self.batches):
            raise InputError(f"batch sizes must be positive integers, got {self.batches}")
        if self.image_size is not None and self.image_size < 8:
            raise InputError(f"image size must be >= 8, got {self.image_size}")
        if self.device not in (None, *DEVICES):
            raise InputError(f"device must be one of {DEVICES}, got {self.device!r}")
        unknown = [k for k in self.baselines or () if k not in BASELINE_KEYS]
        if unknown:
            raise InputError(f"unknown baseline {', '.join(map(repr, unknown))}: choose from {', '.join(BASELINE_KEYS)}")
        if self.input_sets < 1 or not self.budget_s > 0 or self.jobs < 1:
            raise InputError(f"input sets and jobs must be >= 1 and the budget > 0, got {self.input_sets}, "
                             f"{self.jobs}, {self.budget_s}")
        for lib in self.libs:
            if not os.path.isfile(lib):
                raise InputError(f"--lib {lib} does not exist: build it with `python deploy.py build ... -o {lib}`")
        if (self.labels or self.classes) and self.data is None:
            raise InputError("--labels and --classes go with --data DIR (a labelled image folder)")
        if self.data is not None and not os.path.isdir(self.data):
            raise InputError(f"--data {self.data}: no such folder")
        if self.tuning_log and not os.path.isdir(self.tuning_log):
            raise InputError(f"--tuning-log {self.tuning_log} is not a folder: give a database folder written by "
                             "tune.py, or tuning_logs/")

    @property
    def tag(self) -> str:
        """The model's name in file names (``vgg16``; ``file_factory`` for a user's model, the file's
        stem for an ONNX file: ``tuning.job.model_stem``)."""
        return model_stem(self.model)


def resolve_device(requested: str | None) -> str:
    """``requested``, or cuda where PyTorch and TVM both see a GPU, else cpu.

    Raises:
        InputError: cuda was asked for on a machine without a GPU.
    """
    has_gpu = torch.cuda.is_available() and tvm.cuda(0).exist
    if requested == "cuda" and not has_gpu:
        raise InputError("--device cuda: this machine has no CUDA GPU that PyTorch and TVM can use; "
                         "compare on the CPU with --device cpu")
    return requested or ("cuda" if has_gpu else "cpu")


def tuning_log_for(folder: str | None, model: str, batch: int, arch: str | None) -> str | None:
    """The database of ``folder`` for this batch: ``folder`` itself when it is a database, else
    its ``<model>-b<batch>-<arch>`` entry (sm_90 and sm_90a are one GPU: either folder serves
    either build, this arch's first), else None."""
    if not folder:
        return None
    if any(name.startswith("database_workload") for name in os.listdir(folder)):
        return folder
    base = (arch or "").rstrip("a")
    for a in dict.fromkeys([arch, base, base + "a" if base == "sm_90" else None]):
        path = os.path.join(folder, f"{model_stem(model)}-b{batch}-{a}")
        if a and os.path.isdir(path):
            return path
    return None


class Context:
    """What every row of one comparison shares: the float model, the device, the photos and
    fp32 reference logits, the calibrated ranges, the libraries, the ONNX model."""

    def __init__(self, options: CompareOptions, model=None, progress=print):
        self.options, self.progress = options, progress
        self.device = resolve_device(options.device)
        self.given_model = model is not None
        if model is None:
            torch.manual_seed(options.seed)
            model = load_model(options.model, options.weights, options.num_classes)
        self.model = as_frontend(model, options.model)
        # the image size: the model's own where it fixes one (a contradicting --image-size is refused), else 224
        size = self.model.image_size(options.image_size)
        self.options = options = dataclasses.replace(options, image_size=size)
        if self.model.has_own_ranges and options.calib_dir is not None:
            raise InputError(f"--calib-dir cannot be used with {options.model}: it is a quantized (Q/DQ) file, whose "
                             "scales every int8 row keeps (nothing is calibrated); drop it")
        self.input_shape = (1, 3, size, size)
        # the shape at the largest batch, checked before any work; a tuple output's first tensor
        # is what every row times and compares (compare() holds the model's first_output)
        shape = (max(options.batches), 3, options.image_size, options.image_size)
        self.probe = self.model.probe(shape, options.model)
        model_check.check_memory(self.probe, shape, options.model,
                                 host_batch=None if self.device == "cpu" else 1)
        self.weights = self.model.digest()
        self.arch = None
        if self.device == "cuda":
            self.arch = options.arch or device_arch(full=True)
        self.cudnn_cache: dict = {}
        self._onnx: tuple | Exception | None = None
        self.libs: dict = {}
        self.times: dict = {}

    # ---- the images --------------------------------------------------------------------------
    def prepare(self, names: list[str]) -> None:
        """Photos, reference, ranges; then the libraries and the ONNX model the rows ``names`` need."""
        self.photos = skimage_photos(self.options.image_size)
        self.reference = self._reference()
        self.labelled = None
        if self.options.data is not None:   # the labelled folder: every comparable row's top-1 / top-5 on it
            data = self.options.data
            # read as `eval --data` reads it: the same reader, and the category names the model's
            # library records (build._categories), so class folders named `tench` resolve alike
            images = labelled_images(data, self.options.labels, self.options.classes, _categories(self.options.model))
            x, y = read_batch(images, 0, len(images.paths), self.options.image_size)
            if not len(x):
                raise InputError(f"--data {data}: none of its {len(images.paths)} images could be read "
                                 f"(first: {images.skipped[0][0]}: {images.skipped[0][1]})")
            logits = self._reference(x)
            if logits.shape[-1] <= int(y.max()):
                raise InputError(f"--data {data}: labels go up to class {int(y.max())}, the model has "
                                 f"{logits.shape[-1]} outputs: labels are class indices from 0")
            self.labelled = (x, y, images)
            self.reference_accuracy = topk_accuracy(logits, y)
            self.progress(f"[compare] {len(y)} labelled images of {self.options.data} ({images.layout}; "
                          f"{len(images.skipped)} unreadable); {self.reference_name}: top-1 "
                          f"{self.reference_accuracy['top1']:.1f} %")
        t = time.perf_counter()
        self.amax, self.convs, self.config, self.channel_means, self.equalization = self._calibrate()
        self.times["calibrate_s"] = round(time.perf_counter() - t, 1)
        how = ("took the Q/DQ file's scales of" if self.model.has_own_ranges else
               f"calibrated ({self.options.config.calibration})")
        self.progress(f"[compare] {how} {len(self.amax)} tensors in {self.times['calibrate_s']} s")
        if {"int8", "int8-graph"} & set(names):
            self._libraries(graph_rows="int8-graph" in names and self.device == "cuda",
                            plain_rows="int8" in names)

    def input_sets(self, batch: int) -> list[np.ndarray]:
        """``options.input_sets`` distinct batches of the photos: set k starts k images further and
        is mirrored when k is odd (its own data, at its own address)."""
        n = len(self.photos)
        sets = []
        for k in range(self.options.input_sets):
            x = self.photos[(np.arange(batch) + k * batch) % n]
            sets.append(np.ascontiguousarray(x[..., ::-1] if k % 2 else x))
        return sets

    def run_photos(self, forward: Forward, batch: int, photos: np.ndarray | None = None) -> np.ndarray:
        """The logits of every photo (default: the calibration photos) through ``forward``,
        ``batch`` at a time (the last batch filled with repeats)."""
        photos = self.photos if photos is None else photos
        n = len(photos)
        out = []
        for start in range(0, n, batch):
            x = photos[(np.arange(batch) + start) % n]
            out.append(np.asarray(forward.get(forward.call(forward.put(np.ascontiguousarray(x)))), np.float32))
        return np.concatenate(out)[:n]

    @property
    def reference_name(self) -> str:
        return "fp32 PyTorch (TF32 off)" if self.model.module is not None else "fp32 ONNX Runtime (CPU)"

    def _reference(self, photos: np.ndarray | None = None) -> np.ndarray:
        """The float model's logits of the photos, 16 at a time: fp32 PyTorch's on this device, TF32
        off (an ONNX file's: ONNX Runtime's on the CPU)."""
        photos = self.photos if photos is None else photos
        set_tf32(False)
        return self.model.reference(photos, self.device, chunk=16)

    def given_ranges(self) -> GivenRanges:
        """The calibration's ranges, channel means and equalization factors, as every library here takes them."""
        return GivenRanges(self.amax, self.channel_means, self.equalization)

    def _calibrate(self) -> tuple[dict, list, QuantConfig, dict | None, dict | None]:
        """The ranges (calibrated once, at batch 1, on the CPU), the model's convs (for cuDNN), the
        scheme with its defaults decided (``QuantConfig.resolved``), the calibration's channel
        means (bias correction) and equalization factors: every library compare builds uses these."""
        images = None if self.options.calib_dir else self.photos
        # a Q/DQ file's ranges are its own (ranges=None: the model's own_ranges)
        ranges = None if self.model.has_own_ranges else Calibrate(images, self.options.calib_dir)
        llvm = make_target("llvm")     # the build pipeline up to its ranges (pipeline.py)
        q = pipeline.run(BuildState(self.model, self.input_shape, TargetInfo.from_target(llvm),
                                    config=self.options.config, ranges=ranges, target=llvm), until="equalize")
        convs = []
        for ly in q.graph.layers:
            if ly.kind != "conv2d" or ly.weight is None:
                continue
            a = ly.call.attrs
            _, c, h, w = static_shape(ly.inputs[0].ty)
            convs.append(dict(layer=ly.name, in_channels=c, height=h, width=w, out_channels=int(ly.weight.shape[0]),
                              kernel=list(ly.weight.shape[2:]), stride=list(map(int, a.strides)),
                              padding=list(map(int, a.padding)), dilation=list(map(int, a.dilation)),
                              groups=int(a.groups)))
        return q.amax, convs, q.config, q.context.channel_means, q.context.equalization

    # ---- the int8 libraries -----------------------------------------------------------------
    def _libraries(self, graph_rows: bool, plain_rows: bool) -> None:
        opts = self.options
        for lib in opts.libs:
            meta = read_meta(lib)  # (its CompiledModel warns if it failed its verification)
            target = "cuda" if self.device == "cuda" else "llvm"
            if meta.get("target") != target:
                raise InputError(f"--lib {lib} was built for {meta.get('target')}, this comparison runs on "
                                 f"{self.device}: give a {target} library, or --device to match")
            if tuple(meta["input_shape"][1:]) != self.input_shape[1:]:
                raise InputError(f"--lib {lib} takes {tuple(meta['input_shape'][1:])} images, the comparison "
                                 f"{self.input_shape[1:]}: pass --image-size {meta['input_shape'][2]}")
            same = meta.get("float_weights") == self.weights
            note = "--lib" + ("" if same else ": built from other weights, agreement not comparable")
            self.libs[meta["input_shape"][0], bool(meta.get("cuda_graph"))] = Built(lib, None, note, same)
        jobs = []
        for batch in opts.batches:
            for graph in (True, False):
                if (batch, graph) in self.libs or not (graph_rows if graph else plain_rows):
                    continue
                log = tuning_log_for(opts.tuning_log, opts.model, batch, self.arch)
                if opts.tuning_log and log is None:
                    self.progress(f"[compare] {opts.tuning_log} holds no database for b{batch}: that build is untuned")
                options = BuildOptions(target="cuda" if self.device == "cuda" else "llvm", arch=self.arch,
                                       batch=batch, image_size=opts.image_size, tuning_log=log, cuda_graph=graph,
                                       verify=False)
                path = os.path.join(opts.work_dir, f"{opts.tag}_b{batch}{'_graph' if graph else ''}.so")
                jobs.append(BuildJob(batch, graph, path, options))
        if not jobs:
            return
        os.makedirs(opts.work_dir, exist_ok=True)
        spec = None
        if not self.given_model:  # a worker loads the model by its name, a torch module with this state
            module = self.model.module
            spec = dict(name=opts.model, num_classes=opts.num_classes,
                        state=None if module is None else os.path.join(opts.work_dir, "state.pt"))
            if module is not None:
                torch.save(module.state_dict(), spec["state"])
        self.progress(f"[compare] building {len(jobs)} int8 libraries ({opts.jobs} at a time)")
        self.libs.update(build_libraries(jobs, self.model, spec, self.given_ranges(),
                                         self.config, opts.jobs, self.progress))

    def library(self, batch: int, graph: bool) -> Built:
        """The library of this slot, or the error its build raised."""
        built = self.libs.get((batch, graph))
        if built is None:
            raise Unavailable("not built")
        if isinstance(built, Exception):
            raise built
        return built

    # ---- the ONNX model ---------------------------------------------------------------------
    def onnx_model(self) -> tuple[str, float]:
        """(path, export seconds) of the Q/DQ ONNX model with this comparison's ranges (exported
        once, any batch size)."""
        if self._onnx is None and self.model.has_own_ranges:
            self._onnx = (self.model.path, 0.0)     # a Q/DQ file: ONNX Runtime and TensorRT run it as it is
        if self._onnx is None:
            path = os.path.join(self.options.work_dir, f"{self.options.tag}.onnx")
            t = time.perf_counter()
            try:
                export_onnx(self.model, path, input_shape=self.input_shape, config=self.config,
                            ranges=self.given_ranges(), name=self.options.model, progress=False)
                self._onnx = (path, round(time.perf_counter() - t, 1))
            except Exception as err:  # noqa: BLE001 - every ONNX row fails with the export's reason
                self._onnx = err
        if isinstance(self._onnx, Exception):
            raise self._onnx
        return self._onnx


def _reason(err: BaseException) -> str:
    return str(err).strip()[:300] if isinstance(err, Unavailable) else first_line(err)


def run_row(ctx: Context, baseline: Baseline, batch: int) -> dict:
    """One row: prepared, timed, its memory and its agreement with fp32 PyTorch; a baseline that
    cannot run is a ``skipped`` row and one that fails a ``failed`` row, each with the reason."""
    row = dict(key=baseline.key, name=baseline.name, family=baseline.family, batch=batch, status="ok")
    release_device_memory()
    before = device_memory_used_mib()
    forward = inputs = None
    try:
        if baseline.needs_cuda and ctx.device != "cuda":
            raise Unavailable("needs a CUDA GPU (this run is on the CPU)")
        if baseline.run is not None:
            row.update(baseline.run(ctx, batch))
        else:
            forward = baseline.prepare(ctx, batch)
            inputs = [forward.put(x) for x in ctx.input_sets(batch)]
            timing = time_calls(forward.call, inputs, cuda=ctx.device == "cuda" and not forward.cpu,
                                budget_s=ctx.options.budget_s)
            used = device_memory_used_mib()
            row.update(median_ms=timing.median_ms, p99_ms=timing.p99_ms, mean_ms=timing.mean_ms, runs=timing.runs,
                       images_per_s=batch / timing.median_ms * 1e3, build_s=forward.build_s, note=forward.note,
                       peak_mem_mib=None if used is None or forward.cpu else max(used - before, 0.0),
                       on_cpu=forward.cpu or ctx.device == "cpu")
            if forward.comparable:
                row.update(agreement(ctx.reference, ctx.run_photos(forward, batch)))
                mark_wrong(row, ctx.options.agreement_floor_db, ctx.reference_name)
                if ctx.labelled is not None:
                    x, y, _ = ctx.labelled
                    acc = topk_accuracy(ctx.run_photos(forward, batch, x), y)
                    row.update(top1=acc["top1"], top5=acc["top5"])
    except Unavailable as err:
        row.update(status="skipped", reason=_reason(err))
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - one baseline's failure is its row; the run carries on
        interrupts.check()  # ... unless it was a Ctrl-C that TVM or torch turned into an error
        row.update(status="failed", reason=_reason(err))
        os.makedirs(ctx.options.work_dir, exist_ok=True)
        log = os.path.join(ctx.options.work_dir, f"error_{baseline.key}_b{batch}.txt")
        with open(log, "w") as f:
            f.write("".join(traceback.format_exception(err)))
        row["log"] = log
    finally:
        del forward, inputs
        set_tf32(False)
        release_device_memory()
    return row


def compare(options: CompareOptions, model=None, progress=print) -> dict:
    """Run the comparison; returns what ``<out>/compare_<tag>.json`` holds.

    Args:
        options: what to run.
        model: a float ``nn.Module`` to use instead of loading ``options.model`` (its name is
            still ``options.model`` in the results).
        progress: called with one line per step and per row.

    Example:
        >>> compare(CompareOptions(model="resnet50", batches=(1, 64)))
    """
    check_output_folder(options.out_dir, "--out folder")
    check_output_folder(options.work_dir, "--work-dir folder")
    rows = [b for b in baselines() if options.baselines is None or b.key in options.baselines]
    ctx = Context(options, model, progress)
    options = ctx.options   # with the image size resolved
    start = time.perf_counter()
    results = dict(environment=report.environment(ctx.device), model=options.model, weights=options.weights or
                   f"random init (seed {options.seed})", image_size=options.image_size, arch=ctx.arch,
                   device=ctx.device, batches=list(options.batches), rows=[],
                   config=getattr(ctx, "config", options.config).to_dict(), input_sets=options.input_sets, budget_s=options.budget_s,
                   agreement_floor_db=options.agreement_floor_db, reference=ctx.reference_name)
    paths = report.paths(options.out_dir, options.tag)
    progress(f"[compare] {options.model} on {results['environment'].get('gpu', {}).get('name') or ctx.device}, "
             f"batches {', '.join(map(str, options.batches))}, {len(rows)} baselines -> {paths['json']}")
    with torch.no_grad(), ctx.model.first_output(ctx.probe):
        ctx.prepare([b.key for b in rows])
        results["times"] = ctx.times
        if ctx.labelled is not None:
            x, y, images = ctx.labelled
            results["labelled"] = dict(data=options.data, images=int(len(y)), layout=images.layout,
                                       skipped=images.skipped, reference=ctx.reference_accuracy)
        for batch in options.batches:
            for baseline in rows:
                row = run_row(ctx, baseline, batch)
                results["rows"].append(row)
                progress(report.progress_line(options.tag, row))
                report.write_json(paths["partial"], results)  # a run cut short keeps what it measured
    results["summary"] = report.summary(results["rows"])
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["gpu_at_end"] = report.gpu_state() if ctx.device == "cuda" else None
    report.write_all(paths, results)
    for line in report.summary_lines(results["summary"]):
        progress(line)
    return results
