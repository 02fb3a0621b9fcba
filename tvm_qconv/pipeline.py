"""The build pipeline: every step from a float model to a verified int8 executable, in order, each
a function over one :class:`BuildState`.

    prepare -> export -> simplify -> analyze -> ranges -> equalize -> weight_rounding -> plan -> fuse
      -> lower -> lift -> apply_tuning -> schedule -> compile -> verify              (STEPS, in order)

Who runs which (:func:`run` with ``start`` / ``until``):

    compile_model (build.py)      prepare .. verify, then saves the library
    compile_checkpoint            compile_model with the checkpoint's learned ranges
    export_onnx (onnx_export.py)  prepare .. plan, then lowering/onnx.py writes the plan as Q/DQ
    quantize_module (below)       prepare .. lower: the int8 Relax module (tests, the tuner)
    the tuner's int8_module       prepare .. lift: the module whose kernels become tuning tasks
    compare                       prepare .. ranges: the ranges its libraries and cuDNN rows share
    the verification's twin       prepare .. compile at batch 1, every int8 activation returned

``--debug-dump DIR`` writes the IR after each step that makes one as ``NN_<step>.py`` (NN: the
step's place in :data:`STEPS`).  A step prints its progress line through :meth:`BuildState.phase`;
consecutive steps of one phase (``plan``, ``fuse`` and ``lower`` are "quantize") share one line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm

from . import cuda_check, interrupts, model_check, registry
from . import verify as verify_mod
from .config import QuantConfig
from .errors import InputError
from .frontend import ExportedGraphs, as_frontend
from .frontend.base import Probe
from .graph import Graph
from .lowering import LowerToRelax
from .ranges.observers import quantize_weight_per_channel
from .progress import Phases
from .quantization import QuantizationPlan, plan_quantization
from .quantization.epilogues import fuse_tables
from .quantization.norm_epilogues import fuse_layer_norms
from .quantization.residuals import fuse_residuals
from .quantization.zero_points import may_run_int8
from .ranges.sources import Calibrate, GivenRanges, RangeContext, RangeSource, calibrates
from .ranges.sources import describe as describe_ranges
from .target import TargetInfo
from .transform import LiftConstantsToParams, ScheduleInt8Kernels
from .tuning.apply import apply_tuning_database, measured_chooser
from .tuning.database import load_database
from .ranges import equalize as equalization
from .ranges.weight_rounding import gptq_model


@dataclass
class BuildState:
    """One build as it goes through the steps: what it was asked, then what each step made.

    Asked:
        model: the float model (a ``torch.nn.Module``, a ``--model`` name or any
            ``frontend.Frontend``; :func:`prepare` makes it a ``Frontend``).
        input_shape: the static (N, C, H, W) to build for.
        target_info: which kernels exist (``TargetInfo``).
        config: the quantization scheme.
        ranges: where the activation ranges come from (None: the model's own, else calibration).
        target: the TVM target to compile for (None: the steps up to ``lower`` only).
        name: the model's name in reports (default: the frontend's).
        choices: ``{layer: implementation}`` preferences; chooser: the other layers' pick
            (``(op, workload, candidates) -> name or None``).
        families: prefer these kernel families, in order; tuning_log, ignore_stale: a
            MetaSchedule database to take kernels and schedules from.
        cuda_graph: capture the launches into a CUDA graph (CUDA targets).
        expose_activations: the module also returns every int8 activation (no fusion).
        debug_dump: the folder the IR is written into after each step.
        require_int8: refuse a skip list that leaves no layer in int8.
        check_input: probe the model at ``input_shape`` and check its memory first
            (:func:`prepare`; the CLIs' and ``compile_model``'s builds).
        check_graph: ``(Graph) -> None``, a caller's refusal of the float graph before any range
            is resolved (``onnx_export.check_exportable``).
        verify, verify_floor_db, accuracy_target_db: the verification (``BuildOptions``).
        float_reasons: ``{layer: why}`` for layers of the skip list kept float for a reason the plan
            should say (``mixed_precision.py``: the accuracy target), instead of "in the skip list".
        phases: the progress lines and each phase's seconds.

    Made (each by the step named):
        probe (prepare), exported and float_exported (export: the model's graphs at every batch;
        weight_rounding replaces the first with the rounded model's), mod (the module as
        the last step left it), names and graph (simplify, analyze; weight_rounding again),
        amax, ranges_report, context (ranges), rounding (weight_rounding), plan (plan), lowered
        (fuse: the plan the Relax lowering reads), report (lower; then lift .. verify add to it),
        params (lift), tuned (apply_tuning), applied (schedule), executable (compile).
    """

    model: object
    input_shape: tuple
    target_info: TargetInfo
    config: QuantConfig = QuantConfig()
    ranges: RangeSource | None = None
    target: object = None
    name: str | None = None
    choices: dict | None = None
    chooser: Callable | None = None
    families: tuple | None = None
    tuning_log: str | None = None
    ignore_stale: bool = False
    cuda_graph: bool = False
    expose_activations: bool = False
    debug_dump: str | None = None
    require_int8: bool = False
    check_input: bool = False
    check_graph: Callable | None = None
    verify: bool = False
    verify_floor_db: float = verify_mod.FLOOR_DB
    accuracy_target_db: float | None = None
    float_reasons: dict | None = None
    phases: Phases = field(default_factory=lambda: Phases(enabled=False))

    probe: Probe | None = None
    exported: ExportedGraphs | None = None
    float_exported: ExportedGraphs | None = None
    database: object = None
    mod: tvm.IRModule | None = None
    names: dict | None = None
    graph: Graph | None = None
    amax: dict | None = None
    ranges_report: dict | None = None
    context: RangeContext | None = None
    rounding: dict | None = None
    plan: QuantizationPlan | None = None
    lowered: QuantizationPlan | None = None
    report: dict | None = None
    params: list | None = None
    tuned: dict = field(default_factory=dict)
    applied: dict | None = None
    executable: object = None
    _run: contextlib.ExitStack | None = field(default=None, repr=False)
    _phase: contextlib.ExitStack | None = field(default=None, repr=False)
    _phase_name: str | None = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return int(self.input_shape[0])

    def phase(self, name: str | None, detail: str = "") -> None:
        """Be in phase ``name`` from here (its line printed as it starts; its seconds counted)
        until another step names another; None: in none.  A step that names the phase already
        open stays in it without a new line."""
        if name is not None and name == self._phase_name:
            return
        self.end_phase()
        if name is not None:
            self._phase = contextlib.ExitStack()
            self._phase.enter_context(self.phases(name, detail))
            self._phase_name = name

    def end_phase(self) -> None:
        if self._phase is not None:
            stack, self._phase, self._phase_name = self._phase, None, None
            stack.close()

    def dump(self, step: str, mod) -> None:
        """Write ``mod`` as ``NN_<step>.py`` into ``debug_dump`` (``--debug-dump DIR``): a wrong
        fusion or layout is found by reading files, not by guessing."""
        if self.debug_dump:
            os.makedirs(self.debug_dump, exist_ok=True)
            with open(os.path.join(self.debug_dump, f"{STEP_NAMES.index(step) + 1:02d}_{step}.py"), "w") as f:
                f.write(mod.script(show_meta=False))


# ---- the steps ---------------------------------------------------------------------------------

def prepare(s: BuildState) -> None:
    """The model as a ``Frontend``; with ``check_input``, probed at the input shape (a shape it
    cannot take, an output that is no tensor, activations that do not fit in memory: refused
    before any long work); the tuning database and the kernel chooser it and ``families`` make."""
    s.model = as_frontend(s.model, s.name)
    s.name = s.name or s.model.name
    if s.check_input:
        s.probe = s.model.probe(s.input_shape, s.name)
        host = s.target is None or s.target.kind.name == "llvm"
        model_check.check_memory(s.probe, s.input_shape, s.name, host_batch=None if host else verify_mod.IMAGES)
        # until the run ends, the model gives the first tensor of its output (what a library computes)
        s._run.enter_context(s.model.first_output(s.probe))
    if s.tuning_log:
        s.database = load_database(s.tuning_log, s.ignore_stale)
        s.chooser = measured_chooser(s.database, s.target)
    if s.families:
        s.chooser = family_chooser(s.families, s.chooser)


def export(s: BuildState) -> None:
    """The model exported once (``frontend.Frontend.export``; a given export is reused: the
    verification's twin shares its build's), imported into Relax at the build's batch."""
    if s.exported is None:
        s.exported = s.model.export(s.input_shape)
    s.float_exported = s.float_exported or s.exported
    s.phase("export", f"{s.model.exporter} at {tuple(s.input_shape)} -> Relax")
    s.mod = s.exported.imported(s.batch)[0]
    s.dump("export", s.mod)


_SIMPLIFY = "fold batch norms and constants, find the layers"   # one progress line for simplify + analyze


def simplify(s: BuildState) -> None:
    """Batch norms and constants folded, channels-last regions as NCHW ops (``exported.simplified``)."""
    s.phase("simplify", _SIMPLIFY)
    _, s.mod, s.names = s.exported.simplified(s.batch)
    s.dump("simplify", s.mod)


def analyze(s: BuildState) -> None:
    """The layers (``graph.analyze``); a skip entry that matches none, or a graph the caller
    refuses (``check_graph``), ends the build here, before calibration."""
    s.phase("simplify", _SIMPLIFY)
    fg = s.exported.at(s.batch)
    s.mod, s.names, s.graph = fg.mod, fg.names, fg.graph
    s.end_phase()
    check_skip(s.graph, s.config, s.require_int8)
    if s.check_graph is not None:
        s.check_graph(s.graph)


def ranges(s: BuildState) -> None:
    """Every point's range: the given source's, else the model's own (a Q/DQ file's, whose float
    layers join the skip list), else calibration on scikit-image's photos."""
    own, s.config = s.model.own_ranges(s.exported, s.config)
    s.ranges = s.ranges if s.ranges is not None else own if own is not None else Calibrate()
    s.config = s.config.resolved(calibrated=calibrates(s.ranges))   # the scheme's defaults, decided
    s.context = RangeContext(s.graph, tuple(s.input_shape), s.config, lambda: s.exported.at(1).graph,
                             s.phases.enabled)
    s.phase("ranges", describe_ranges(s.ranges, s.config))
    s.amax, s.ranges_report = s.ranges.resolve(s.context)
    s.end_phase()
    if s.config.bias_correction and s.context.channel_means is None:
        raise InputError(f"bias correction needs the inputs' means from calibration images; these ranges come from "
                         f"{s.ranges_report.get('source')}: calibrate (drop --checkpoint / given ranges) or turn "
                         "bias correction off")


def equalize(s: BuildState) -> None:
    """With ``equalization``: the channels between conv pairs rescaled (``ranges/equalize.py``) by
    factors from the calibration's per-channel maxima, then the equalized graph calibrated again
    (its ranges replace the first pass's); factors given with the ranges (``GivenRanges``: a
    compare's libraries, an ONNX export's) are applied as they are."""
    given = s.context.equalization
    if given is None and not s.config.equalization:
        return
    if given is None and s.context.channel_amax is None:
        raise InputError(f"equalization needs the activations' per-channel ranges from calibration images; these "
                         f"ranges come from {s.ranges_report.get('source')}: calibrate (drop --checkpoint / given "
                         "ranges) or turn equalization off (--no-equalization)")
    factors = given if given is not None else equalization.factors(s.graph, s.context.channel_amax)
    if not factors:     # no pair, or none with a channel to widen: the graph and its ranges stay
        s.context.equalization = {}
        s.ranges_report = dict(s.ranges_report, equalization=dict(pairs=[]))
        return
    s.phase("equalize", f"equalize the channels of {len(factors)} conv pairs"
            + ("" if given is not None else ", calibrate again"))
    base = s.exported
    s.exported = equalization.EqualizedGraphs(base, factors)
    fg = s.exported.at(s.batch)
    s.mod, s.names, s.graph = fg.mod, fg.names, fg.graph
    if given is None:
        first = s.ranges_report
        ctx = RangeContext(s.graph, tuple(s.input_shape), s.config, lambda: s.exported.at(1).graph, s.phases.enabled)
        images = s.context.images if s.context.held_out is None else np.concatenate([s.context.images,
                                                                                     s.context.held_out])
        s.amax, report = dataclasses.replace(getattr(s.ranges, "inner", s.ranges), images=images).resolve(ctx)
        s.ranges_report = {**report, **{k: first[k] for k in ("images_from", "available", "skipped") if k in first}}
        s.context = dataclasses.replace(ctx, images=s.context.images, held_out=s.context.held_out)
    s.context.equalization = factors
    if s.float_exported is base:    # the per-layer check's float activations: the equalized graph's (same logits)
        s.float_exported = s.exported
    s.ranges_report = dict(s.ranges_report, equalization=equalization.summary(base.at(s.batch).graph, factors))
    s.end_phase()
    s.dump("equalize", s.mod)


def weight_rounding(s: BuildState) -> None:
    """With ``weight_rounding="gptq"``: the weights rounded by GPTQ on the calibration images, the
    model exported again with them (its graph replaces the float one's)."""
    if s.config.weight_rounding != "gptq":
        return
    if s.model.module is None:
        raise InputError(f"GPTQ weight rounding rounds a torch model's layers; {s.model.name} is not one: round "
                         "to nearest (drop --weight-rounding gptq)")
    if s.context.images is None:
        raise InputError(f"GPTQ weight rounding needs calibration images; these ranges come from "
                         f"{s.ranges_report.get('source')}: calibrate (drop --checkpoint / given ranges) or round "
                         "to nearest")
    layers = [ly.name for ly in s.graph.layers if ly.kind in ("conv2d", "dense") and may_run_int8(ly, s.config)]
    s.phase("gptq", f"round the weights of {len(layers)} layers on the calibration images")
    rounded, s.rounding, integers = gptq_model(s.model.module, s.context.images[: s.config.num_calib_images], layers)
    # the weights changed: the one export this build makes again
    s.model = s.model.with_module(rounded)
    s.exported = s.model.export(s.input_shape)
    fg = s.exported.at(s.batch)
    s.mod, s.names, s.graph = fg.mod, fg.names, fg.graph
    s.end_phase()
    s.dump("weight_rounding", s.mod)
    check_rounded(s.graph, integers)


def _quantize_phase(s: BuildState) -> None:
    s.phase("quantize", f"choose int8 kernels for {s.target_info.kind} {s.target_info.arch or ''}".rstrip())


def plan(s: BuildState) -> None:
    """The quantization plan (``tvm_qconv/quantization``): per layer int8 or float, its kernel, its
    integer arguments; what a Q/DQ file quantizes and the plan keeps float, noted."""
    _quantize_phase(s)
    s.plan = plan_quantization(s.graph, s.amax, s.config, s.target_info, choices=s.choices, chooser=s.chooser,
                               channel_means=s.context.channel_means if s.config.bias_correction else None)
    for lp in s.plan.layers:
        why = (s.float_reasons or {}).get(lp.layer.name)
        if why is not None and not lp.int8:
            lp.why_float = why
            lp.row = dict(lp.row, kernel=f"float ({why})", kept_for_accuracy=True)
    if hasattr(s.ranges, "plan_notes"):     # a Q/DQ file: where the library keeps float what the file quantizes
        s.ranges_report = dict(s.ranges_report,
                               notes=list(s.ranges_report.get("notes", [])) + s.ranges.plan_notes(s.plan, s.graph))


def fused(plan: QuantizationPlan) -> QuantizationPlan:
    """The plan with tables, LayerNorms and residual adds in their convs' epilogues."""
    return fuse_residuals(fuse_layer_norms(fuse_tables(plan)))


def fuse(s: BuildState) -> None:
    """Tables, LayerNorms and residual adds into their convs' kernels (:func:`fused`), except where
    every layer's output must exist to compare (``expose_activations``)."""
    _quantize_phase(s)
    s.lowered = s.plan if s.expose_activations else fused(s.plan)


def lower(s: BuildState) -> None:
    """The int8 Relax module (``lowering/relax.py``, weights inline) and the build report's rows."""
    _quantize_phase(s)
    lowering = LowerToRelax(s.lowered, s.expose_activations)
    s.mod = lowering(s.mod)
    s.end_phase()
    s.dump("lower", s.mod)
    planned = s.lowered.report()
    s.report = dict(layers=planned["layers"], float_ops=lowering.report["float_ops"],
                    float_op_details=lowering.report["float_op_details"],
                    conversions=lowering.report["conversions"], relayouts=lowering.report["relayouts"],
                    unsigned=planned["unsigned"], unsigned_fallback=planned["unsigned_fallback"],
                    exposed=lowering.report["exposed"], ranges=s.ranges_report)
    if s.rounding is not None:
        s.report["weight_rounding"] = s.rounding
    note = s.model.report_note(s.probe) if s.probe is not None else None
    if note:
        s.report["output"] = note


def _schedule_phase(s: BuildState) -> None:
    s.phase("schedule", "lift weights, apply schedules" + (" from the tuning log" if s.database is not None else ""))


def lift(s: BuildState) -> None:
    """The weights out of the module into its parameters (``LiftConstantsToParams``)."""
    _schedule_phase(s)
    lifting = LiftConstantsToParams()
    s.mod = lifting(s.mod)
    s.params = lifting.params
    s.dump("lift", s.mod)


def apply_tuning(s: BuildState) -> None:
    """The tuning database's schedules on the kernels it tuned (``tuning/apply.py``)."""
    _schedule_phase(s)
    if s.tuning_log:
        s.mod, s.tuned = apply_tuning_database(s.mod, s.tuning_log, s.target, s.database,
                                               ignore_stale=s.ignore_stale)
        s.dump("apply_tuning", s.mod)


def schedule(s: BuildState) -> None:
    """Every other kernel's own schedule (``ScheduleInt8Kernels``: its implementation's, or dlight's)."""
    _schedule_phase(s)
    scheduling = ScheduleInt8Kernels(s.target)
    s.mod = scheduling(s.mod)
    s.applied = scheduling.applied
    s.end_phase()
    s.dump("schedule", s.mod)
    s.report = dict(s.report, schedules=s.applied, tuned=s.tuned)


def compile(s: BuildState) -> None:  # noqa: A001 - the step's name
    """``tvm.compile`` with the compile options of the kernels the module calls (the tensor-core
    family's TIR pipeline); a CUDA build's source through nvcc where this TVM cannot compile it."""
    impls = {registry.of_func(f) for f in s.mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)} - {None}
    options = registry.compile_options(impls)
    config = {"relax.backend.use_cuda_graph": s.cuda_graph and s.target.kind.name == "cuda", **options["config"]}
    arch = f" {s.target.attrs['arch']}" if "arch" in s.target.attrs else ""
    with s.phases("compile", f"tvm.compile for {s.target.kind.name}{arch}"), s.target, \
            tvm.transform.PassContext(opt_level=3, config=config, instruments=interrupts.pass_instruments()):
        s.executable = tvm.compile(s.mod, target=s.target, tir_pipeline=options["tir_pipeline"])
    if s.target.kind.name == "cuda":
        s.report["cuda_source"] = _check_cuda_source(s)


def verify(s: BuildState) -> None:
    """The library's logits against the float model's on images calibration did not use (or the
    calibration images); under the floor or the accuracy target, each layer's loss from a twin at
    batch 1 (``tvm_qconv/verify.py``)."""
    if s.verify:
        with s.phases("verify", "run the library against the float model"):
            s.report["verify"] = _verification(s)


STEPS: tuple[Callable[[BuildState], None], ...] = (
    prepare, export, simplify, analyze, ranges, equalize, weight_rounding, plan, fuse, lower,
    lift, apply_tuning, schedule, compile, verify)
STEP_NAMES = tuple(step.__name__ for step in STEPS)


def run(s: BuildState, *, start: str = "prepare", until: str = "verify") -> BuildState:
    """Run the steps from ``start`` to ``until`` (both included) on ``s``; its phase ends with them."""
    with contextlib.ExitStack() as s._run:
        try:
            for step in STEPS[STEP_NAMES.index(start): STEP_NAMES.index(until) + 1]:
                step(s)
        finally:
            s.end_phase()
    s._run = None
    return s


# ---- the steps' helpers ------------------------------------------------------------------------

def check_skip(graph: Graph, config: QuantConfig, require_int8: bool = False) -> None:
    """Refuse a skip entry that matches no layer, or (``require_int8``: the CLIs) a skip list that
    matches every conv and linear layer, nothing left in int8, before anything is calibrated.
    From Python, ``skip=("*",)`` is a float build on purpose (the "quantization off equals
    float" reference).

    Raises:
        InputError: naming the entries and the layers there are.
    """
    names = [ly.name for ly in graph.layers]
    unknown = [p for p in config.skip if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unknown:
        listed = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense")]
        raise InputError(f"skip list entry {', '.join(map(repr, unknown))} matches no layer of this model; its "
                         f"conv and linear layers are {listed[:12]}{' ...' if len(listed) > 12 else ''}")
    quantizable = [ly.name for ly in graph.layers if ly.kind in ("conv2d", "dense")]
    if require_int8 and quantizable and all(any(fnmatch.fnmatchcase(n, p) for p in config.skip) for n in quantizable):
        raise InputError(f"skip list {', '.join(map(repr, config.skip))} keeps all {len(quantizable)} conv and linear "
                         "layers of this model in float: nothing would run in int8; name fewer layers (e.g. "
                         f"--skip {quantizable[-1]} for the classifier alone)")


def check_rounded(graph: Graph, integers: dict) -> None:
    """The folded graph's weights, rounded to nearest as the plan will, give GPTQ's integers.

    Raises:
        RuntimeError: naming a layer whose rounding the export lost (a bug, not bad input).
    """
    weights = {ly.name: ly.weight for ly in graph.layers if ly.weight is not None and ly.kind in ("conv2d", "dense")}
    for name, q in integers.items():
        if name not in weights or weights[name].size != q.size:
            raise RuntimeError(f"GPTQ: {name}'s rounded weights were not found again after export and folding")
        # a Linear layer may have become a 1x1 conv ([O, K] -> [O, K, 1, 1]), and a layer scale folded
        # into it (transform/channels_first.py) scales each row: the same integers, a negative scale negates them
        rows = quantize_weight_per_channel(weights[name])[0].reshape(q.shape[0], -1).astype(np.int16)
        want = q.reshape(q.shape[0], -1).astype(np.int16)
        if not np.all(np.all(rows == want, axis=1) | np.all(rows == -want, axis=1)):
            raise RuntimeError(f"GPTQ: {name}'s rounded weights were not found again after export and folding")


def family_chooser(families, fallback):
    """Prefer the first of ``families`` that can run a layer; else ask ``fallback``."""
    def choose(op, wl, candidates):
        for family in families:
            for impl in candidates:
                if impl.family == family:
                    return impl.name
        return fallback(op, wl, candidates) if fallback else None
    return choose


def _check_cuda_source(s: BuildState) -> dict:
    """nvcc on the CUDA source of a build this TVM could not compile itself (``cuda_check``): a
    kernel nvcc rejects fails the build here, not the load on the user's GPU."""
    arch = str(s.target.attrs["arch"])
    if cuda_check.tvm_compiles_cuda() or shutil.which("nvcc") is None:
        return cuda_check.check(s.executable, arch)
    with s.phases("nvcc", f"compile the CUDA source for {arch} (this TVM has no CUDA runtime to compile it)"):
        return cuda_check.check(s.executable, arch)


def _verification(s: BuildState) -> dict:
    """:func:`verify`'s result: the logits SQNR, and under the floor or the accuracy target each
    layer's, from a twin at batch 1 that returns every int8 activation."""
    context = s.context
    if context.images is None:
        return dict(status="skipped", reason="the ranges were not calibrated: no images to check on")
    reason = verify_mod.cannot_run(s.target)
    if reason:
        return dict(status="skipped", reason=reason)
    held_out = context.held_out is not None  # (Calibrate holds out none, or at least HELD_OUT_MIN)
    images = context.held_out if held_out else context.images[:verify_mod.IMAGES]
    # the float model as the user gave it (with GPTQ, s.model is the rounded copy)
    sqnr, ref = verify_mod.logits_sqnr(s.executable, s.params, s.target, s.batch, s.float_exported.frontend, images)
    floor = s.verify_floor_db
    result = dict(status="ok" if sqnr >= floor else "failed", logits_sqnr_db=round(sqnr, 2),
                  images=len(images), held_out=held_out, floor_db=floor)
    if verify_mod.input_blind(ref):
        return dict(result, status="cannot judge",
                    reason=f"the float model gives the same logits for all {len(images)} images (its output does not "
                           "depend on the input, as in a random init whose activations die out): agreeing with it "
                           "proves nothing; build it with trained weights (--weights) to verify it")
    target = s.accuracy_target_db
    if target is not None:
        result["target_db"] = target
    # each int8 layer's kernel in the unfused plan (a table or an add in a conv's epilogue has its own)
    kernels = {lp.layer.name: lp.impl.name for lp in s.plan.layers if lp.int8 and lp.impl is not None}
    if kernels and (sqnr < floor or (target is not None and sqnr < target)):
        t0 = time.time()
        twin = run(twin_state(s, kernels), until="compile")
        # against the float model's own activations (with GPTQ, the twin's graph is the rounded model's)
        reference = s.float_exported.at(1).graph
        layers = verify_mod.layer_sqnr(twin.executable, twin.params, s.target, twin.report["exposed"], reference,
                                       images)
        result["layers"] = layers
        result["losses"] = verify_mod.losses(layers, twin.report["exposed"])
        result["per_layer_s"] = round(time.time() - t0, 1)
        result["first_bad_layer"] = next((ly["layer"] for ly in layers if ly["sqnr_db"] < floor), None)
    return result


def twin_state(s: BuildState, kernels: dict) -> BuildState:
    """The verification's twin of build ``s``: batch 1, every int8 activation returned, from the
    same ranges (``GivenRanges``) and the same kernel per layer, pinned (a tuning database tuned at
    another batch matches nothing at batch 1, and integer results do not depend on the schedule),
    the build's export reused (GPTQ's rounded weights taken as they are, on their grid), bias
    correction from the build's own channel means."""
    return BuildState(s.model, (1, *s.input_shape[1:]), s.target_info,
                      config=dataclasses.replace(s.config, weight_rounding="nearest", equalization=False),
                      ranges=GivenRanges(s.amax, s.context.channel_means),
                      target=s.target, name=s.name, choices={**kernels, **(s.choices or {})}, families=s.families,
                      cuda_graph=s.cuda_graph, expose_activations=True, exported=s.exported)
