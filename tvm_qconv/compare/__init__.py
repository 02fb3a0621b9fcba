"""``deploy.py compare``: the project's int8 library beside PyTorch (fp32, TF32, fp16, bf16, CUDA
graphs, torch.compile), cuDNN's int8 convs, ONNX Runtime and TensorRT on one device
(``run.py``: the order of work; ``baselines.py``: the rows; ``measure.py``: how a row is
measured; ``report.py``: the JSON, table and chart)."""
from .baselines import BASELINE_KEYS

__all__ = ["BASELINE_KEYS", "CompareOptions", "compare"]


def __getattr__(name):
    if name in ("CompareOptions", "compare"):
        from . import run  # on first use: torch and the compiler (~5 s); the CLI's parser needs the row names only
        return getattr(run, name)
    raise AttributeError(f"module 'tvm_qconv.compare' has no attribute {name!r}")
