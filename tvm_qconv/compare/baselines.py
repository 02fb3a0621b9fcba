"""The rows of ``deploy.py compare``: the project's int8 library and every baseline a user could
pick instead, each prepared for one batch size and then measured the same way
(``measure.py``).

A baseline's ``prepare(ctx, batch)`` returns a :class:`Forward` (how to put an input on the
device, run one forward, read the logits back) or raises :class:`Unavailable` when it cannot run
here (no GPU, a package not installed): the row then says why and the run carries on.  The
cuDNN row is the exception: cuDNN has no whole-model graph, so it times the model's convs one by
one (every plan, the fastest kept) and sums them (``run_cudnn``).

``ctx`` is the comparison's :class:`tvm_qconv.compare.run.Context`: the float model, the device,
the built libraries, the exported ONNX file.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# torch, tvm and the modules that bring them are imported in the functions that prepare a row:
# deploy.py imports this module for BASELINE_KEYS before parsing its arguments (0.1 s; torch and
# tvm take ~2-3 s more).


class Unavailable(Exception):
    """This baseline cannot run here; the message says why (a skipped row, not a failure)."""


@dataclass
class Forward:
    """One prepared baseline at one batch size.

    Attributes:
        call: one forward of a prepared input; may return before the device is done.
        put: float32 images [batch, 3, H, W] (NumPy) -> a prepared input.
        get: what ``call`` returned -> float32 logits [batch, classes] (NumPy).
        build_s: seconds spent building / compiling / loading before the first timed call.
        note: a remark for the table (e.g. what the row includes).
        cpu: the forward runs on the CPU (wall-clock timing, no device memory) whatever the
            comparison's device.
        comparable: it holds the weights of the comparison's float model (a ``--lib`` built from
            others is timed, but its agreement would measure nothing).
    """

    call: Callable[[Any], Any]
    put: Callable[[np.ndarray], Any]
    get: Callable[[Any], np.ndarray]
    build_s: float | None = None
    note: str = ""
    cpu: bool = False
    comparable: bool = True


@dataclass(frozen=True)
class Baseline:
    """A row of the comparison: ``key`` (``--baselines``' name), its label, its family, and how
    it is prepared; ``run`` replaces the forward measurement (the cuDNN row's per-layer sum)."""

    key: str
    name: str
    family: str
    prepare: Callable | None = None
    run: Callable | None = None
    needs_cuda: bool = False


# ---- the project's int8 library ---------------------------------------------------------------

def prepare_int8(ctx, batch: int, graph: bool) -> Forward:
    """The project's library for ``batch`` (built by the comparison, or the user's ``--lib``)."""
    import tvm  # row-time imports: see the note at the top

    from ..runtime.compiled_model import CompiledModel, flatten  # row-time import: see the note at the top
    built = ctx.library(batch, graph)   # raises the build's own error, or Unavailable
    model = CompiledModel(built.path)
    dev = model.dev

    def call(x):
        return model.vm["main"](x, *model.params)

    return Forward(call=call, put=lambda x: tvm.runtime.tensor(model.check_input(x), dev),
                   get=lambda out: flatten(out)[0], build_s=built.build_s, note=built.note,
                   comparable=built.same_weights)


# ---- PyTorch ----------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def set_tf32(enabled: bool) -> None:
    """TF32 for convs and matmuls, on or off (PyTorch's own default turns it on for convs only:
    a "fp32" row would otherwise run its convs in TF32)."""
    import torch  # row-time import: see the note at the top
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _torch_model(ctx, precision: str):
    """The float model in ``precision`` on the comparison's device, channels_last, cuDNN's
    algorithm search on: how a PyTorch user runs it fastest in eager mode."""
    import torch  # row-time import: see the note at the top
    if ctx.model.module is None:
        raise Unavailable("--model is an ONNX file: there is no PyTorch module to run (ONNX Runtime's rows run "
                          "the model)")
    dtype = getattr(torch, _TORCH_DTYPES[precision])
    set_tf32(precision == "tf32")
    torch.backends.cudnn.benchmark = True
    model = copy.deepcopy(ctx.model.module).to(ctx.device, dtype).to(memory_format=torch.channels_last).eval()

    def put(x):
        return torch.from_numpy(x).to(ctx.device, dtype).contiguous(memory_format=torch.channels_last)
    return model, put


def _logits(y) -> np.ndarray:
    return y.float().cpu().numpy()


def prepare_torch(ctx, batch: int, precision: str, graph: bool) -> Forward:
    """PyTorch eager in ``precision``, or the same captured in one CUDA graph (``graph``): the
    captured graph reads a static input, so each call copies its input there first (one
    device-to-device copy of the images, ~1 % of a forward).

    Raises:
        RuntimeError: the graph's replay does not reproduce eager PyTorch on a new input (its
            timing would not be of this model; see ``check_replay``).
    """
    t = time.perf_counter()
    model, put = _torch_model(ctx, precision)
    if not graph:
        return Forward(call=model, put=put, get=_logits, build_s=time.perf_counter() - t)
    sets = ctx.input_sets(batch)
    call, out = capture(model, put(sets[0]))
    check_replay(call, out, model, put(sets[-1]))
    return Forward(call=call, put=put, get=_logits, build_s=time.perf_counter() - t,
                   note="input copied into the graph's buffer")


def capture(model, static):
    """``model(static)`` captured in a CUDA graph, PyTorch's recipe (warm-up on a side stream,
    then capture): ``(call, out)``, where ``call(x)`` copies ``x`` into ``static``, replays and
    returns ``out``, the graph's output tensor."""
    import torch  # row-time import: see the note at the top
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):       # cuDNN's algorithm search and the allocator, outside the capture
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = model(static)

    def call(x):
        static.copy_(x)
        cuda_graph.replay()
        return out
    # The graph reads the model's weights at the addresses they had during the capture: the
    # closure keeps the model alive, or a caller that drops it replays freed (then reused)
    # memory, which is what made compare's CUDA-graph rows wrong (H100, 2026-11-25).
    call.model = model
    return call, out


# Relative L2 error a replay may have against eager PyTorch in the same precision: cuDNN may
# pick other algorithms inside the capture (fp16 / bf16 differences ~1e-3); a replay that did
# not compute this input is off by ~1 or more.
REPLAY_TOLERANCE = 2e-2


class NonFiniteOutput(RuntimeError):
    """Eager PyTorch's own output overflowed (random-init Inception-V3 in fp16: activations reach
    1.6e12): there is nothing to check a replay against, and nothing worth timing."""


def check_replay(call, out, model, x) -> None:
    """Replay on ``x`` into a zeroed output and compare with eager PyTorch on ``x``.

    A comparison on the H100 (2026-11-25) timed CUDA-graph rows whose outputs were not the
    model's: the model had been freed after its capture (``capture`` now keeps it).  This check
    runs while the caller still holds the model, so it catches a capture that went wrong, not a
    model freed later; the agreement measured after the timing catches that.
    """
    expected = model(x).float()
    bad = int((~expected.isfinite()).sum())
    if bad:
        raise NonFiniteOutput(f"eager PyTorch's output is not finite ({bad} of {expected.numel()} values): the model "
                              f"overflows in {x.dtype}, so no replay can be checked against it "
                              "and its timing would be of inf / NaN arithmetic (run it in a wider type, e.g. bf16)")
    out.zero_()
    got = call(x).float()
    err = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
    if not err <= REPLAY_TOLERANCE:
        raise RuntimeError(f"the captured CUDA graph does not reproduce eager PyTorch on a new input (relative "
                           f"error {err:.3g} > {REPLAY_TOLERANCE}): its timing would not be of this model")


def prepare_torch_compile(ctx, batch: int) -> Forward:
    """``torch.compile(mode="max-autotune")`` in fp16 (Inductor's autotuned Triton / cuBLAS
    kernels, CUDA graphs on); its compile time is the first calls'."""
    import torch  # row-time import: see the note at the top
    torch._dynamo.reset()          # a graph compiled for another batch size is not reused
    t = time.perf_counter()
    model, put = _torch_model(ctx, "fp16")
    compiled = torch.compile(model, mode="max-autotune", dynamic=False)
    for x in ctx.input_sets(batch)[:2]:
        compiled(put(x))
    torch.cuda.synchronize()
    return Forward(call=compiled, put=put, get=_logits, build_s=time.perf_counter() - t)


# ---- ONNX Runtime and TensorRT, on the exported Q/DQ model -------------------------------------

def prepare_onnxruntime(ctx, batch: int, provider: str) -> Forward:
    """ONNX Runtime on the Q/DQ model (``deploy.py export-onnx``: the project's scales), with all
    graph optimizations (its QDQ fusion runs the convs in int8)."""
    try:
        import onnxruntime as ort  # may be missing where the tree runs uninstalled: the row says so
    except ImportError as err:
        raise Unavailable(f"onnxruntime is not installed ({err})") from None
    if provider == "CUDAExecutionProvider":
        if provider not in ort.get_available_providers():
            raise Unavailable(f"onnxruntime {ort.__version__} here has no CUDA execution provider (it has "
                              f"{', '.join(ort.get_available_providers())}): install onnxruntime-gpu built for "
                              "this CUDA")
        if hasattr(ort, "preload_dlls"):  # 1.21+: CUDA / cuDNN from the nvidia-* wheels PyTorch installed
            ort.preload_dlls()
    path, export_s = ctx.onnx_model()
    t = time.perf_counter()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # int8 kernels on x86: by default ORT turns int8 Q/DQ into uint8, whose sums saturate on CPUs
    # without VNNI (docs/usage.md, "Export to ONNX")
    options.add_session_config_entry("session.qdqisint8allowed", "1")
    session = ort.InferenceSession(path, options, providers=[provider])
    if session.get_providers()[0] != provider:  # ORT falls back to the CPU when the CUDA libraries do not load
        raise Unavailable(f"onnxruntime {ort.__version__} could not start its {provider} (session runs on "
                          f"{session.get_providers()[0]}): its CUDA / cuDNN libraries did not load")
    in_name, out_name = session.get_inputs()[0].name, session.get_outputs()[0].name
    build_s = export_s + time.perf_counter() - t
    if provider == "CPUExecutionProvider":
        return Forward(call=lambda x: session.run([out_name], {in_name: x})[0], put=np.ascontiguousarray,
                       get=np.asarray, build_s=build_s, note="on the CPU" if ctx.device == "cuda" else "", cpu=True)

    def call(value):  # inputs and outputs stay on the GPU (I/O binding): no host copies timed
        binding = session.io_binding()
        binding.bind_ortvalue_input(in_name, value)
        binding.bind_output(out_name, "cuda")
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]
    return Forward(call=call, put=lambda x: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x), "cuda", 0),
                   get=lambda v: v.numpy(), build_s=build_s)


def prepare_tensorrt(ctx, batch: int) -> Forward:
    """TensorRT's engine of the Q/DQ model (explicit int8 from its Q/DQ nodes, fp16 allowed for
    the rest), for this batch size."""
    try:
        import tensorrt as trt  # optional: not a dependency of the project
    except ImportError:
        raise Unavailable("not installed (the tensorrt package is not importable here)") from None
    import torch  # row-time import: see the note at the top
    path, export_s = ctx.onnx_model()
    t = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    with open(path, "rb") as f:
        if not parser.parse(f.read()):
            raise RuntimeError("TensorRT's ONNX parser: " + "; ".join(str(parser.get_error(i))
                                                                    for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.INT8)
    config.set_flag(trt.BuilderFlag.FP16)
    name = network.get_input(0).name
    shape = (batch, *ctx.input_shape[1:])
    profile = builder.create_optimization_profile()
    profile.set_shape(name, shape, shape, shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT built no engine (its log above says why)")
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    context.set_input_shape(name, shape)
    out_name = engine.get_tensor_name(engine.num_io_tensors - 1)
    out = torch.empty(tuple(context.get_tensor_shape(out_name)), dtype=torch.float32, device="cuda")
    context.set_tensor_address(out_name, out.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream

    def call(x):
        context.set_tensor_address(name, x.data_ptr())
        context.execute_async_v3(stream)
        return out
    return Forward(call=call, put=lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda(), get=_logits,
                   build_s=export_s + time.perf_counter() - t)


# ---- cuDNN's int8 convs, per layer --------------------------------------------------------------

def run_cudnn(ctx, batch: int) -> dict:
    """The model's convs through cuDNN's int8 fused conv (+scale+bias+ReLU, int8 out), each
    timed over every plan with the fastest kept, summed: the runnable stand-in for TensorRT's
    int8 conv tactics.  Covers the convs only (not pools, adds, the classifier, nor the
    conversions between them), so it is a lower bound of a whole cuDNN model."""
    from . import cudnn_int8  # row-time import (tvm, torch): see the note at the top
    why = cudnn_int8.missing()
    if why:
        raise Unavailable(why)
    total, layers, left_out = 0.0, [], []
    t = time.perf_counter()
    for conv in ctx.convs:
        if conv["groups"] != 1 or conv["padding"][:2] != conv["padding"][2:]:
            left_out.append(conv["layer"])
            continue
        key = (batch, *(tuple(v) if isinstance(v, list) else v for k, v in sorted(conv.items()) if k != "layer"))
        if key not in ctx.cudnn_cache:
            ctx.cudnn_cache[key] = cudnn_int8.time_fused_conv(batch, conv["in_channels"], conv["height"],
                                                              conv["width"], conv["out_channels"],
                                                              tuple(conv["kernel"]), tuple(conv["stride"]),
                                                              tuple(conv["padding"][:2]), tuple(conv["dilation"]))
        best = ctx.cudnn_cache[key]
        total += best["ms"]
        layers.append(dict(layer=conv["layer"], ms=round(best["ms"], 4), plans=best["plans"], plan=best["plan"]))
    note = f"{len(layers)} of {len(ctx.convs)} convs summed, nothing else"
    if left_out:
        note += f" (grouped or asymmetric left out: {len(left_out)})"
    return dict(median_ms=total, images_per_s=batch / total * 1e3 if total else None,
                build_s=time.perf_counter() - t, note=note, layers=layers)


def baselines() -> list[Baseline]:
    """Every row, in the table's order: the project's first, then PyTorch, then the int8 tools."""
    rows = [Baseline("int8-graph", "tvm_qconv int8 + CUDA graph", "tvm_qconv",
                     lambda ctx, b: prepare_int8(ctx, b, graph=True), needs_cuda=True),
            Baseline("int8", "tvm_qconv int8", "tvm_qconv", lambda ctx, b: prepare_int8(ctx, b, graph=False))]
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        for graph in (False, True):
            rows.append(Baseline(f"torch-{precision}" + ("-graph" if graph else ""),
                                 f"PyTorch {precision}" + (" + CUDA graph" if graph else ""), "pytorch",
                                 lambda ctx, b, p=precision, g=graph: prepare_torch(ctx, b, p, g),
                                 needs_cuda=graph or precision in ("tf32", "fp16")))
    rows += [Baseline("torch-compile", "torch.compile max-autotune fp16", "pytorch", prepare_torch_compile,
                      needs_cuda=True),
             Baseline("cudnn-int8", "cuDNN int8 fused convs (sum)", "cudnn", run=run_cudnn, needs_cuda=True),
             Baseline("ort-cuda", "ONNX Runtime CUDA EP (Q/DQ)", "onnxruntime",
                      lambda ctx, b: prepare_onnxruntime(ctx, b, "CUDAExecutionProvider"), needs_cuda=True),
             Baseline("ort-cpu", "ONNX Runtime CPU EP (Q/DQ)", "onnxruntime",
                      lambda ctx, b: prepare_onnxruntime(ctx, b, "CPUExecutionProvider")),
             Baseline("tensorrt", "TensorRT int8 (Q/DQ)", "tensorrt", prepare_tensorrt, needs_cuda=True)]
    return rows


BASELINE_KEYS = tuple(b.key for b in baselines())
