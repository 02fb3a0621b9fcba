"""The baselines the benchmarks compare against (``benchmarks/cudnn_int8.py``): without what they
need (a CUDA GPU, the optional ``nvidia-cudnn-frontend``) they say so in one line instead of
failing mid-run; a layer cuDNN cannot express is refused by name."""
import pytest

from benchmarks import cudnn_int8
from tests.workloads import conv_wl


def test_cudnn_baseline_says_why_it_cannot_run():
    why = cudnn_int8.missing()
    if why is None:
        pytest.skip("cuDNN's frontend runs here: nothing to refuse")
    assert "no CUDA GPU" in why or "nvidia-cudnn-frontend" in why
    with pytest.raises(SystemExit, match="error: cuDNN int8 cannot run here: "):
        cudnn_int8.main(["--batch", "1"])


def test_cudnn_baseline_refuses_asymmetric_padding():
    # cuDNN's conv descriptor has one padding per spatial axis; checked before any GPU work
    with pytest.raises(ValueError, match=r"symmetric padding only.*\(1, 2, 0, 1\)"):
        cudnn_int8.time_workload(conv_wl(1, 3, 9, 10, 32, stride=(2, 1), padding=(1, 2, 0, 1)))
