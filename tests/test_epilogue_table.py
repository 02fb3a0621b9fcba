"""A conv's epilogue ending in a 256-entry table (schedules/epilogue_table.py): each family that
takes one computes, bit for bit, the table kernel applied to the conv's own int8 output, padded
channels 0 as the table kernel writes them; its schedules still apply; and a build fuses a table
into the conv that feeds it alone (tvm_qconv/quantization/epilogues.py)."""
import dataclasses

import numpy as np
import pytest
import torch
import tvm
from tvm_qconv.schedules.requantize import quantize_multiplier
from tvm_qconv.schedules.workload import ConvWorkload

from tvm_qconv import registry
from tvm_qconv.target import TargetInfo, cuda_source, make_target

CPU = tvm.cpu()
W = ConvWorkload.with_activation
# (implementation, workload): odd channel counts (padded output channels), stride, a clamp
CASES = [
    ("conv2d.nhwc32.mma", W("none", batch=2, in_channels=32, height=7, width=9, out_channels=40, kernel=(1, 1),
                            padding=(0, 0, 0, 0))),
    ("conv2d.nhwc32.mma", W("clip", -20, 100, batch=1, in_channels=48, height=9, width=9, out_channels=24,
                            stride=(2, 2))),
    ("conv2d.nhwc32.depthwise", W("none", batch=2, in_channels=40, height=8, width=8, out_channels=40, groups=40)),
    ("conv2d.nhwc32.stem", W("none", batch=2, in_channels=3, height=9, width=9, out_channels=40, stride=(2, 2))),
    ("conv2d.nchw4c.cpu", W("none", batch=1, in_channels=12, height=7, width=7, out_channels=38)),
    ("conv2d.nchw4c.depthwise", W("none", batch=2, in_channels=38, height=9, width=9, out_channels=38, groups=38,
                                  kernel=(5, 5), padding=(2, 2, 2, 2), stride=(2, 2))),
]
IDS = ["mma-1x1-40ch", "mma-3x3-s2-clip", "nhwc32-depthwise", "stem-s2-40ch", "nchw4c-cpu-38ch",
       "nchw4c-depthwise-5x5-s2"]


def _args(impl, wl, seed):
    """The kernel's int8 input, packed weight, bias, multiplier and shift, and a random table."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (wl.batch, wl.in_channels, wl.height, wl.width)).astype(np.int8)
    w = rng.integers(-127, 128, (wl.out_channels, wl.group_in, *wl.kernel)).astype(np.int8)
    b = rng.integers(-3000, 3000, wl.out_channels).astype(np.int32)
    # multipliers that bring a sum of K random products (spread ~ sqrt(K) * 74 * 73) to ~50: the
    # requantized outputs spread over the int8 range, so the table is read at many entries
    k = wl.group_in * wl.kernel[0] * wl.kernel[1]
    m, s = quantize_multiplier(rng.uniform(0.5, 1.5, wl.out_channels) * 50 / (np.sqrt(k) * 74 * 73))
    table = rng.integers(-128, 128, 256).astype(np.int8)
    return [registry.layout(impl.input_layout()).pack(x), *impl.pack_params(wl, w, b, m, s)], table


def _run(func, args, shape):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.full(shape, 77, np.int8), CPU)
    lib["main"](*[tvm.runtime.tensor(a, CPU) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("name,wl", CASES, ids=IDS)
def test_a_table_epilogue_is_the_table_kernel_on_the_convs_output(name, wl):
    impl = registry.get(name)
    fused = dataclasses.replace(wl, table=True)
    args, table = _args(impl, wl, seed=len(name))
    plain = impl.reference(wl, *args)
    lut = registry.get(f"lut.{impl.layout.lower()}")
    n, h, w = wl.batch, wl.out_height, wl.out_width
    from tvm_qconv.schedules.workload import LutWorkload
    want = lut.reference(LutWorkload((n, h, w), wl.out_channels), plain, table)
    assert len(np.unique(plain)) > 60        # the table is read at many entries, not a few
    np.testing.assert_array_equal(impl.reference(fused, *args, table), want)
    # the compute definition itself (its table argument before the output), run on the CPU
    np.testing.assert_array_equal(_run(impl.compute(fused), args + [table], want.shape), want)


@pytest.mark.parametrize("name,wl", CASES, ids=IDS)
def test_a_table_epilogue_keeps_the_unfused_kernel_and_its_schedules(name, wl):
    """Without a table the kernel is what it was (its tuning records still match: the workload
    leaves ``table`` out of its record); with one, the family's own schedule still applies."""
    impl = registry.get(name)
    fused = dataclasses.replace(wl, table=True)
    assert "table" not in wl.to_dict() and fused.to_dict()["table"] is True
    assert ConvWorkload.from_dict(fused.to_dict()) == fused
    assert len(impl.compute(fused).params) == len(impl.compute(wl).params) + 1
    if impl.layout == "NCHW4c":   # the CPU schedule (these two families' llvm kernels), run
        lib = registry.compile_kernel(impl, fused, make_target("llvm"))
        args, table = _args(impl, wl, seed=1)
        out = tvm.runtime.tensor(np.full(impl.out_shape(wl), 77, np.int8), CPU)
        lib["main"](*[tvm.runtime.tensor(a, CPU) for a in args + [table]], out)
        np.testing.assert_array_equal(out.numpy(), impl.reference(fused, *args, table))
    else:                         # the CUDA schedule: built, and the table read in the kernel
        target = make_target("cuda", "sm_90a")
        with target:
            src = cuda_source(registry.compile_kernel(impl, fused, target))
        assert "Table_ptr[" in src, src


@pytest.mark.parametrize("name", ["conv2d.nchw4c.dp4a", "conv2d.nchw4c.depthwise"])
def test_the_nchw4c_cuda_schedules_take_a_table_epilogue(name):
    # the dp4a family's default schedule and the NCHW4c depthwise's CUDA one (GPUs without int8 tensor cores)
    wl = W("none", batch=4, in_channels=24, height=14, width=14, out_channels=24 if "depthwise" in name else 40,
           groups=24 if "depthwise" in name else 1, table=True)
    target = make_target("cuda", "sm_75")
    with target:
        assert "Table_ptr[" in cuda_source(registry.compile_kernel(registry.get(name), wl, target))


def test_only_implementations_that_take_a_table_are_offered_one():
    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    # ResNeXt's grouped conv: the NHWC32 grouped kernels (dp4a, mma.sync) have no table epilogue
    wl = W("relu", batch=64, in_channels=128, height=28, width=28, out_channels=128, groups=32)
    plain = {impl.name for impl in registry.candidates("conv2d", wl, sm90)}
    fused = {impl.name for impl in registry.candidates("conv2d", dataclasses.replace(wl, table=True), sm90)}
    assert plain == {"conv2d.nhwc32.grouped", "conv2d.nhwc32.grouped_mma", "conv2d.nchw4c.dp4a"}
    assert fused == {"conv2d.nchw4c.dp4a"}
    assert {impl.name for impl in registry.IMPLEMENTATIONS if impl.takes_table} == {
        "conv2d.nhwc32.mma", "conv2d.nhwc32.wgmma", "conv2d.nhwc32.stem", "conv2d.nhwc32.depthwise",
        "conv2d.nchw4c.depthwise", "conv2d.nchw4c.dp4a", "conv2d.nchw4c.cpu"}
    with pytest.raises(ValueError, match="table epilogue"):
        dataclasses.replace(wl, out_dtype="int32", table=True)


# the GPU kernels of the families that take a table, at EfficientNet-B0's shapes: the wgmma and
# mma.sync pointwise convs (240 channels: padded output words), a depthwise conv, the stem
GPU_CASES = [
    ("conv2d.nhwc32.wgmma", W("none", batch=64, in_channels=40, height=28, width=28, out_channels=240,
                              kernel=(1, 1), padding=(0, 0, 0, 0))),
    ("conv2d.nhwc32.mma", W("none", batch=1, in_channels=40, height=28, width=28, out_channels=240,
                            kernel=(1, 1), padding=(0, 0, 0, 0))),
    ("conv2d.nhwc32.depthwise", W("none", batch=64, in_channels=240, height=28, width=28, out_channels=240,
                                  groups=240, kernel=(5, 5), padding=(2, 2, 2, 2), stride=(2, 2))),
    ("conv2d.nhwc32.stem", W("none", batch=64, in_channels=3, height=224, width=224, out_channels=32,
                             stride=(2, 2))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,wl", GPU_CASES, ids=["wgmma-b64", "mma-b1", "depthwise-b64", "stem-b64"])
def test_a_table_epilogue_on_gpu_is_bit_exact(name, wl):
    from tvm_qconv.target import device_arch
    impl = registry.get(name)
    fused = dataclasses.replace(wl, table=True)
    target = make_target("cuda", device_arch(full=True))
    if not impl.applies(fused, TargetInfo.from_target(target)):
        pytest.skip(f"{name} does not run on this GPU")
    args, table = _args(impl, wl, seed=5)
    want = impl.reference(fused, *args, table)
    lib = registry.compile_kernel(impl, fused, target)
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full(want.shape, 77, np.int8), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in args + [table]], out)
    np.testing.assert_array_equal(out.numpy(), want)


class _TablesAfterConvs(torch.nn.Module):
    """SiLU after a conv and after a depthwise conv, hardswish after a conv, and a conv whose output
    two layers read (its table stays a kernel: the max pool needs the conv's own integers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = torch.nn.Conv2d(16, 24, 1)
        self.shared = torch.nn.Conv2d(24, 24, 1)
        self.head = torch.nn.Linear(24, 10)

    def forward(self, x):
        x = torch.nn.functional.silu(self.stem(x))
        x = torch.nn.functional.silu(self.dw(x))
        x = torch.nn.functional.hardswish(self.pw(x))
        y = self.shared(x)
        x = torch.nn.functional.silu(y) + torch.nn.functional.max_pool2d(y, 3, 1, 1)
        return self.head(x.mean((2, 3)))


def fused_and_exposed_builds(model, tmp_path) -> tuple[dict, dict]:
    """``({exposed: outputs}, {exposed: report})`` of two llvm builds of ``model`` on the same ranges:
    the library (epilogues fused) and the one that exposes every layer's activations (no fusion)."""
    from tvm_qconv.build import BuildOptions, compile_model
    from tvm_qconv.config import QuantConfig
    from tvm_qconv.ranges import Calibrate
    from tvm_qconv.runtime import CompiledModel
    x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
    outs, reports = {}, {}
    for expose in (False, True):
        lib = compile_model(model.eval(), str(tmp_path / f"{expose}.so"), config=QuantConfig(num_calib_images=4),
                            options=BuildOptions(target="llvm", batch=4, image_size=16, expose_activations=expose,
                                                 verify=False),
                            ranges=Calibrate(x), progress=False)
        outs[expose], reports[expose] = CompiledModel(lib.lib_path).outputs(x), lib.report
    return outs, reports


def test_a_build_runs_tables_in_their_convs_epilogues_and_computes_the_same_integers(tmp_path):
    outs, reports = fused_and_exposed_builds(_TablesAfterConvs(), tmp_path)
    np.testing.assert_array_equal(outs[False][0], outs[True][0])     # the same integers, the same logits
    rows = {r["layer"]: r for r in reports[False]["layers"]}
    fused = {r["layer"]: r["kernel"] for r in reports[False]["layers"] if r["kernel"].startswith("in ")}
    assert len(fused) == 3, rows                                      # stem, dw, pw; not the shared conv's
    assert all(rows[conv.removeprefix("in ").removesuffix("'s epilogue")]["kind"].endswith("+table")
               for conv in fused.values())
    assert not any(r["kernel"].startswith("in ") for r in reports[True]["layers"])
    assert sum(r["kind"] == "lut" for r in reports[False]["layers"]) == 4   # every table is still an int8 layer


def test_a_wgmma_record_of_the_plain_conv_builds_the_kernel_with_its_table():
    """A database tuned before tables were fused holds the plain conv's wgmma tile: the fused layer
    takes it (tuning/apply.tuning_twin) and gets its own kernel, table included; a task tuned on the
    fused compute replays to the same kernel."""
    import tvm_ffi
    from tvm_qconv.schedules.kernel import tirx_kernel
    from tvm_qconv.schedules.wgmma import conv2d as wgmma_conv2d
    from tvm_qconv.schedules.wgmma import space

    from tvm_qconv.tuning import task_func
    from tvm_qconv.tuning.apply import tuning_twin
    impl, target = registry.get("conv2d.nhwc32.wgmma"), make_target("cuda", "sm_90a")
    fused = W("none", batch=64, in_channels=40, height=28, width=28, out_channels=240, kernel=(1, 1),
              padding=(0, 0, 0, 0), table=True)
    plain = tuning_twin(fused)
    num_sm = TargetInfo.from_target(target).num_sm
    for tuned_on in (plain, fused):
        sch = tvm.s_tir.Schedule(task_func(impl.compute(tuned_on)))
        impl.trace_point(sch, tuned_on, 1)
        kernel = impl.tuned(sch.mod["main"], impl.compute(fused), target)
        config = space.candidate_configs(plain)[1]
        want = tirx_kernel(impl.compute(fused), wgmma_conv2d.conv2d_wgmma(fused, config, num_sm))
        assert tvm_ffi.structural_equal(kernel, want) and len(kernel.params) == 7
