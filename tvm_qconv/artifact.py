"""A built library on disk: ``model.so`` (code), ``model.params.npz`` (packed weights) and
``model.json`` (the scheme, the ranges, the build report), written and read here only."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from .errors import InputError
from .fileio import TEMP_PREFIX

ARTIFACT_VERSION = 1


def artifact_paths(lib_path: str) -> tuple[str, str]:
    """(params, meta) paths beside the library ``lib_path``."""
    stem = lib_path[:-3] if lib_path.endswith(".so") else lib_path
    return stem + ".params.npz", stem + ".json"


def save_artifact(ex, params: list, meta: dict, lib_path: str) -> None:
    """Write the three files through a temporary folder beside them and rename each into place:
    an interrupted build never leaves a half-written file, and an earlier build at the same path
    survives until the renames.

    Args:
        ex: the ``tvm.compile`` result.
        params: ``[(name, np.ndarray)]`` in the order of main's parameters after the input.
        meta: the json record.
        lib_path: the ``.so`` to write.
    """
    params_path, meta_path = artifact_paths(lib_path)
    folder = os.path.dirname(os.path.abspath(lib_path))
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=folder, prefix=TEMP_PREFIX)
    try:
        ex.export_library(os.path.join(tmp, "lib.so"))
        np.savez(os.path.join(tmp, "params.npz"), **{n: a for n, a in params})
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        for src, dst in (("params.npz", params_path), ("meta.json", meta_path), ("lib.so", lib_path)):
            os.replace(os.path.join(tmp, src), dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_meta(lib_path: str) -> dict:
    """The json record of a built library.

    Raises:
        InputError: one of the three files is missing.
    """
    params_path, meta_path = artifact_paths(lib_path)
    for p in (lib_path, params_path, meta_path):
        if not os.path.exists(p):
            raise InputError(f"{p} not found: build it with `python deploy.py build ... -o {lib_path}`")
    with open(meta_path) as f:
        return json.load(f)
