"""deploy.py: `tvm-qconv` from the source tree -- build an int8 library, run it, evaluate it,
compare it with baselines, export it as ONNX (`python deploy.py --help`).

The command is tvm_qconv/cli/deploy.py, installed by `pip install` as `tvm-qconv`; this file
keeps `python deploy.py ...` working, and `import deploy` is that module.
"""
import sys

from tvm_qconv.cli import deploy as _command

if __name__ == "__main__":
    sys.exit(_command.main())
# `import deploy` gives the command's module itself, so a test's monkeypatch reaches what main() calls
sys.modules[__name__] = _command
