"""TVMScript's ``T.prim_func`` without its ``inspect.stack()`` cost.

Every call of ``T.prim_func`` -- a decorated kernel generator (the wgmma conv), a written-out kernel
parsed from source (``kernel.parse_written_kernel``: there the parser evaluates the decorator only for
its dispatch token), TVM's tensor-intrinsic files at import -- takes ``inspect.stack()``, which reads
each frame's source line through ``inspect.findsource``.  That calls ``inspect.getmodule``, which for a
frame of no module file (the import machinery's, the parser's evaluated code) scans all of
``sys.modules``: thousands under torch.  DenseNet-121's batch-64 build spent 68 of its 230 s there
(cProfile, the 2-core CPU box, 2026-11-28): ~0.1 s for each of 719 calls.

What TVM does with the frames (``tvm/tirx/script/parser/entry.py``): ``resolve_closure_vars`` reads
their ``f_locals``; ``is_defined_in_class`` reads the source line of the third frame (a decorator
inside an ``@I.ir_module`` class).  :func:`install` gives that module an ``inspect`` whose ``stack``
takes the frames without context and reads each one's line from ``linecache`` (no module scan):
the same frames and lines for every file on disk.
"""
from __future__ import annotations

import inspect
import linecache
import types


def stack_with_cached_lines(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` as TVM's parser uses it: the caller's frames outward, each with its
    own source line (``context`` is accepted and ignored: one line, the only one TVM reads)."""
    frames = inspect.stack(0)[1:]       # from the caller of this function, as inspect.stack's own
    return [inspect.FrameInfo(f.frame, f.filename, f.lineno, f.function,
                              [linecache.getline(f.filename, f.lineno or 0, f.frame.f_globals)], 0)   # no line: ''
            for f in frames]


def install() -> None:
    """Point ``tvm.tirx.script.parser.entry`` (the ``T.prim_func`` decorator's module) at an
    ``inspect`` whose ``stack`` is :func:`stack_with_cached_lines`; everything else of ``inspect`` as
    it is.  Idempotent; nothing outside that module changes."""
    from tvm.tirx.script.parser import entry
    if getattr(entry.inspect, "stack", None) is stack_with_cached_lines:
        return
    shim = types.ModuleType("inspect_with_cached_lines", __doc__)
    shim.__dict__.update({k: v for k, v in vars(inspect).items() if not k.startswith("__")})
    shim.stack = stack_with_cached_lines
    entry.inspect = shim
