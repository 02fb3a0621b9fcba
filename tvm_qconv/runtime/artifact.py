"""A built library on disk: ``model.so`` (code), ``model.params.npz`` (packed weights) and
``model.json`` (the scheme, the ranges, the build report), written and read here only."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings

import numpy as np

from .. import interrupts
from ..errors import InputError, UnverifiedLibraryWarning
from ..fileio import TEMP_PREFIX, file_kind

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


STAGE = TEMP_PREFIX + "publish-"  # + <pid>-<library file name>-<random>: a save's staging folder
COMMIT = "commit.json"            # in a staging folder: the three new files are complete


def _staging_folders(lib_path: str) -> list[tuple[str, int]]:
    """(path, pid of the process that made it) of every staging folder of ``lib_path``."""
    folder, name = os.path.split(os.path.abspath(lib_path))
    found = []
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        if not entry.startswith(STAGE):
            continue
        pid, _, rest = entry[len(STAGE):].partition("-")
        if pid.isdigit() and rest.rsplit("-", 1)[0] == name:
            found.append((os.path.join(folder, entry), int(pid)))
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not publishing (a save cleans its own folder up)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _targets(lib_path: str) -> tuple:
    """(staged name, destination) of a library's three files, in publishing order: the ``.json`` last."""
    params_path, meta_path = artifact_paths(lib_path)
    return ("lib.so", lib_path), ("params.npz", params_path), ("meta.json", meta_path)


BACKUP = "old."  # + staged name, in a staging folder: the file a publish replaces, to put back if it fails


def _publish(stage: str, lib_path: str) -> None:
    """Move the staged files into place, the ``.json`` last, then drop the staging folder.
    Idempotent: a file already moved is skipped, so a publish cut short can be run again."""
    for src, dst in _targets(lib_path):
        if os.path.exists(os.path.join(stage, src)):
            os.replace(os.path.join(stage, src), dst)
    shutil.rmtree(stage, ignore_errors=True)


def _keep_backups(stage: str, lib_path: str) -> None:
    """Before the commit point: a hard link (a copy where the file system has none) in the
    staging folder to each file the publish will replace, so that a publish which fails midway
    (a destination that cannot be replaced: an immutable file, a full disk) can put them back.

    Raises:
        InputError: a file that can be neither linked nor read (nothing has moved yet).
    """
    for src, dst in _targets(lib_path):
        if not os.path.exists(dst):
            continue
        backup = os.path.join(stage, BACKUP + src)
        try:
            os.link(dst, backup)
        except OSError:
            try:
                shutil.copy2(dst, backup)
            except OSError as err:
                raise InputError(f"cannot keep a copy of {dst} to put back should the new library fail to go in "
                                 f"place ({err.strerror or err}); nothing was changed: make it readable or give "
                                 "another output path") from None


def _publish_or_roll_back(stage: str, lib_path: str) -> None:
    """Publish a committed staging folder in this process.  Where a move fails, the files the
    earlier moves replaced are put back from their backups (:func:`_keep_backups`) and the folder
    is dropped: a build reported as failed is never installed later by :func:`recover` (which
    publishes only what a killed process left).

    Raises:
        InputError: naming the file that could not be replaced, and what is at ``lib_path`` now.
    """
    moved = []
    for src, dst in _targets(lib_path):
        if not os.path.exists(os.path.join(stage, src)):
            continue
        try:
            os.replace(os.path.join(stage, src), dst)
        except OSError as err:
            put_back = _roll_back(stage, moved)
            shutil.rmtree(stage, ignore_errors=True)
            why = f"could not put the new library in place: {dst} cannot be replaced ({err.strerror or err})"
            if put_back:
                raise InputError(f"{why}; nothing was installed, the files at {lib_path} are as they were: make "
                                 f"{dst} replaceable (an immutable file: chattr -i) or give another output "
                                 "path") from None
            raise InputError(f"{why}, and {', '.join(d for _, d in moved)} could not be put back: the files at "
                             f"{lib_path} are not one build (loading refuses them); rebuild it") from None
        moved.append((src, dst))
    shutil.rmtree(stage, ignore_errors=True)


def _roll_back(stage: str, moved: list) -> bool:
    """Put back what ``moved`` replaced (a file there was none of before goes); False where one
    could not be."""
    ok = True
    for src, dst in reversed(moved):
        backup = os.path.join(stage, BACKUP + src)
        try:
            if os.path.exists(backup):
                os.replace(backup, dst)
            else:
                os.remove(dst)
        except OSError:
            ok = False
    return ok


def recover(lib_path: str) -> None:
    """Finish or drop a save of ``lib_path`` that a killed process left: a staging folder with
    its commit record is published (the new library, whole), one without is removed (the
    previous library was never touched).  Folders of a save still running in another process
    are left alone.  Called before every save and load of ``lib_path``; best effort (a folder
    this user cannot write is left as it is, and the build ids still refuse a mixed set)."""
    for stage, pid in _staging_folders(lib_path):
        if _alive(pid):
            continue
        try:
            if os.path.exists(os.path.join(stage, COMMIT)):
                _publish(stage, lib_path)
            else:
                shutil.rmtree(stage)
        except OSError:
            pass


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_artifact(ex, params: list, meta: dict, lib_path: str) -> None:
    """Publish the three files as a set: the previous library at ``lib_path`` stays whole until
    the new one is, and a process killed at any point leaves one of the two, never a mix.

    The files are written into a staging folder beside ``lib_path``; a commit record written
    (and synced) there last marks them complete; they are then renamed into place, the ``.json``
    last, and the folder removed.  A process killed before the commit record leaves the previous
    library untouched; one killed after it leaves a staging folder that :func:`recover` (run by
    the next save or load of ``lib_path``) publishes.  The ``.json`` carries the build id of the
    code and params (:func:`build_id`), so a set mixed by anything else is refused at load.

    Args:
        ex: the ``tvm.compile`` result.
        params: ``[(name, np.ndarray)]`` in the order of main's parameters after the input.
        meta: the json record.
        lib_path: the ``.so`` to write.
    """
    folder = os.path.dirname(os.path.abspath(lib_path))
    os.makedirs(folder, exist_ok=True)
    recover(lib_path)
    stage = tempfile.mkdtemp(dir=folder, prefix=f"{STAGE}{os.getpid()}-{os.path.basename(lib_path)}-")
    try:
        ex.export_library(os.path.join(stage, "lib.so"))
        with open(os.path.join(stage, "params.npz"), "wb") as f:
            np.savez(f, **{n: a for n, a in params})
            f.flush()
            os.fsync(f.fileno())
        meta = dict(meta, build_id=build_id(os.path.join(stage, "lib.so"), os.path.join(stage, "params.npz"), meta))
        _fsync_write(os.path.join(stage, "meta.json"), json.dumps(meta, indent=1, default=str).encode())
        _keep_backups(stage, lib_path)
        _fsync_write(os.path.join(stage, COMMIT + ".tmp"), json.dumps({"lib": lib_path}).encode())
        interrupts.check()  # a signal some C++ frame swallowed: the previous library stays
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # From the commit point on the new set is complete: a signal now is only recorded (the CLI
    # then says the library was written); a process killed now leaves the folder for recover();
    # a move that fails in this process is rolled back (_publish_or_roll_back).
    with interrupts.deferred():
        os.replace(os.path.join(stage, COMMIT + ".tmp"), os.path.join(stage, COMMIT))  # the commit point
        try:
            _publish_or_roll_back(stage, lib_path)
        except KeyboardInterrupt:  # (a caller without the CLI's handler) the new set is complete: finish it
            _publish(stage, lib_path)
            raise
    interrupts.wrote(lib_path)


UNVERIFIED = ".unverified"  # <stem>.unverified.so: a build that failed its verification


def remove_unverified(lib_path: str) -> str | None:
    """Drop the ``<stem>.unverified.*`` set an earlier, failed build of ``lib_path`` left, now that
    a verified build is in place (accepting it later would put the older, failed build back over
    the newer one).  Returns its path, or None when there was none."""
    stale = unverified_path(lib_path)
    if not os.path.exists(stale):
        return None
    for path in (stale, *artifact_paths(stale)):
        if os.path.exists(path):
            os.remove(path)
    return stale


def unverified_path(lib_path: str) -> str:
    """Where a library that failed verification goes instead of ``lib_path`` (``build/vgg16.so``
    -> ``build/vgg16.unverified.so``): a verified library there is never replaced by it."""
    stem = lib_path[:-3] if lib_path.endswith(".so") else lib_path
    return stem + UNVERIFIED + ".so"


def accept_unverified(unverified: str, lib_path: str | None = None) -> str:
    """Move a library that failed verification into place anyway: its three files replace
    ``lib_path``'s (default: its own name without ``.unverified``) as one set, as a save does.
    Its json keeps the failed verification, so every load still warns.

    Returns:
        the path it now has.

    Raises:
        InputError: ``unverified`` is not a whole library, or did not fail its verification.
    """
    meta = read_meta(unverified)
    check_whole(unverified, meta)
    if verification_status(meta) != "failed":
        raise InputError(f"{unverified} did not fail its verification ({verification_status(meta)}): there is "
                         "nothing to accept; use it as it is")
    if lib_path is None:
        if not unverified.endswith(UNVERIFIED + ".so"):
            raise InputError(f"{unverified} is not named <stem>{UNVERIFIED}.so: say where it goes with --output")
        lib_path = unverified[: -len(UNVERIFIED + ".so")] + ".so"
    if os.path.realpath(lib_path) == os.path.realpath(unverified):
        raise InputError(f"--output {lib_path} is the library being accepted: give the path it should take "
                         "(default: its name without .unverified)")
    folder = os.path.dirname(os.path.abspath(lib_path))
    recover(lib_path)
    stage = tempfile.mkdtemp(dir=folder, prefix=f"{STAGE}{os.getpid()}-{os.path.basename(lib_path)}-")
    try:
        params, meta_path = artifact_paths(unverified)
        for src, dst in ((unverified, "lib.so"), (params, "params.npz")):
            shutil.copyfile(src, os.path.join(stage, dst))
        _fsync_write(os.path.join(stage, "meta.json"),
                     json.dumps(dict(meta, accepted_unverified=True), indent=1, default=str).encode())
        _keep_backups(stage, lib_path)
        _fsync_write(os.path.join(stage, COMMIT), json.dumps({"lib": lib_path}).encode())
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    with interrupts.deferred():
        _publish_or_roll_back(stage, lib_path)
        for path in (unverified, *artifact_paths(unverified)):
            os.remove(path)
    interrupts.wrote(lib_path)
    return lib_path


def verification_status(meta: dict) -> str:
    """``ok``, ``failed``, ``cannot judge``, ``skipped`` or ``not run`` (built with --no-verify)."""
    return ((meta.get("report") or {}).get("verify") or {}).get("status", "not run")


def unverified_warning(lib_path: str, meta: dict) -> str | None:
    """The one-line warning a loader gives a library that failed its verification or whose
    verification could not judge it (None: nothing to say)."""
    v = (meta.get("report") or {}).get("verify") or {}
    if v.get("status") == "failed":
        return (f"{lib_path} FAILED its verification against the float model when it was built (logits "
                f"{v.get('logits_sqnr_db')} dB, floor {v.get('floor_db')} dB): its outputs may be wrong")
    if v.get("status") == "cannot judge":
        return f"{lib_path} is unverified: its build could not judge it ({v.get('reason', '')})"
    return None


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


def check_tvm_version(lib_path: str, meta: dict) -> None:
    """Refuse a library built with another TVM version than this runtime's: the VM bytecode and
    the host code's runtime calls are not promised stable across versions.  Libraries that do
    not record it (built before this check) pass.

    Raises:
        InputError: naming both versions and the rebuild that fixes it.
    """
    import tvm  # not at the top: `deploy.py accept` and reading a build's record need no tvm (~2 s)
    built = meta.get("tvm_version")
    if built and built != tvm.__version__:
        raise InputError(f"{lib_path} was built with TVM {built}, this runtime is TVM {tvm.__version__}: rebuild it "
                         f"with `python deploy.py build ... -o {lib_path}` (or run it where TVM {built} is installed)")


def open_library(lib_path: str) -> dict:
    """The json record of a library that is whole (:func:`check_whole`), warning once
    (:class:`~tvm_qconv.errors.UnverifiedLibraryWarning`) where it failed its verification: what
    every loader (local, remote, compare) reads first.

    Raises:
        InputError: as :func:`read_meta` and :func:`check_whole`.
    """
    meta = read_meta(lib_path)
    check_whole(lib_path, meta)
    warning = unverified_warning(lib_path, meta)
    if warning:
        warnings.warn(warning, UnverifiedLibraryWarning, stacklevel=3)
    return meta


def not_a_library(lib_path: str) -> str | None:
    """Why the files at ``lib_path`` (its ``.so``, ``.params.npz`` and ``.json``) are not a library
    this project wrote, or None: none is there, or its ``.json`` is a build's record (whole or
    not: replacing it is what a build does, atomically).  ``build -o`` and ``accept -o`` replace
    only such a set without ``--force``."""
    params_path, meta_path = artifact_paths(lib_path)
    present = [p for p in (lib_path, params_path, meta_path) if os.path.lexists(p)]
    if not present:
        return None
    if not os.path.exists(meta_path):
        return f"there is no {os.path.basename(meta_path)} build record beside it"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict) or not {"input_shape", "param_names"} <= set(meta):
        return f"{os.path.basename(meta_path)} beside it is not the JSON record of a build"
    return None


def read_meta(lib_path: str) -> dict:
    """The json record of a built library.

    Raises:
        InputError: one of the three files is missing, or the json is not a build's record.
    """
    recover(lib_path)  # a save killed after its commit point is finished first
    params_path, meta_path = artifact_paths(lib_path)
    if os.path.isfile(lib_path) and not os.path.exists(meta_path):   # a file of another kind in a library's slot
        kind = file_kind(lib_path)
        if kind is not None and kind != "a library built by deploy.py":
            model = lib_path if kind == "an ONNX model" or lib_path.endswith(".onnx") else "MODEL"
            raise InputError(f"{lib_path} is {kind}, not a library built by deploy.py (no {os.path.basename(meta_path)} "
                             f"beside it): build one with `python deploy.py build --model {model} -o NAME.so`")
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
