"""The command-line programs, each a ``main(argv=None) -> int`` that parses its flags and makes
its calls into the library (pyproject.toml's ``[project.scripts]`` installs them):

- ``tvm-qconv`` (``python deploy.py`` in the source tree), :mod:`.deploy`: build, run, eval,
  compare, export-onnx, accept, rpc
- ``tvm-qconv-tune`` (``python tune.py``), :mod:`.tune`: MetaSchedule tuning, and the training
  convs' tiles (``--training``)
- ``tvm-qconv-train`` (``python train.py``), :mod:`.train`: float or int8 QAT training on digits
- ``tvm-qconv-rpc-server`` (``python -m tvm_qconv.cli.rpc_server``), :mod:`.rpc_server`: TVM's RPC
  server for the GPU machine (``deploy.py rpc`` and ``tune.py --rpc-*`` reach it)

deploy.py, tune.py and train.py at the repository root are shims that run these ``main``
functions, so every documented ``python deploy.py ...`` line keeps working; imported (``import
deploy``), a shim is its command's module.

A command's module holds its flags, the checks that need neither torch nor TVM, and its dispatch,
so that ``--help`` and a bad flag answer at once; the work itself is in a sibling that imports
torch and TVM at its top (:mod:`.deploy_commands`, :mod:`.tune_commands`), loaded by the one
import inside a function of each once the arguments are valid.  (:mod:`.train` needs torch for
its flags' defaults, so it imports everything at its top.)

How every CLI ends (:mod:`.exits`, re-exported here: ``cli.run``, ``cli.DEBUG_ENV``, ...): one
line on stderr and an exit code, never a traceback.
"""
from .exits import (DEBUG_ENV, DEPENDENCY_WARNINGS, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED,
                    EXIT_TARGET_MISSED, EXIT_UNVERIFIED, THREAD_ENVS, check_thread_count, debug, first_line,
                    quiet_dependency_warnings, run, usable_cores)

__all__ = ["DEBUG_ENV", "DEPENDENCY_WARNINGS", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED",
           "EXIT_TARGET_MISSED", "EXIT_UNVERIFIED",
           "THREAD_ENVS", "check_thread_count", "debug", "first_line", "quiet_dependency_warnings", "run",
           "usable_cores"]
