"""Typed argparse helpers shared by deploy.py, tune.py and train.py: a bad value is an
``argparse.ArgumentTypeError`` naming what was expected, so argparse prints a one-line usage error."""
from __future__ import annotations

import argparse


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
