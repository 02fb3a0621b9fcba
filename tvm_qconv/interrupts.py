"""Ctrl-C (SIGINT) and SIGTERM for the CLIs: stop soon, keep what the user made.

A ``KeyboardInterrupt`` raised wherever Python happens to be is not enough for a compiler built on
TVM: when the signal lands inside Python code that a TVM pass called back into (FoldConstant
legalizing an op, our own LowerToRelax pass, MetaSchedule's measure callback), the exception
crosses C++ and comes back as a ``RuntimeError`` -- or is swallowed by the pass, which then
carries on as if nothing happened (FoldConstant keeps the op unfolded and the build finished).

So the handler installed by :func:`handling` does two things: it records the signal (a flag no
C++ frame can swallow) and raises :class:`Interrupted` where Python is.  The flag is then read:

- by :func:`check`, at every phase boundary of a build, before a library's commit point
  (``artifact.save_artifact``) and after each TVM pass (:class:`StopAfterPass`, put into the
  build's ``PassContext``): a swallowed interrupt ends the build at the latest when the pass in
  flight ends;
- by ``cli.run``: any exception that ends a command while a signal is pending is that signal
  (exit 128 + signum: 130 for SIGINT, 143 for SIGTERM), whatever TVM turned it into.

``deferred()`` regions (a library's publish after its commit point; MetaSchedule's rounds) only
record the first signal and let the work in flight finish.  A second signal always raises at once; a third ends the process on the spot
(``os._exit``): every file the project writes is staged and renamed into place, so even then
nothing a user made is half-written.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator


SIGNALS = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """The user (SIGINT) or the system (SIGTERM) asked the command to stop."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(NAMES.get(signum, f"signal {signum}"))
        self.signum = signum


class _State:
    def __init__(self):
        self.signum: int | None = None  # the first signal received, while handling() is active
        self.count = 0                  # signals received
        self.deferred = 0               # depth of deferred() regions
        self.listeners: list[Callable[[int], None]] = []
        self.saved_stderr: int | None = None  # fd of the real stderr while it is muted
        self.active = False             # handling() installed the handler
        self.raising = True             # False once the command has ended: signals are only recorded
        self.written: list[str] = []    # files the command put in place (wrote()), in order


_state = _State()


def pending() -> int | None:
    """The signal number received since :func:`handling` began (None: none)."""
    return _state.signum


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived (and was swallowed on its way).

    Raises:
        Interrupted: a signal is pending.
    """
    if _state.signum is not None:
        raise Interrupted(_state.signum)


def _handler(signum, frame) -> None:
    _state.count += 1
    if _state.signum is None:
        _state.signum = signum
    for listener in list(_state.listeners):
        listener(signum)
    if _state.count >= 3:  # the first two did not get through: stop on the spot (writes are staged)
        say(f"\ninterrupted: {NAMES.get(signum, signum)} three times, stopped at once")
        os._exit(exit_code(_state.signum))
    if not _state.raising or (_state.deferred and _state.count == 1):
        return  # the work in flight finishes (check() raises after it), or the command already ended
    if os.environ.get("TVM_QCONV_DEBUG", "") in ("", "0"):
        _mute_stderr()  # what unwinds from here says nothing the one line will not
    raise Interrupted(signum)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Install the handler for SIGINT and SIGTERM for the ``with`` block (main thread only;
    elsewhere a no-op), with a fresh state; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _state
    saved, _state = _state, _State()
    _state.active = True
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        _state.raising = False
        for s, h in previous.items():  # the handlers first: no signal lands between the two steps
            signal.signal(s, h)
        restore_stderr()
        _state = saved


def active() -> bool:
    """Whether :func:`handling` is in force (a CLI), so :func:`deferred` regions defer."""
    return _state.active


def stop_raising() -> None:
    """The command has ended (returned or raised): from now on a signal is only recorded, so the
    CLI's own last steps (the line it prints) are not cut short."""
    _state.raising = False


def wrote(path: str) -> None:
    """Record that the command put ``path`` in place, whole (a library's save, an atomic write):
    a signal after that must not be reported as if the file were not written."""
    if _state.active:
        _state.written.append(path)


def written() -> list[str]:
    """The files :func:`wrote` recorded, in order."""
    return list(_state.written)


@contextlib.contextmanager
def deferred(on_first: Callable[[int], None] | None = None) -> Iterator[None]:
    """A region where the first signal is only recorded (``on_first(signum)`` is called, e.g. to
    say what will happen) and the work in flight goes on; :func:`check` afterwards raises.  A
    second signal raises at once."""
    def listener(signum):
        if _state.count == 1 and on_first is not None:
            on_first(signum)
    _state.deferred += 1
    _state.listeners.append(listener)
    try:
        yield
    finally:
        _state.deferred -= 1
        _state.listeners.remove(listener)


def pass_instruments() -> list:
    """The instruments every ``PassContext`` of a build runs with: one that ends the pipeline
    after the pass in flight when a signal is pending (a pass that swallowed the interrupt does
    not get to run the rest of the build)."""
    import tvm  # not at the top: every CLI imports this module (through cli) before parsing, and tvm takes ~2 s

    @tvm.instrument.pass_instrument
    class StopAfterPass:
        def run_after_pass(self, mod, info):
            check()

    return [StopAfterPass()]


def _mute_stderr() -> None:
    """From the first signal on, what the libraries underneath print while they unwind (TVM's
    "BlockBuilder destroyed with remaining blocks!" from a pass cut short) goes nowhere: the user
    gets the one line that says what was kept (:func:`say`, :func:`restore_stderr`)."""
    if _state.saved_stderr is not None:
        return
    try:
        sys.stderr.flush()
        _state.saved_stderr = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:  # no fd 2 to mute (a closed stderr): nothing to hide either
        _state.saved_stderr = None


def restore_stderr() -> None:
    """Give standard error back (after :func:`_mute_stderr`)."""
    if _state.saved_stderr is None:
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(_state.saved_stderr, 2)
    os.close(_state.saved_stderr)
    _state.saved_stderr = None


def say(line: str) -> None:
    """One line on the user's standard error, now, muted or not."""
    fd = _state.saved_stderr if _state.saved_stderr is not None else 2
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.write(fd, (line + "\n").encode())
