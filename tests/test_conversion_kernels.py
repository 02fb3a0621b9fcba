"""The conversion kernels (quantize, dequantize, relayout, a linear layer's input rows) as registry
implementations, and the interface every implementation the quantize pass lowers fills in.

What must not change: each conversion's PrimFunc is the kernel it always was (the same compute,
the same ``tvm_qconv.kernel`` name, which is the Relax function's), and each gets the schedule it
always got (its own on CUDA for the quantize to NCHW4c and both NHWC32 conversions, dlight for the
others, none on llvm); only now the registry finds them (``registry.of_func``), not a table of
kernel names.
"""
import numpy as np
import pytest
import torch
import tvm

from tests.workloads import conv_wl
from tvm_qconv import registry
from tvm_qconv.config import QuantConfig
from tvm_qconv.int8_module import quantize_module
from tvm_qconv.ranges import Calibrate
from tvm_qconv.schedules.dense_int8 import DenseWorkload, quantize_rows, quantize_rows_compute
from tvm_qconv.schedules.kernel import IMPL_ATTR, KERNEL_ATTR, WORKLOAD_ATTR
from tvm_qconv.schedules.layer_norm_int8 import layer_norm_params
from tvm_qconv.schedules.nchw4c.layout import LAYOUT as NCHW4C
from tvm_qconv.schedules.nchw4c.layout import dequantize_unpack, quantize_pack
from tvm_qconv.schedules.relayout import relayout_compute, relayout_int8
from tvm_qconv.schedules.requantize import UNSIGNED_ZERO
from tvm_qconv.schedules.tensorcore.layout import LAYOUT as NHWC32
from tvm_qconv.schedules.tensorcore.layout import dequantize_unpack_nhwc32, quantize_pack_nhwc32
from tvm_qconv.schedules.workload import (AddWorkload, AffineWorkload, AvgPoolWorkload, ChannelsWorkload,
                                          ConcatWorkload, DequantizeWorkload, LayerNormWorkload, LutWorkload,
                                          PoolWorkload, QuantizeRowsWorkload, QuantizeWorkload, RelayoutWorkload,
                                          ScaleWorkload)
from tvm_qconv.target import TargetInfo, make_target
from tvm_qconv.transform import ScheduleInt8Kernels
from tvm_qconv.tuning.tasks import extract_tasks

LLVM = make_target("llvm")
SM75 = make_target("cuda", "sm_75")
SM90 = make_target("cuda", "sm_90")
CPU = tvm.cpu()

# A scale that float32 does not hold exactly: the kernels compute with float32(scale).
SCALE = 0.0123456789
SHAPE = (2, 37, 5, 3)  # 37 channels: neither 4 nor 32 divides them

# Each conversion implementation, a workload of it, and the kernel it must compute: the compute
# definition the pass called before the registry knew conversions (with the scale as given).
CONVERSIONS = {
    "quantize.nchw4c.generic": (QuantizeWorkload(SHAPE, SCALE), lambda: quantize_pack(SHAPE, SCALE)),
    "quantize.nchw4c.generic-u8": (QuantizeWorkload(SHAPE, SCALE, UNSIGNED_ZERO),
                                   lambda: quantize_pack(SHAPE, SCALE, UNSIGNED_ZERO)),
    "quantize.nhwc32.generic": (QuantizeWorkload(SHAPE, SCALE), lambda: quantize_pack_nhwc32(SHAPE, SCALE)),
    "dequantize.nchw4c.generic": (DequantizeWorkload(NCHW4C.packed_shape(SHAPE), 37, SCALE),
                                  lambda: dequantize_unpack(NCHW4C.packed_shape(SHAPE), 37, SCALE)),
    "dequantize.nhwc32.generic-u8": (DequantizeWorkload(NHWC32.packed_shape(SHAPE), 37, SCALE, UNSIGNED_ZERO),
                                     lambda: dequantize_unpack_nhwc32(NHWC32.packed_shape(SHAPE), 37, SCALE,
                                                                      UNSIGNED_ZERO)),
    "relayout.nchw4c_to_nhwc32.generic": (RelayoutWorkload(SHAPE, "NCHW4c", "NHWC32"),
                                          lambda: relayout_compute(NCHW4C, NHWC32, SHAPE)),
    "relayout.nhwc32_to_nchw4c.generic": (RelayoutWorkload(SHAPE, "NHWC32", "NCHW4c"),
                                          lambda: relayout_compute(NHWC32, NCHW4C, SHAPE)),
    "quantize_rows.rows.generic": (QuantizeRowsWorkload((3, 10), SCALE, 12),
                                   lambda: quantize_rows_compute((3, 10), SCALE, 12)),
    "quantize_rows.rows.generic-u8-k32": (QuantizeRowsWorkload((3, 10), SCALE, 32, UNSIGNED_ZERO),
                                          lambda: quantize_rows_compute((3, 10), SCALE, 32, UNSIGNED_ZERO)),
}
CONVERSION_IDS = list(CONVERSIONS)
CONVERSION_OPS = ("quantize", "dequantize", "relayout", "quantize_rows")


def _impl(case: str):
    return registry.get(case.split("-")[0])


def _compute_only(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` without the attributes that name its implementation and workload."""
    for key in (IMPL_ATTR, WORKLOAD_ATTR):
        if key in func.attrs:
            func = func.without_attr(key)
    return func


@pytest.mark.parametrize("case", CONVERSION_IDS, ids=CONVERSION_IDS)
def test_a_conversion_computes_the_kernel_it_always_was_and_the_registry_finds_it(case):
    wl, before = CONVERSIONS[case]
    impl = _impl(case)
    func = impl.compute(wl)
    assert registry.of_func(func) is impl
    assert func.attrs[KERNEL_ATTR] == impl.kernel == before().attrs[KERNEL_ATTR]
    tvm.ir.assert_structural_equal(_compute_only(func), before())
    assert type(wl).of(func) == wl  # the workload it records reads back as itself


def test_conversions_keep_the_kernel_names_that_name_their_relax_functions():
    kernels = {impl.name: impl.kernel for impl in registry.IMPLEMENTATIONS if impl.op in CONVERSION_OPS}
    assert kernels == {"quantize.nchw4c.generic": "quantize_pack", "quantize.nhwc32.generic": "quantize_pack_nhwc32",
                       "dequantize.nchw4c.generic": "dequantize_unpack",
                       "dequantize.nhwc32.generic": "dequantize_unpack_nhwc32",
                       "relayout.nchw4c_to_nhwc32.generic": "relayout_int8",
                       "relayout.nhwc32_to_nchw4c.generic": "relayout_int8",
                       "quantize_rows.rows.generic": "quantize_rows"}


def test_the_old_entry_points_return_the_registry_kernels():
    # Layout.quantize / dequantize, relayout_int8 and quantize_rows stay until every caller asks the registry
    pairs = [(NCHW4C.quantize(SHAPE, SCALE), "quantize.nchw4c.generic", QuantizeWorkload(SHAPE, SCALE)),
             (NHWC32.quantize(SHAPE, SCALE, UNSIGNED_ZERO), "quantize.nhwc32.generic",
              QuantizeWorkload(SHAPE, SCALE, UNSIGNED_ZERO)),
             (NCHW4C.dequantize(NCHW4C.packed_shape(SHAPE), 37, SCALE), "dequantize.nchw4c.generic",
              DequantizeWorkload(NCHW4C.packed_shape(SHAPE), 37, SCALE)),
             (NHWC32.dequantize(NHWC32.packed_shape(SHAPE), 37, SCALE), "dequantize.nhwc32.generic",
              DequantizeWorkload(NHWC32.packed_shape(SHAPE), 37, SCALE)),
             (relayout_int8(NHWC32, NCHW4C, SHAPE), "relayout.nhwc32_to_nchw4c.generic",
              RelayoutWorkload(SHAPE, "NHWC32", "NCHW4c")),
             (quantize_rows((3, 10), SCALE), "quantize_rows.rows.generic", QuantizeRowsWorkload((3, 10), SCALE, 12))]
    for func, name, wl in pairs:
        assert registry.of_func(func).name == name
        tvm.ir.assert_structural_equal(func, registry.get(name).compute(wl))


@pytest.mark.parametrize("op, wl, layout, expected", [
    ("quantize", QuantizeWorkload(SHAPE, SCALE), "NCHW4c", "quantize.nchw4c.generic"),
    ("quantize", QuantizeWorkload(SHAPE, SCALE), "NHWC32", "quantize.nhwc32.generic"),
    ("dequantize", DequantizeWorkload(NHWC32.packed_shape(SHAPE), 37, SCALE), "NHWC32", "dequantize.nhwc32.generic"),
    ("relayout", RelayoutWorkload(SHAPE, "NCHW4c", "NHWC32"), None, "relayout.nchw4c_to_nhwc32.generic"),
    ("relayout", RelayoutWorkload(SHAPE, "NHWC32", "NCHW4c"), "NCHW4c", "relayout.nhwc32_to_nchw4c.generic"),
    ("quantize_rows", QuantizeRowsWorkload((3, 10), SCALE, 12), None, "quantize_rows.rows.generic"),
], ids=["quantize_nchw4c", "quantize_nhwc32", "dequantize_nhwc32", "relayout_to_nhwc32", "relayout_to_nchw4c",
        "quantize_rows"])
@pytest.mark.parametrize("target", [LLVM, SM75, SM90], ids=["llvm", "sm_75", "sm_90"])
def test_select_finds_the_conversion_of_a_layout_on_every_target(op, wl, layout, expected, target):
    assert registry.select(op, wl, TargetInfo.from_target(target), layout=layout).name == expected


def test_conversions_are_never_tuned():
    assert not any(impl.op in CONVERSION_OPS for impl in registry.tunable())


def _run_llvm(func, *arrays):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = func.params[-1]
    result = tvm.runtime.tensor(np.zeros([int(d) for d in out.shape], str(out.dtype)), CPU)
    lib["main"](*[tvm.runtime.tensor(a, CPU) for a in arrays], result)
    return result.numpy()


@pytest.mark.parametrize("case", CONVERSION_IDS, ids=CONVERSION_IDS)
def test_a_conversion_matches_its_numpy_reference_bit_for_bit_and_its_out_shape(case):
    wl, _ = CONVERSIONS[case]
    impl = _impl(case)
    rng = np.random.default_rng(0)
    func = impl.compute(wl)
    x = func.params[0]
    shape, dtype = [int(d) for d in x.shape], str(x.dtype)
    if dtype == "float32":  # a spread of ~100 steps: values past the int8 range clamp
        data = (rng.normal(0, 100, shape) * SCALE).astype(np.float32)
    else:  # an int8 tensor as its producer leaves it: padded channels 0
        logical = wl.shape if isinstance(wl, RelayoutWorkload) else impl.out_shape(wl)  # NCHW
        data = registry.layout(impl.input_layout()).pack(rng.integers(-128, 128, logical).astype(np.int8))
        assert list(data.shape) == shape
    out = _run_llvm(func, data)
    assert out.shape == impl.out_shape(wl)
    np.testing.assert_array_equal(out, impl.reference(wl, data))


def test_conversion_workloads_refuse_what_no_kernel_computes():
    with pytest.raises(ValueError, match="zero must be 0 .* or -128"):
        QuantizeWorkload(SHAPE, SCALE, zero=7)
    with pytest.raises(ValueError, match="positive finite float32"):
        DequantizeWorkload((1, 1, 2, 2, 4), 3, 0.0)
    with pytest.raises(ValueError, match="k_padded must be >= K = 10"):
        QuantizeRowsWorkload((3, 10), SCALE, 8)
    with pytest.raises(ValueError, match="between two layouts"):
        RelayoutWorkload(SHAPE, "NCHW4c", "NCHW4c")
    # the float32 scale, whatever float64 it came as: equal scales make equal kernels
    assert QuantizeWorkload(SHAPE, SCALE) == QuantizeWorkload(SHAPE, float(np.float32(SCALE)))


# ---- the interface: what the quantize pass calls on an implementation --------------------------

# The ops the quantize pass lowers (a layer's or a conversion's); the rest are the training path's.
PASS_OPS = ("conv2d", "dense", "max_pool2d", "avg_pool2d", "add", "concat", "channels", "lut", "affine", "scale",
            "layer_norm", *CONVERSION_OPS)
TRAINING_OPS = ("conv2d_grad_input", "conv2d_grad_weight")
TARGETS = [TargetInfo.from_target(t) for t in (LLVM, make_target("cuda", "sm_90a"))]
CONV_CANDIDATES = [conv_wl(1, 32, 8, 8, 64), conv_wl(1, 32, 8, 8, 32, groups=32), conv_wl(1, 3, 16, 16, 32),
                   conv_wl(1, 32, 8, 8, 32, groups=8)]


def _workload_and_arrays(impl):
    """A workload ``impl`` runs, its number of data inputs, and layer arrays for ``pack_params``."""
    rng = np.random.default_rng(0)
    if impl.op == "conv2d":
        wl = next(w for w in CONV_CANDIDATES if any(impl.applies(w, t) for t in TARGETS))
        o = wl.out_channels
        return wl, 1, (rng.integers(-127, 128, (o, wl.group_in, *wl.kernel)).astype(np.int8),
                       np.zeros(o, np.int32), np.full(o, 1 << 30, np.int32), np.full(o, 31, np.int32))
    if impl.op == "dense":
        wl = DenseWorkload(4, 10, 6, (0.0, float("inf")))
        return wl, 1, (rng.integers(-127, 128, (6, 10)).astype(np.int8), np.ones(6, np.float32),
                       np.zeros(6, np.float32))
    if impl.op in CONVERSION_OPS:
        return next(wl for case, (wl, _) in CONVERSIONS.items() if _impl(case) is impl), 1, ()
    packed = impl.packing.packed_shape((1, 6, 7, 5))
    if impl.name == "avg_pool2d.nhwc32.global":   # a pool over a whole map
        return AvgPoolWorkload((1, 16, 17, 32), (16, 17), (1, 1), (0, 0, 0, 0), 1 << 30, 40), 1, ()
    return {"max_pool2d": (PoolWorkload(packed, (3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True), 1, ()),
            "avg_pool2d": (AvgPoolWorkload(packed, (2, 2), (2, 2), (0, 0, 0, 0), 1 << 30, 32), 1, ()),
            "add": (AddWorkload(packed, 1 << 20, 1 << 20, 21), 2, ()),
            "concat": (ConcatWorkload((1, 7, 5), (6, 3), (1 << 30, 1 << 30), (30, 30)), 2, ()),
            "channels": (ChannelsWorkload((1, 7, 5), 6, 4), 1, (np.array([5, 0, 2, 2], np.int32),)),
            "lut": (LutWorkload((1, 7, 5), 6), 1, (np.arange(-128, 128).astype(np.int8),)),
            "scale": (ScaleWorkload((1, 7, 5), 6, 0.5), 2, ()),   # the int8 map and the float gate
            "layer_norm": (LayerNormWorkload((1, 7, 5), 6), 1, layer_norm_params(np.ones(6), np.zeros(6), 1e-6, 0.1,
                                                                                  0.05, 0, 6)),
            "affine": (AffineWorkload(packed), 1, (np.ones(6, np.int32), np.ones(6, np.int32), np.zeros(6, np.int32))),
            }[impl.op]


LOWERED = [impl for impl in registry.IMPLEMENTATIONS if impl.op in PASS_OPS]


def test_every_op_in_the_registry_is_one_the_pass_lowers_or_a_training_kernel():
    assert {impl.op for impl in registry.IMPLEMENTATIONS} == set(PASS_OPS) | set(TRAINING_OPS)


@pytest.mark.parametrize("impl", LOWERED, ids=[impl.name for impl in LOWERED])
def test_out_shape_and_pack_params_describe_the_compute_parameters(impl):
    wl, inputs, arrays = _workload_and_arrays(impl)
    func = impl.compute(wl)
    params = [(tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]
    assert impl.out_shape(wl) == params[-1][0]
    packed = impl.pack_params(wl, *arrays)
    scratch = [(tuple(shape), dtype) for shape, dtype in impl.scratch(wl)]   # outputs before the result
    assert [(tuple(a.shape), str(a.dtype)) for a in packed] + scratch == params[inputs:-1]
    if impl.op == "dense":  # the quantize_rows before it pads K to what it reads
        assert params[0] == ((wl.batch, impl.in_features_padded(wl)), "int8")


def test_an_implementation_that_lacks_a_method_says_which_it_is():
    grad = registry.get("conv2d_grad_input.nchw.simt")
    with pytest.raises(NotImplementedError, match="conv2d_grad_input.nchw.simt"):
        grad.out_shape(conv_wl(1, 8, 4, 4, 8))
    with pytest.raises(NotImplementedError, match="conv2d_grad_input.nchw.simt"):
        grad.pack_params(conv_wl(1, 8, 4, 4, 8))
    with pytest.raises(NotImplementedError, match="conv2d.nchw4c.cpu reads no quantized input rows"):
        registry.get("conv2d.nchw4c.cpu").in_features_padded(conv_wl(1, 8, 4, 4, 8))


# ---- a model: every conversion the pass inserts, scheduled as before ---------------------------

class _EveryConversion(torch.nn.Module):
    """On sm_90: the model input quantized to NCHW4c for the stem conv (NHWC32 out), a float
    gate by the mean over channels (dequantize, quantize in NHWC32), a tensor-core conv, a conv of a 4x4 map
    that stays on dp4a (a GEMM of one 16-row fragment: relayout to NCHW4c), the classifier's
    flatten (dequantize NCHW4c) and its linear layer (quantize_rows)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.down = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = y * y.mean(1, keepdim=True)   # a [N, 1, H, W] gate: no int8 kernel, stays float
        y = torch.relu(self.down(torch.relu(self.conv(y))))
        return self.fc(torch.flatten(y, 1))


# The schedule list's entries of the conversions, [label, how], as the build reported them when
# ScheduleInt8Kernels found the conversions' schedules by kernel name (the labels are those names).
CONVERSION_SCHEDULES = {
    "llvm": {("quantize_pack", "unscheduled"), ("dequantize_unpack", "unscheduled"), ("quantize_rows", "unscheduled")},
    "sm_75": {("quantize_pack", "default"), ("dequantize_unpack", "dlight"), ("quantize_rows", "dlight")},
    "sm_90": {("quantize_pack", "default"), ("dequantize_unpack_nhwc32", "default"),
              ("quantize_pack_nhwc32", "default"), ("relayout_int8", "dlight"), ("dequantize_unpack", "dlight"),
              ("quantize_rows", "dlight")},
}
MODEL_TARGETS = {"llvm": LLVM, "sm_75": SM75, "sm_90": SM90}


@pytest.fixture(scope="module")
def every_conversion():
    torch.manual_seed(0)
    model = _EveryConversion().eval()
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 8, 8)).astype(np.float32)
    return {name: quantize_module(model, (1, 3, 8, 8), TargetInfo.from_target(target),
                                  config=QuantConfig(unsigned_activations=True), ranges=Calibrate(x), progress=False)
            for name, target in MODEL_TARGETS.items()}


@pytest.mark.parametrize("target", list(MODEL_TARGETS), ids=list(MODEL_TARGETS))
def test_every_kernel_the_pass_emits_is_found_by_the_registry_and_scheduled_as_before(every_conversion, target):
    q = every_conversion[target]
    impls = {gv.name_hint: registry.of_func(f) for gv, f in q.mod.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    assert impls and None not in impls.values()
    sched = ScheduleInt8Kernels(MODEL_TARGETS[target])
    sched(q.mod.clone())  # the pass writes the scheduled kernels into the module it is given
    conversions = {tuple(how) for name, how in sched.applied.items() if impls[name].op in CONVERSION_OPS}
    assert conversions == CONVERSION_SCHEDULES[target]
    if target == "sm_90":
        assert [c.split()[0] for c in q.report["conversions"]] == [
            "quantize", "dequantize", "quantize", "relayout", "dequantize"]


def test_task_extraction_makes_no_task_of_a_conversion(every_conversion):
    tasks = extract_tasks(every_conversion["sm_90"].mod, TargetInfo.from_target(SM90))
    assert tasks and {t.impl.op for t in tasks} == {"conv2d"}
