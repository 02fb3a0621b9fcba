"""How deploy.py, tune.py and train.py end when something goes wrong: one line on stderr and an
exit code, never a traceback (set ``TVM_QCONV_DEBUG=1`` to get the traceback instead).

=====  =========================================================================================
exit   when
=====  =========================================================================================
2      bad input (:class:`~tvm_qconv.errors.InputError`): the line says what is wrong and what to do
130    Ctrl-C (128 + SIGINT, the shell's convention): the line says what was kept
143    SIGTERM (128 + 15), likewise
1      anything else, a failure of the project or of TVM: its type and first line, and how to get
       the traceback for a report
=====  =========================================================================================
"""
from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Callable

from . import interrupts
from .errors import InputError

DEBUG_ENV = "TVM_QCONV_DEBUG"
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def debug() -> bool:
    """Whether the user asked for tracebacks (``TVM_QCONV_DEBUG`` set to anything but "" or 0)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _say(text: str) -> None:
    print(" ".join(str(text).split()), file=sys.stderr)  # always one line


def first_line(err: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception in one line: its message's first line, or, for TVM's
    errors (their C++ backtrace first, the message last), its last."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""
    return f"{type(err).__name__}: {text[:limit]}"


def run(command: Callable[[], int], interrupted: str | Callable[[list[str]], str]) -> int:
    """``command()``'s exit code, or the table's above; ``interrupted`` says what a Ctrl-C kept
    (a callable gets the files the command had put in place whole, ``interrupts.written()``).

    SIGINT and SIGTERM are handled for the command's duration (``interrupts.handling``): an
    exception that ends the command while a signal is pending is that signal, whatever TVM made
    of it on its way through C++ (a ``RuntimeError``, an ``InputError`` of a wrapped call); a
    signal that something swallowed still ends the command with its exit code.  Once the command
    has ended, a signal is only recorded: the line below is always printed."""
    def kept() -> str:
        return interrupted(interrupts.written()) if callable(interrupted) else interrupted

    with interrupts.handling(), warnings.catch_warnings():
        quiet_dependency_warnings()
        warnings.showwarning = _one_line_warning
        try:
            code = command()
        except BaseException as err:  # noqa: BLE001 -- the last line of defence of a CLI
            interrupts.stop_raising()
            signum = interrupts.pending() or (getattr(err, "signum", signal.SIGINT)
                                              if isinstance(err, KeyboardInterrupt) else None)
            if debug() or (signum is None and not isinstance(err, Exception)):
                raise
            if signum is not None:
                interrupts.restore_stderr()
                _say(f"interrupted: {kept()}")
                return interrupts.exit_code(signum)
            if isinstance(err, InputError):
                _say(f"error: {err}")
                return EXIT_BAD_INPUT
            _say(f"error: {first_line(err)} (an internal failure, not a known bad input: run again "
                 f"with {DEBUG_ENV}=1 for the traceback and report it)")
            return EXIT_FAILED
        interrupts.stop_raising()
        signum = interrupts.pending()
        if signum is not None:  # it arrived after the last check: the command's work is complete
            interrupts.restore_stderr()
            done = ", ".join(interrupts.written())
            _say("interrupted after the command had finished its work" + (f": {done} written whole" if done else ""))
            return code or interrupts.exit_code(signum)  # a failure it reported (exit 3) stays its exit
        return code


# Warnings of the libraries underneath that say nothing a user of the CLIs can act on; filtered
# here, at the CLI, never in the library (a Python caller keeps its own warning settings).
DEPENDENCY_WARNINGS = (
    (FutureWarning, r".*LeafSpec.*"),  # torch.export's own pytree use (torch 2.11)
)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _say(f"warning: {message}")


def quiet_dependency_warnings() -> None:
    """Ignore :data:`DEPENDENCY_WARNINGS` (inside a ``warnings.catch_warnings()`` block)."""
    for category, message in DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
