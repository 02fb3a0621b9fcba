"""tune.py: `tvm-qconv-tune` from the source tree -- MetaSchedule-tune a model's int8 kernels
(`python tune.py --help`).

The command is tvm_qconv/cli/tune.py, installed by `pip install` as `tvm-qconv-tune`; this
file keeps `python tune.py ...` working, and `import tune` is that module.
"""
import sys

from tvm_qconv.cli import tune as _command

if __name__ == "__main__":
    sys.exit(_command.main())
# `import tune` gives the command's module itself, so a test's monkeypatch reaches what main() calls
sys.modules[__name__] = _command
