"""A built library on disk: ``model.so`` (code), ``model.params.npz`` (packed weights) and
``model.json`` (the scheme, the ranges, the build report), written and read here only."""
from __future__ import annotations

import hashlib
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


# The .json fields the code depends on: an edit of one (say the batch) is a mismatch too.
BOUND_FIELDS = ("input_shape", "param_names", "target", "arch")


def build_id(lib_path: str, params_path: str, meta: dict) -> str:
    """The hash of a library's code, params and :data:`BOUND_FIELDS` of its record: the ``.json``
    records it, loading checks it."""
    digest = hashlib.sha256(json.dumps([meta.get(k) for k in BOUND_FIELDS], default=str).encode())
    for path in (lib_path, params_path):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:20]


def save_artifact(ex, params: list, meta: dict, lib_path: str) -> None:
    """Write the three files through a temporary folder beside them and rename each into place:
    an interrupted build never leaves a half-written file, and an earlier build at the same path
    survives until the renames.  The ``.json`` goes last, as the commit record: it carries the
    build id of the code and params (:func:`build_id`), so a set whose renames were cut short
    (new code, old json) is refused at load (:func:`check_whole`), never run.

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
        meta = dict(meta, build_id=build_id(os.path.join(tmp, "lib.so"), os.path.join(tmp, "params.npz"), meta))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        for src, dst in (("lib.so", lib_path), ("params.npz", params_path), ("meta.json", meta_path)):
            os.replace(os.path.join(tmp, src), dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_whole(lib_path: str, meta: dict) -> None:
    """Refuse a library whose ``.so`` and ``.params.npz`` are not the ones its ``.json`` was
    written with (a save cut short, a file copied in from another build, an edited record).  Libraries from
    before build ids (no ``build_id``) pass.

    Raises:
        InputError: naming the library and the rebuild that fixes it.
    """
    want = meta.get("build_id")
    if want is None:
        return
    params_path, _ = artifact_paths(lib_path)
    if build_id(lib_path, params_path, meta) != want:
        raise InputError(f"{lib_path}, {params_path} and its .json are not the files of one build (a build was "
                         f"interrupted while saving, a file was copied from another build, or the .json was "
                         f"edited): rebuild it with `python deploy.py build ... -o {lib_path}`")


def read_meta(lib_path: str) -> dict:
    """The json record of a built library.

    Raises:
        InputError: one of the three files is missing, or the json is not a build's record.
    """
    params_path, meta_path = artifact_paths(lib_path)
    for p in (lib_path, params_path, meta_path):
        if not os.path.exists(p):
            raise InputError(f"{p} not found: build it with `python deploy.py build ... -o {lib_path}`")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{meta_path} is not the JSON record of a build ({err}): rebuild the library with "
                         f"`python deploy.py build ... -o {lib_path}`") from None
    if not isinstance(meta, dict):
        raise InputError(f"{meta_path} is not the JSON record of a build (a {type(meta).__name__}, not an object): "
                         f"rebuild the library with `python deploy.py build ... -o {lib_path}`")
    return meta
