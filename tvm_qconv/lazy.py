"""Names a package exports, imported from their modules on first use (PEP 562): a package's
``__init__`` stays light (no torch, no TVM) until one of them is read."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` for ``package`` whose names ``table`` maps to their submodule
    (relative to it); a name read once is kept in ``namespace`` (the package's globals)."""
    def __getattr__(name):
        if name in table:
            value = getattr(importlib.import_module(f".{table[name]}", package), name)
            namespace[name] = value     # later reads are plain attribute reads
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
