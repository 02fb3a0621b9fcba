"""benchmarks/elementwise_bandwidth.py: the training path's elementwise kernels at VGG16's shapes,
the bytes each must move, and the table; a dry run on the CPU's llvm builds (the figures come from
a GPU)."""
from __future__ import annotations

import json

from benchmarks import elementwise_bandwidth as bw


def test_the_bytes_each_kind_must_move_at_vgg16s_first_conv():
    shape = (32, 64, 224, 224)
    e = 32 * 64 * 224 * 224                 # 102.8 M elements: 411 MB in float32
    assert bw.bytes_moved("quantize", shape) == 5 * e                   # float in, int8 out
    assert bw.bytes_moved("quantize_grad", shape) == 6 * e + e // 8     # g + bits in, two int8 out
    assert bw.bytes_moved("dequantize", shape) == 8 * e + e // 2        # 64 channels: no NHWC32 padding; range
    assert bw.bytes_moved("relu", shape) == 8 * e + e // 8 + e // 2     # x in; relu(x), bits, range out
    assert bw.bytes_moved("max_pool", shape) == 4 * e + 5 * e // 4
    assert bw.bytes_moved("dequantize", (1, 40, 2, 2)) == 4 * 4 * 64 + 4 * 160 + 80   # 40 -> 64 padded
    # dw's operand: [C_p, H, W, N_p], 3 images and 40 channels padded to 32 and 64
    assert bw.bytes_moved("pack_transposed", (3, 40, 2, 2)) == 3 * 40 * 4 + 64 * 4 * 32


def test_a_vgg16_step_calls_nine_kinds_per_conv_two_per_pool_and_one_or_two_per_weight():
    calls = bw.workloads(2, 64)
    assert len(calls) == 13 * 9 + 5 * 2 + 16 + 15     # flip_transpose: every weight but the first conv's
    assert ("scale_sums", (4096, 512 * 4, 1, 1)) in calls and ("scale_sums", (64, 3, 3, 3)) in calls
    assert ("flip_transpose", (4096, 512 * 4, 1, 1)) in calls and ("flip_transpose", (64, 3, 3, 3)) not in calls
    assert ("max_pool", (2, 64, 64, 64)) in calls and ("quantize", (2, 512, 4, 4)) in calls


def test_a_cpu_dry_run_times_every_call_and_writes_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TVM_QCONV_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert bw.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "1", "--image-size", "32",
                    "--iters", "2"]) == 0
    record = json.loads((tmp_path / "elementwise_bandwidth_b1.json").read_text())
    assert len(record["rows"]) == 13 * 9 + 5 * 2 + 16 + 15 and all(r["ms"] > 0 for r in record["rows"])
    kinds = {s["kind"] for s in bw.by_kind(record)}
    assert kinds == set(bw.KINDS) and record["copy_gb_s"] > 0
    out = capsys.readouterr().out
    assert "|quantize_grad|13|" in out and "% of copy" in out


def test_kinds_picks_the_rows_timed(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_QCONV_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert bw.main(["--out", str(tmp_path), "--device", "cpu", "--batch", "1", "--image-size", "32",
                    "--iters", "1", "--kinds", "pack", "pack_transposed"]) == 0
    record = json.loads((tmp_path / "elementwise_bandwidth_b1.json").read_text())
    assert sorted({r["kind"] for r in record["rows"]}) == ["pack", "pack_transposed"]
    assert len(record["rows"]) == 2 * 13


def test_an_image_size_five_pools_cannot_halve_is_refused(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit):
        bw.main(["--out", str(tmp_path), "--device", "cpu", "--image-size", "48"])
    assert "multiple of 32" in capsys.readouterr().err
