"""What a long command shows while it works: one line as each phase starts, with the time since the
command began, and a bar where a phase has steps.

    [build    0.0 s] export: torch.export at (1, 3, 224, 224) -> Relax
    [build    3.1 s] calibrate: percentile 99.99 on 15 images
    calibrate (percentile): 100%|██████████| 15/15 [00:04<00:00]
    [build    8.0 s] compile: tvm.compile for llvm
    ...

Every phase start is also a point where a pending Ctrl-C / SIGTERM ends the command
(``interrupts.check``).  The lines go to standard output, beside the report; bars only where
standard output is a terminal.  ``Phases(enabled=False)`` (``--quiet``, a library caller that
passes ``progress=False``) prints nothing and still records each phase's seconds.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterable, Iterator

from tqdm import tqdm

from . import interrupts


class Phases:
    """The phases of one command, printed as they start and timed.

    Args:
        tag: the command's name in each line (``build``, ``export-onnx``).
        enabled: print the lines and bars (False: only time them).
    """

    def __init__(self, tag: str = "build", enabled: bool = True):
        self.tag, self.enabled = tag, enabled
        self.start = time.time()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, detail: str = "") -> Iterator[None]:
        """A phase: checked for a pending signal, announced, timed (seconds add up by name)."""
        interrupts.check()
        self.say(f"{name}: {detail}" if detail else name)
        t = time.time()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.time() - t, 2)

    def say(self, text: str) -> None:
        """A line with the elapsed time, where the phases go."""
        if self.enabled:
            print(f"[{self.tag} {time.time() - self.start:6.1f} s] {text}", flush=True)

    @property
    def elapsed(self) -> float:
        return time.time() - self.start


def bar(iterable: Iterable, enabled: bool = True, **kwargs):
    """A tqdm progress bar on standard output, only where it is a terminal (a log file gets none)."""
    shown = enabled and sys.stdout.isatty()
    return tqdm(iterable, file=sys.stdout, disable=not shown, **kwargs)


def as_phases(progress, tag: str = "build") -> Phases:
    """``progress`` as a :class:`Phases`: one given is used as it is, a bool makes one."""
    return progress if isinstance(progress, Phases) else Phases(tag, enabled=bool(progress))
