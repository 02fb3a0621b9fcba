"""How deploy.py, tune.py and train.py end when something goes wrong: one line on stderr and an
exit code, never a traceback (set ``TVM_QCONV_DEBUG=1`` to get the traceback instead).

=====  =========================================================================================
exit   when
=====  =========================================================================================
2      bad input (:class:`~tvm_qconv.errors.InputError`): the line says what is wrong and what to do
130    Ctrl-C (128 + SIGINT, the shell's convention): the line says what was kept
1      anything else, a failure of the project or of TVM: its type and first line, and how to get
       the traceback for a report
=====  =========================================================================================
"""
from __future__ import annotations

import os
import sys
from typing import Callable

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


def run(command: Callable[[], int], interrupted: str) -> int:
    """``command()``'s exit code, or the table's above; ``interrupted`` says what a Ctrl-C kept."""
    try:
        return command()
    except InputError as err:
        if debug():
            raise
        _say(f"error: {err}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if debug():
            raise
        _say(f"interrupted: {interrupted}")
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 -- the last line of defence of a CLI
        if debug():
            raise
        _say(f"error: {first_line(err)} (an internal failure, not a known bad input: run again "
             f"with {DEBUG_ENV}=1 for the traceback and report it)")
        return EXIT_FAILED
