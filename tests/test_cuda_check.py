"""A CUDA build made where TVM has no CUDA runtime (this CPU box, PyPI's TVM) has its CUDA source
compiled by nvcc at build time (``tvm_qconv/cuda_check.py``): issue 56, item 8, where nvcc
rejected DeepLabV3's source only when the user's GPU machine loaded the library, after a build
that said it succeeded.  Through the command line, as the user built it."""
from __future__ import annotations

import json
import shutil
import tempfile

import pytest

import deploy
from tvm_qconv import cuda_check
from tvm_qconv.schedules.tensorcore import pipeline

MODEL = '''
import torch
from torch import nn


def flat_map():
    """A 3x3 conv (padding 1) on a 1-pixel-high map, on the tensor cores: its top and bottom taps
    read padding at every output pixel, the shape of DeepLabV3's ASPP at dilation 36 on 32x32."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 32, (8, 1)), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 5))
'''

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or cuda_check.tvm_compiles_cuda(),
                                reason="nvcc checks the source only where TVM cannot compile CUDA itself and nvcc is here")


@pytest.fixture
def build(tmp_path):
    (tmp_path / "m.py").write_text(MODEL)
    return ["build", "--model", f"{tmp_path / 'm.py'}:flat_map", "--image-size", "16", "--target", "cuda", "--arch",
            "sm_90", "-o", str(tmp_path / "f.so")]


@needs_nvcc
def test_a_cross_compiled_cuda_build_has_its_source_compiled_by_nvcc(build, tmp_path, capsys):
    assert deploy.main(build) == 0
    assert "cuda source: compiled by nvcc for sm_90 in " in capsys.readouterr().out
    record = json.loads((tmp_path / "f.json").read_text())["report"]
    assert record["cuda_source"]["status"] == "compiled by nvcc"
    # the layer that needs the pipeline's fix runs on the tensor cores
    assert [r["kernel"] for r in record["layers"] if r["layer"] == "4"] == ["conv2d.nhwc32.mma"]


@needs_nvcc
def test_source_nvcc_rejects_fails_the_build_where_it_is_made(build, tmp_path, capsys, monkeypatch):
    # without the pass that stores 16-byte int8 constants as words, TVM's codegen prints what nvcc
    # rejects (the bug the user met): the build now ends in an internal failure naming nvcc's error,
    # and writes no library
    monkeypatch.setattr(pipeline, "_EXTRA_PASSES", [p for p in pipeline._EXTRA_PASSES
                                                    if p[1] is not pipeline.printable_int8_vectors])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))     # where the rejected source is kept
    assert deploy.main(build) == 1
    err = capsys.readouterr().err
    assert "nvcc rejects the CUDA source this build generated for sm_90" in err
    assert "too many arguments in function call" in err and "this is a bug of tvm_qconv" in err
    assert not (tmp_path / "f.so").exists()
    kept = list(tmp_path.glob("tvm_qconv-rejected-*.cu"))
    assert len(kept) == 1 and "__global__" in kept[0].read_text() and str(kept[0]) in err
