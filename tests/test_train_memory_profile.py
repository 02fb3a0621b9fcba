"""``benchmarks/train_memory.py``'s profile of a step: the kernels by name, and the ops (with
their input shapes) that launched them, which the kernels' names alone do not say."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_the_profile_names_the_op_and_shapes_behind_a_copy_kernel():
    # a transposing copy of a [256, 512] int8 tensor: a generic copy kernel by name, aten::copy_
    # of the two shapes by op
    from benchmarks.train_memory import _profile
    x = torch.randint(-127, 128, (256, 512), dtype=torch.int8, device="cuda")
    prof = _profile(lambda: x.t().contiguous())
    assert prof["gpu_busy_ms"] > 0 and prof["launches"] >= 1
    ops = prof["ops_by_device_time"]
    assert any(r["op"] == "aten::copy_" and "[512, 256]" in r["shapes"] and r["us"] > 0 for r in ops), ops
