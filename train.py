"""train.py: `tvm-qconv-train` from the source tree -- train a VGG on scikit-learn's digits, float
or int8 quantization-aware (`python train.py --help`).

The command is tvm_qconv/cli/train.py, installed by `pip install` as `tvm-qconv-train`; this
file keeps `python train.py ...` working, and `import train` is that module.
"""
import sys

from tvm_qconv.cli import train as _command

if __name__ == "__main__":
    sys.exit(_command.main())
# `import train` gives the command's module itself, so a test's monkeypatch reaches what main() calls
sys.modules[__name__] = _command
