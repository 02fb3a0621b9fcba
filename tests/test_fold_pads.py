"""transform/fold_pads.py: a zero pad read only by a conv becomes the conv's padding; a pad anything
else reads too (a concat, through its tuple) stays.  Checked against torch on llvm."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from torch import nn

from tvm_qconv.frontend import ExportedModel


class _Padded(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, stride=2), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        p = nn.functional.pad(x, (0, 1, 0, 1))      # TF's "same" for a stride-2 3x3: one more row and column
        y = self.c2(self.c1(p))
        return torch.cat([y.flatten(1), p.flatten(1)], 1) if self.shared else y


@pytest.mark.parametrize("shared", [False, True], ids=["conv_only", "also_in_a_concat"])
def test_a_zero_pad_folds_into_the_conv_that_alone_reads_it(shared):
    torch.manual_seed(0)
    model = _Padded(shared).eval()
    mod = ExportedModel(model, (1, 3, 16, 16)).at(1).mod
    script = mod["main"].script()
    assert ("R.nn.pad(" in script) == shared       # folded only where the conv is its one reader
    if not shared:
        assert "padding=[0, 0, 1, 1]" in script    # (top, left, bottom, right)
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    vm = tvm.relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x))[0].numpy()
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)   # float32 convs in two libraries
