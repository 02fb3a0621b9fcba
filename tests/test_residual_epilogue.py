"""A conv's epilogue ending in the residual add after it (schedules/epilogue_residual.py): each
family that takes one computes, bit for bit, the add kernel applied to the conv's own int8 output
and the other addend, padded channels included; its schedules still apply; and a build fuses an
add into the conv that feeds it alone (tvm_qconv/quantization/residuals.py), computing the same
integers as the unfused build."""
import dataclasses

import numpy as np
import pytest
import torch
import tvm

from tests.test_epilogue_table import CASES as TABLE_CASES
from tests.test_epilogue_table import _args, _run, fused_and_exposed_builds
from tests.test_kernels import _on_gpu
from tvm_qconv import registry
from tvm_qconv.schedules.add_int8 import add_int8
from tvm_qconv.schedules.epilogue_residual import add_params
from tvm_qconv.schedules.requantize import add_multipliers
from tvm_qconv.schedules.workload import ConvWorkload
from tvm_qconv.target import TargetInfo, cuda_source, make_target

W = ConvWorkload.with_activation
# (implementation, workload): the table epilogue's cases of the families that take a residual (odd
# channel counts: padded output channels; stride; a clamp on the conv), and a dp4a 1 x 1 conv
CASES = [(name, wl) for name, wl in TABLE_CASES if registry.get(name).takes_residual] + [
    ("conv2d.nchw4c.dp4a", W("none", batch=2, in_channels=16, height=6, width=6, out_channels=20, kernel=(1, 1),
                             padding=(0, 0, 0, 0)))]
IDS = ["mma-1x1-40ch", "mma-3x3-s2-clip", "nchw4c-cpu-38ch", "nchw4c-dp4a-1x1-20ch"]
# the add's (zero of the conv's output, of the residual, of the sum, clamp): symmetric, an
# unsigned residual and sum (a ReLU block's input and output), a ReLU after the add
RESIDUALS = [(0, 0, 0, -127, 127), (0, -128, -128, -128, 127), (0, 0, 0, 0, 127)]
RESIDUAL_IDS = ["symmetric", "unsigned", "relu"]


def _fused_args(impl, wl, residual, seed):
    """(plain conv's arguments, the fused kernel's arguments, the add's multipliers and shift)."""
    args, _ = _args(impl, wl, seed)
    other = np.random.default_rng(seed + 1).integers(-128, 128, impl.out_shape(wl)).astype(np.int8)
    add = add_multipliers(0.021, 0.034, 0.043)     # scales of the conv's output, the residual, the sum
    return args, [args[0], other, *args[1:], add_params(*add)], add


@pytest.mark.parametrize("residual", RESIDUALS, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("name,wl", CASES, ids=IDS)
def test_a_residual_epilogue_is_the_add_kernel_on_the_convs_output(name, wl, residual):
    impl = registry.get(name)
    fused = dataclasses.replace(wl, residual=residual)
    args, fused_args, (m_c, m_r, shift) = _fused_args(impl, wl, residual, seed=len(name))
    shape = impl.out_shape(wl)
    conv = _run(impl.compute(wl), args, shape)
    # the unfused pair: the add kernel (its 32-bit form where exact) on the conv kernel's output
    unfused = _run(add_int8(shape, m_c, m_r, shift, residual[3], residual[4], zeros=residual[:3]),
                   [conv, fused_args[1]], shape)
    want = impl.reference(fused, *fused_args)
    assert len(np.unique(want)) > 100 or residual[3] == 0     # the sums spread over the int8 range
    np.testing.assert_array_equal(want, unfused)
    np.testing.assert_array_equal(_run(impl.compute(fused), fused_args, shape), want)


def test_the_schedules_take_a_residual_epilogue():
    # the mma.sync template and the dp4a schedule build it for CUDA (the other addend read where
    # the output is stored); the CPU schedule runs it bit-exact
    wl = W("none", batch=1, in_channels=384, height=14, width=14, out_channels=96, kernel=(1, 1),
           padding=(0, 0, 0, 0), residual=RESIDUALS[0])
    target = make_target("cuda", "sm_90a")
    for name in ("conv2d.nhwc32.mma", "conv2d.nchw4c.dp4a"):
        with target:
            src = cuda_source(registry.compile_kernel(registry.get(name), wl, target))
        assert "Residual_ptr[" in src and "AddParams_ptr[" in src, name
    impl, wl = registry.get("conv2d.nchw4c.cpu"), dataclasses.replace(CASES[2][1], residual=RESIDUALS[1])
    _, args, _ = _fused_args(impl, dataclasses.replace(wl, residual=()), wl.residual, seed=3)
    lib = registry.compile_kernel(impl, wl, make_target("llvm"))
    out = tvm.runtime.tensor(np.full(impl.out_shape(wl), 77, np.int8), tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args], out)
    np.testing.assert_array_equal(out.numpy(), impl.reference(wl, *args))



def test_only_implementations_that_take_a_residual_are_offered_one():
    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    wl = W("none", batch=64, in_channels=64, height=56, width=56, out_channels=256, kernel=(1, 1),
           padding=(0, 0, 0, 0))
    fused = dataclasses.replace(wl, residual=RESIDUALS[0])
    # wgmma's fused epilogue was measured slower than its plain kernel plus the add kernel (H200,
    # docs/performance.md), so it takes no residual: the add stays a kernel after it
    assert {i.name for i in registry.candidates("conv2d", fused, sm90)} == {"conv2d.nhwc32.mma", "conv2d.nchw4c.dp4a"}
    assert "conv2d.nhwc32.wgmma" in {i.name for i in registry.candidates("conv2d", wl, sm90)}
    assert {impl.name for impl in registry.IMPLEMENTATIONS if impl.takes_residual} == {
        "conv2d.nhwc32.mma", "conv2d.nchw4c.dp4a", "conv2d.nchw4c.cpu"}
    assert fused.describe().endswith("+add") and ConvWorkload.from_dict(fused.to_dict()) == fused
    assert "residual" not in wl.to_dict()     # a kernel without one is recorded as before
    with pytest.raises(ValueError, match="without a table"):
        dataclasses.replace(fused, table=True)
    with pytest.raises(ValueError, match="zero points"):
        dataclasses.replace(wl, residual=(0, 5, 0, -127, 127))


def test_a_tuning_record_of_the_plain_conv_serves_the_conv_with_its_residual():
    from tvm_qconv.tuning.apply import tuning_twin
    wl = W("none", batch=64, in_channels=64, height=56, width=56, out_channels=256, kernel=(1, 1),
           padding=(0, 0, 0, 0))
    assert tuning_twin(dataclasses.replace(wl, residual=RESIDUALS[1])) == wl
    assert tuning_twin(wl) is None


class _ResidualBlocks(torch.nn.Module):
    """An identity block (its add and ReLU fused into the second conv), a block whose two convs
    both feed the add (fused into the first, which then runs after the second), a conv whose
    output two layers read (its add stays a kernel), and a conv's output added to itself (no
    other addend: a kernel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.a = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 16, 1)
        self.c = torch.nn.Conv2d(16, 24, 3, padding=1, stride=2)
        self.d = torch.nn.Conv2d(16, 24, 1, stride=2)
        self.e = torch.nn.Conv2d(24, 24, 1)
        self.f = torch.nn.Conv2d(24, 24, 1)
        self.head = torch.nn.Linear(24, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.b(torch.relu(self.a(x))) + x)
        y = self.c(x) + self.d(x)
        z = self.e(y)
        y = torch.relu(z + y) + torch.nn.functional.max_pool2d(z, 3, 1, 1)
        w = self.f(y)
        return self.head((w + w).mean((2, 3)))


def test_a_build_runs_residual_adds_in_their_convs_epilogues_and_computes_the_same_integers(tmp_path):
    outs, reports = fused_and_exposed_builds(_ResidualBlocks(), tmp_path)   # exposed: every add a kernel
    np.testing.assert_array_equal(outs[False][0], outs[True][0])     # the same integers, the same logits
    rows = {r["layer"]: r for r in reports[False]["layers"]}
    fused = {r["layer"]: r["kernel"] for r in reports[False]["layers"] if r["kernel"].startswith("in ")}
    assert fused == {"add_0": "in b's epilogue", "add_1": "in c's epilogue"}, rows
    # b's ReLU on an unsigned output (the default scheme) is the clamp at its zero point, -128
    assert rows["b"]["kind"] == "conv2d+bias+add+clip[-128,127]" and rows["c"]["kind"] == "conv2d+bias+add"
    assert rows["add_2"]["kernel"] == rows["add_3"]["kernel"] == "add.nchw4c"     # e's output is read twice
    assert rows["add_4"]["kernel"] == "add.nchw4c"                                 # f's output plus itself
    assert not any(r["kernel"].startswith("in ") for r in reports[True]["layers"])


# ConvNeXt-T's second pointwise conv at batch 1 and ResNet-50's third conv at batch 64 (an
# unsigned residual and sum, a ReLU after the add)
GPU_CASES = [
    (W("none", batch=1, in_channels=384, height=14, width=14, out_channels=96, kernel=(1, 1), padding=(0, 0, 0, 0)),
     RESIDUALS[0]),
    (W("none", batch=64, in_channels=64, height=56, width=56, out_channels=256, kernel=(1, 1), padding=(0, 0, 0, 0)),
     RESIDUALS[1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["conv2d.nhwc32.mma", "conv2d.nchw4c.dp4a"], ids=["mma", "dp4a"])
@pytest.mark.parametrize("wl,residual", GPU_CASES, ids=["convnext-b1", "resnet50-b64-unsigned"])
def test_a_residual_epilogue_on_gpu_is_bit_exact(name, wl, residual):
    impl = registry.get(name)
    fused = dataclasses.replace(wl, residual=residual)
    _, args, _ = _fused_args(impl, wl, residual, seed=7)
    want = impl.reference(fused, *args)
    np.testing.assert_array_equal(_on_gpu(impl, fused, args, want.shape), want)


def test_tuning_tasks_of_a_fused_build_are_the_plain_convs_every_family_can_run():
    # the tuner measures a conv with an add in its epilogue as the plain conv, wgmma included (the
    # records serve the fused kernel through tuning_twin), not as a kernel only mma and dp4a run
    from tvm_qconv.int8_module import quantize_module
    from tvm_qconv.ranges import Calibrate
    from tvm_qconv.tuning.tasks import extract_tasks
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.conv = torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 1)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            return self.conv(x) + x

    sm90 = TargetInfo.from_target(make_target("cuda", "sm_90a"))
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    q = quantize_module(Block().eval(), (2, 3, 16, 16), sm90, ranges=Calibrate(x), progress=False)
    assert [r["kernel"] for r in q.report["layers"]][1:] == ["conv2d.nhwc32.mma", "in conv's epilogue"]
    tasks = extract_tasks(q.mod, sm90)
    assert not any(t.workload.residual for t in tasks)
    assert {t.impl.family for t in tasks} == {"mma", "wgmma", "dp4a"}
