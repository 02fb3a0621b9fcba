"""The module paths that moved (issue 57 gave the package one folder per role), still importable.

``import tvm_qconv.calibrate`` (or ``from tvm_qconv.observers import ...``, or ``python -m
tvm_qconv.rpc_server``) gives the module at its new path -- the same module object, so a
monkeypatch or an ``isinstance`` through either name sees the other -- with a DeprecationWarning
naming the new path.  One table instead of a stub file per old name, so the package's top shows
its roles.  Installed by ``tvm_qconv/__init__.py``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "tvm_qconv.calibrate": "tvm_qconv.ranges.calibrate",
    "tvm_qconv.observers": "tvm_qconv.ranges.observers",
    "tvm_qconv.range_search": "tvm_qconv.ranges.search",
    "tvm_qconv.weight_rounding": "tvm_qconv.ranges.weight_rounding",
    "tvm_qconv.artifact": "tvm_qconv.runtime.artifact",
    "tvm_qconv.remote": "tvm_qconv.runtime.remote",
    "tvm_qconv.remote_model": "tvm_qconv.runtime.remote_model",
    "tvm_qconv.rpc_server": "tvm_qconv.cli.rpc_server",
    "tvm_qconv.quantize": "tvm_qconv.int8_module",
    "tvm_qconv.onnx_import": "tvm_qconv.frontend.onnx_model",
    "tvm_qconv.onnx_qdq": "tvm_qconv.frontend.onnx_qdq",
}
# `tvm_qconv.ranges` and `tvm_qconv.runtime` became packages that re-export their old public names.


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name; loading it returns the module at the new one."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__       # the import system overwrites it with the old name's
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec       # already executed under its new name: only undo the overwrite

    def get_code(self, name):
        """``python -m <old name>``: runs the new module as ``__main__``, under its own package (its
        relative imports resolve there, not at the old name's)."""
        return compile(f"import runpy\nrunpy.run_module({MOVED[name]!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{name} moved to {MOVED[name]}>", "exec")


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
