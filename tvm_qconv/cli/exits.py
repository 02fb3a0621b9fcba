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
3      (``deploy.py build``) built, but its outputs disagree with the float model's: written as
       ``<out>.unverified.so``, ``<out>.so`` unchanged (:data:`EXIT_UNVERIFIED`)
4      (``deploy.py build --accuracy-target``) the target was not reached even with every layer
       that helped kept in float: the closest library is written (:data:`EXIT_TARGET_MISSED`)
=====  =========================================================================================

Before the command, the thread count TVM's pool will start with is checked
(:func:`check_thread_count`): a ``TVM_NUM_THREADS`` that is not a positive whole number is refused
(exit 2), one above this machine's cores is lowered to them with a one-line warning.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import warnings
from typing import Callable

from .. import interrupts
from ..errors import InputError

DEBUG_ENV = "TVM_QCONV_DEBUG"
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_UNVERIFIED = 3  # deploy.py build: built, but its outputs disagree with the float model's (2: bad input)
EXIT_TARGET_MISSED = 4  # deploy.py build --accuracy-target: the closest library built, the target not reached


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


# TVM's CPU thread pool reads its size from the first of these that is set (threading_backend.cc,
# MaxConcurrency: atoi of the text, at least 1), once, when it first runs a parallel loop.
THREAD_ENVS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # (not Linux)
        return os.cpu_count() or 1


def check_thread_count() -> str | None:
    """Check the thread count TVM's CPU pool will start with; return a warning line, or None.

    A count above the cores is lowered to them (``os.environ``, before any pool starts): TVM's
    workers spin on ``sched_yield`` while they wait, so each one beyond the cores costs time and
    none adds any, and at exit the pool joins them one by one -- with ``TVM_NUM_THREADS=1000`` on
    2 cores a finished build took minutes to exit (16 workers: +9 s, 64: +48 s).  Threads beyond
    the cores cannot run at once, so the lower count loses nothing; it is said in a line, as is
    what to set.  ``OMP_NUM_THREADS``, which TVM reads where
    ``TVM_NUM_THREADS`` is unset, is checked likewise when it is one whole number (OpenMP's lists,
    ``4,2``, are OpenMP's).

    Raises:
        InputError: ``TVM_NUM_THREADS`` set to something other than a positive whole number
            (``abc``, ``0``, ``-2``, ``2.5``): TVM would read it as 1 thread, or the first digits,
            without a word; the user meant something, so they choose.
    """
    cores = usable_cores()
    for name in THREAD_ENVS:
        value = os.environ.get(name)
        if value is None:
            continue
        text = value.strip()
        if not (text.isascii() and text.isdigit()) or int(text) == 0:
            if name == "OMP_NUM_THREADS":
                return None     # OpenMP's own syntax, or nothing TVM reads as a count: OpenMP's to judge
            read = _tvm_reads(value)
            raise InputError(f"{name}={value!r} is not a positive whole number (TVM would quietly use {read} "
                             f"thread{'s' if read > 1 else ''}): set {name} to a number of threads from 1 to {cores} "
                             "(this machine's cores), or unset it to use them all")
        if int(text) > cores:
            os.environ[name] = str(cores)
            _set_torch_threads(name, cores)
            return (f"warning: {name}={text} is more than this machine's {cores} cores: using {cores} threads "
                    "(threads beyond the cores only wait for one, and each slows the exit: minutes for hundreds); "
                    f"set {name}={cores} or lower to silence this")
        return None     # the first one set is the one TVM reads
    return None


def _tvm_reads(value: str) -> int:
    """The thread count TVM takes from ``value``: C's ``atoi`` (leading blanks, a sign, the digits
    up to the first other character; 0 where there are none), at least 1."""
    match = re.match(r"\s*([+-]?\d+)", value)
    return max(int(match.group(1)) if match else 0, 1)


def _set_torch_threads(name: str, cores: int) -> None:
    """torch read ``OMP_NUM_THREADS`` when it was imported: lower its pool too."""
    torch = sys.modules.get("torch")
    if name == "OMP_NUM_THREADS" and torch is not None and torch.get_num_threads() > cores:
        torch.set_num_threads(cores)


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
            lowered = check_thread_count()      # before any TVM pool starts: the command's first parallel loop
            if lowered:
                _say(lowered)
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
