"""The table of measured choices for the training step's int8 convs: read by :mod:`tvm_kernels`
for every conv it builds, written by :mod:`conv_tiles`' search.

``tuning_logs/training-convs-<arch>.json`` (or the file ``$TVM_QCONV_CONV_TILES`` names) keeps one
entry per workload: its default's and its best choice's times and the choice
(``schedules/training/conv_choices.py``) the kernels are then built with; None where the default
stays.  Workloads are matched by their exact shape (batch included), their split count left out (a
split-K dw's count is part of its choice).  A module of its own, apart from the search: the search
builds and runs kernels through :mod:`tvm_kernels`, which reads the table, so neither imports the
other both ways.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

from ..errors import InputError
from ..fileio import write_json
from ..schedules.training.conv_choices import FAMILIES
from ..schedules.workload import ConvWorkload

TABLE_ENV = "TVM_QCONV_CONV_TILES"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def table_path(arch: str) -> str:
    """``$TVM_QCONV_CONV_TILES``, else ``tuning_logs/training-convs-<arch>.json`` of the repository."""
    return os.environ.get(TABLE_ENV) or os.path.join(_REPO, "tuning_logs", f"training-convs-{arch}.json")


def key(wl: ConvWorkload) -> str:
    """A table key: the workload's fields, its split count left out (a split-K dw's count is part
    of its choice: :func:`choice_workload`)."""
    return json.dumps({**wl.to_dict(), "splits": 1}, sort_keys=True)


def choice_workload(wl: ConvWorkload, choice: dict | None) -> ConvWorkload:
    """The workload ``choice`` runs: ``wl`` with the choice's split count where it has one."""
    splits = (choice or {}).get("splits", wl.splits)
    return wl if splits == wl.splits else dataclasses.replace(wl, splits=splits)


def read_table(path: str) -> dict:
    """The table at ``path`` (``{"layers": [...]}``); an empty one where there is no file.

    Raises:
        InputError: a file that is not such a table.
    """
    if not os.path.exists(path):
        return {"layers": []}
    try:
        with open(path) as f:
            table = json.load(f)
        for row in table["layers"]:
            ConvWorkload.from_dict(row["workload"])
            if row["choice"] is not None and row["choice"]["family"] not in FAMILIES:
                raise ValueError(f"unknown family {row['choice']['family']!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path} is not a training-conv table ({type(err).__name__}: {err}): delete it (the "
                         f"convs then run their default tiles) or rebuild it with python tune.py --training") from err
    return table


@functools.lru_cache(maxsize=8)
def _entries(path: str, stamp: tuple) -> tuple[str | None, dict[str, dict | None]]:
    table = read_table(path)
    return table.get("arch"), {key(ConvWorkload.from_dict(r["workload"])): r["choice"] for r in table["layers"]}


def lookup(wl: ConvWorkload, arch: str) -> dict | None:
    """The choice the table holds for ``wl`` on ``arch`` (whatever ``wl``'s split count; see
    :func:`choice_workload`); None where the default stays (no table, no entry, or the default
    measured fastest)."""
    path = table_path(arch)
    try:
        st = os.stat(path)
    except OSError:
        return None
    table_arch, entries = _entries(path, (st.st_mtime_ns, st.st_size))
    if table_arch is not None and table_arch != arch:      # measured on another GPU ($TVM_QCONV_CONV_TILES)
        return None
    return entries.get(key(wl))


def merge_rows(path: str, rows: list[dict], meta: dict) -> None:
    """Put ``rows``' choices into the table at ``path`` (replacing the same workloads' entries),
    atomically."""
    table = read_table(path)
    by_key = {key(ConvWorkload.from_dict(r["workload"])): r for r in table["layers"]}
    for r in rows:
        best = r["best"]
        by_key[key(ConvWorkload.from_dict(r["workload"]))] = {
            "workload": r["workload"], "describe": r["describe"], "choice": best["choice"] if best else None,
            "ms": best["ms"] if best else r["default"]["ms"], "default_ms": r["default"]["ms"], **meta}
    table.update({k: v for k, v in meta.items() if k in ("arch", "tvm")})
    table["layers"] = sorted(by_key.values(), key=lambda r: r["describe"])
    write_json(path, table, indent=1)
