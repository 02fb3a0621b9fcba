"""Runtime: a built library's files, and running them here or on a remote GPU.

- :mod:`.artifact`: the library's three files (``lib.so``, ``params.npz``, ``meta.json``), staged
  publishing, build ids, unverified libraries
- :mod:`.compiled_model`: :class:`CompiledModel`, a library run through the TVM runtime only
- :mod:`.remote`, :mod:`.remote_model`: TVM RPC (a server or a tracker's servers) and a library
  run there; the server itself is a command, :mod:`tvm_qconv.cli.rpc_server`

The names below are imported on first use (PEP 562): :mod:`.artifact` needs neither torch nor TVM,
and the CLIs read it before they import either.
"""
from ..lazy import lazy_exports

_LAZY = dict.fromkeys(("CompiledModel", "check_arch", "class_scores", "flatten", "summarize"), "compiled_model")

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
