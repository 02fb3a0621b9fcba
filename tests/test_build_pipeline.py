"""The build pipeline (``tvm_qconv/pipeline.py``), step by step: each step makes what the next one
reads, the steps run one at a time give the library ``compile_model`` builds (every logit bit for
bit), the IR dumps are named after the steps, and the ONNX export stops before the Relax lowering."""
import os

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax

from tvm_qconv import pipeline
from tvm_qconv.build import BuildOptions, compile_model
from tvm_qconv.data import skimage_photos
from tvm_qconv.frontend import Frontend
from tvm_qconv.onnx_export import export_onnx
from tvm_qconv.pipeline import STEP_NAMES, STEPS, BuildState
from tvm_qconv.ranges import Calibrate
from tvm_qconv.relax_utils import bindings_of
from tvm_qconv.runtime import CompiledModel
from tvm_qconv.target import TargetInfo, make_target

SIZE = 16


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10)).eval()


def _ops(mod) -> list[str]:
    """The Relax operators ``main`` calls, in order (``call_tir`` as the kernel it calls)."""
    out = []
    for b in bindings_of(mod["main"]):
        v = b.value
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.call_tir":
            out.append(v.args[0].name_hint)
        elif isinstance(v, relax.Call):
            out.append(getattr(v.op, "name", "?"))
    return out


def _state(photos, **kwargs) -> BuildState:
    llvm = make_target("llvm")
    return BuildState(_net(), (1, 3, SIZE, SIZE), TargetInfo.from_target(llvm), ranges=Calibrate(photos),
                      target=llvm, name="net", check_input=True, verify=True, **kwargs)


def test_the_steps_are_the_issue_list_in_order():
    assert STEP_NAMES == ("prepare", "export", "simplify", "analyze", "ranges", "equalize", "weight_rounding", "plan",
                          "fuse", "lower", "lift", "apply_tuning", "schedule", "compile", "verify")
    assert [s.__name__ for s in STEPS] == list(STEP_NAMES)


def test_each_step_makes_what_the_next_reads_and_the_steps_one_by_one_are_compile_model(tmp_path):
    photos = skimage_photos(SIZE)
    s = _state(photos)
    made = {}
    for name in STEP_NAMES:
        pipeline.run(s, start=name, until=name)
        made[name] = s.mod
        if name == "prepare":
            assert isinstance(s.model, Frontend) and s.probe.output == "a tensor (1, 10)"
        elif name == "export":
            assert "relax.nn.batch_norm" in _ops(s.mod)            # as imported
        elif name == "simplify":
            assert "relax.nn.batch_norm" not in _ops(s.mod)        # folded into the conv
            assert _ops(s.mod).count("relax.nn.conv2d") == 2
        elif name == "analyze":
            assert [ly.name for ly in s.graph.layers if ly.kind in ("conv2d", "dense")] == ["0", "4", "8"]
        elif name == "ranges":
            assert s.amax and all(v > 0 for v in s.amax.values())       # a range for every point
            assert s.ranges_report["source"].startswith("calibration")
        elif name == "equalize":
            assert s.context.equalization is None and s.mod is made["analyze"]  # off by default: nothing to do
        elif name == "weight_rounding":
            assert s.rounding is None and s.mod is made["analyze"]  # nearest: nothing to do
        elif name == "plan":
            assert [lp.int8 for lp in s.plan.layers if lp.layer.kind in ("conv2d", "dense")] == [True] * 3
        elif name == "fuse":
            assert len(s.lowered.layers) <= len(s.plan.layers)
        elif name == "lower":
            kernels = [k for k in _ops(s.mod) if k.startswith(("conv2d", "dense"))]
            assert len(kernels) == 3                                   # one int8 kernel per conv / linear
            assert s.report["layers"] == [lp.row for lp in s.lowered.layers]
        elif name == "lift":
            assert s.params and len(s.mod["main"].params) == 1 + len(s.params)
        elif name == "apply_tuning":
            assert s.mod is made["lift"] and s.tuned == {}            # no tuning database
        elif name == "schedule":
            assert s.applied                                           # every kernel got a schedule
        elif name == "compile":
            assert s.executable is not None
        elif name == "verify":
            assert s.report["verify"]["status"] == "ok"
    lib = tmp_path / "net.so"
    compile_model(_net(), str(lib), options=BuildOptions(image_size=SIZE), ranges=Calibrate(photos), name="net",
                  progress=False)
    x = photos[:2]
    want = np.concatenate([CompiledModel(str(lib))(x[i:i + 1]) for i in range(len(x))])
    vm = relax.VirtualMachine(s.executable, tvm.cpu())
    params = [tvm.runtime.tensor(v) for _, v in s.params]
    got = np.concatenate([vm["main"](tvm.runtime.tensor(x[i:i + 1]), *params)[0].numpy() for i in range(len(x))])
    assert got.tobytes() == want.tobytes()                             # every bit of every logit


def test_the_ir_dumps_are_named_after_the_steps(tmp_path):
    compile_model(_net(), str(tmp_path / "net.so"), options=BuildOptions(image_size=SIZE, debug_dump=str(tmp_path / "ir"),
                  verify=False), ranges=Calibrate(skimage_photos(SIZE)), progress=False)
    assert sorted(os.listdir(tmp_path / "ir")) == ["02_export.py", "03_simplify.py", "10_lower.py", "11_lift.py",
                                                   "13_schedule.py"]


def test_the_onnx_export_stops_before_the_relax_lowering(tmp_path, monkeypatch):
    def no(step):
        def refuse(s):
            raise AssertionError(f"export_onnx ran {step}")
        return refuse
    for step in ("fuse", "lower", "lift", "compile"):
        monkeypatch.setattr(pipeline, step, no(step))
    monkeypatch.setattr(pipeline, "STEPS", tuple(getattr(pipeline, n) for n in STEP_NAMES))
    res = export_onnx(_net(), str(tmp_path / "net.onnx"), input_shape=(1, 3, SIZE, SIZE),
                      ranges=Calibrate(skimage_photos(SIZE)), progress=False)
    assert os.path.getsize(res.path) > 0
