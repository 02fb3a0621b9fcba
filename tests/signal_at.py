"""Run a CLI script and send this process a signal at a chosen point of its work (tests only).

    python tests/signal_at.py INT tvm.relax.block_builder:BlockBuilder.call_te 1 -- deploy.py build ...

The ``N``-th call of the function or method ``module:qualname`` (``gate>module:qualname``: the
N-th after ``gate`` was first called) sends the signal to this very process and then carries on into the real function: Python runs the handler at its next bytecode,
which is inside that function -- so a point inside a TVM pass that called back into Python is
exactly where the signal lands, as when a user's Ctrl-C arrives there.  ``TIME`` instead of a
target sends it after ``N`` seconds (a float) from a timer thread.  The moment the signal was
sent is appended to the file named by ``$SIGNAL_AT_LOG`` (seconds since the epoch), so the test
can tell how long the command took to stop.
"""
from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys
import threading
import time


def _send(signum: int) -> None:
    log = os.environ.get("SIGNAL_AT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{time.time()}\n")
    os.kill(os.getpid(), signum)


def _wrap(target: str, before) -> None:
    """Replace the function ``module:qualname`` by one that calls ``before()`` first."""
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    setattr(owner, attr, wrapper)


def _patch(target: str, nth: int, signum: int) -> None:
    """``A>B``: the N-th call of B after A was first called (B inside A: a pass inside tvm.compile)."""
    gate, _, target = target.rpartition(">")
    armed = [not gate]
    calls = [0]

    def count():
        if armed[0]:
            calls[0] += 1
            if calls[0] == nth:
                _send(signum)

    if gate:
        _wrap(gate, lambda: armed.__setitem__(0, True))
    _wrap(target, count)


def main(argv: list[str]) -> None:
    sep = argv.index("--")
    name, target, when = argv[:sep]
    script, *args = argv[sep + 1:]
    signum = getattr(signal, f"SIG{name}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the script's own imports, as when it runs
    if target == "TIME":
        timer = threading.Timer(float(when), _send, (signum,))
        timer.daemon = True
        timer.start()
    else:
        _patch(target, int(when), signum)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
