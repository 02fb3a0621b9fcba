"""Typed argparse helpers shared by deploy.py, tune.py and train.py: a bad value is an
``argparse.ArgumentTypeError`` naming what was expected, and :class:`Parser` prints a usage error
in one line."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage error is one line, as every other bad input's is: the
    command, what is wrong and where the flags are listed (argparse prints the whole usage block
    first, up to a dozen lines, and the line that matters last).  Subcommands inherit it."""

    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message} (`{self.prog} --help` lists the flags)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v
