"""Atomic file writes: whatever a user made (a library, a tuning log, a checkpoint, a kernel cache
entry) is either the old file or the whole new one, never half of it, whatever interrupts the write."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from typing import Iterator

from . import interrupts
from .errors import InputError

TEMP_PREFIX = ".tvm_qconv-"  # every temporary this project writes starts so (tests look for leftovers)


def file_kind(path: str) -> str | None:
    """What a file given in the wrong slot is, from its first bytes, for the error that names it
    (``"a shared library (ELF)"``, ``"an image (PNG)"``...); None where nothing is recognized or
    it cannot be read."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    if not head:
        return "an empty file"
    if head.startswith(b"\x7fELF"):
        lib = os.path.exists(path[:-3] + ".json") if path.endswith(".so") else False
        return "a library built by deploy.py" if lib else "a shared library (ELF)"
    for magic, what in ((b"\x89PNG", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
                        (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF")):
        if head.startswith(magic):
            return f"an image ({what})"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "an image (WebP)"
    if head.startswith(b"PK\x03\x04"):
        import zipfile
        try:
            names = zipfile.ZipFile(path).namelist()
        except (OSError, zipfile.BadZipFile):
            return "a zip archive"
        if any(n.endswith("data.pkl") for n in names):
            return "a file torch.save wrote"
        return "a NumPy archive (.npz)" if names and all(n.endswith(".npy") for n in names) else "a zip archive"
    if path.endswith(".onnx"):
        return "an ONNX model"
    if b"\x00" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return "a JSON file" if text.lstrip().startswith(("{", "[")) else "a text file"
    return None


# a file name to suggest in a folder, by what is written there
_EXAMPLE_NAMES = {"library": "model.so", "checkpoint": "model.pt", "ONNX file": "model.onnx",
                  "JSON result": "result.json"}


def check_output_file(path: str, what: str = "output", *, inputs: dict | None = None, ours=None,
                      force: bool = False) -> None:
    """Refuse, before any work, a file path that cannot be written: an existing folder, a path
    under a file, or a folder this user cannot write into; one of the command's own inputs; an
    existing file that is not one this project wrote as ``what`` (unless ``force``).

    Args:
        inputs: ``{flag: path}`` of the command's inputs (``{"--model": "m.onnx"}``): writing over
            one would destroy what the command reads, so it is refused even with ``force``.
        ours: ``(path) -> reason or None`` for a file already at ``path``: None where this project
            wrote it as ``what`` (replacing it is the command's point), else why it is not one.
        force: replace an existing file that ``ours`` says is not one of this project's.

    Raises:
        InputError: naming the problem and what to do.
    """
    if not path or path.endswith(os.sep):
        raise InputError(f"{what} path {path!r} names no file: give a file path (e.g. "
                         f"{os.path.join(path or '.', _EXAMPLE_NAMES.get(what, 'out'))})")
    if os.path.islink(path):  # a rename onto it would replace the link itself, not what it names
        try:
            os.stat(path)
            real = os.path.realpath(path)
        except OSError as err:  # a loop (ELOOP), or a link to nothing
            reason = "a symbolic link loop" if err.errno == errno.ELOOP else "a symbolic link to nothing"
            raise InputError(f"{what} {path} is {reason}: remove the link or give another path") from None
        raise InputError(f"{what} {path} is a symbolic link (to {real}): writing would replace the link with a "
                         f"file; give the path it names ({real}) or another path")
    if os.path.isdir(path):
        raise InputError(f"{what} {path} is a folder: give a file path (e.g. "
                         f"{os.path.join(path, _EXAMPLE_NAMES.get(what, 'out'))})")
    for flag, given in (inputs or {}).items():
        if given and same_file(path, given):
            raise InputError(f"{what} {path} is the {flag} {given} of this command: writing there would destroy it; "
                             "give another path")
    if ours is not None and not force and os.path.isfile(path):
        reason = ours(path)
        if reason:
            raise InputError(f"{what} {path} already exists and is not one this project wrote ({reason}): it would "
                             "be replaced; give another path, or add --force to replace it")
    check_output_folder(os.path.dirname(os.path.abspath(path)), what, path)


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through links; by path where one does not exist yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output_folder(folder: str, what: str = "output folder", shown: str | None = None) -> None:
    """Refuse, before any work, a folder that cannot be created or written into: it (or a path
    above it) is a file, or the nearest existing folder is not writable.

    Raises:
        InputError: naming the problem and what to do (``shown``: the path the user gave).
    """
    shown = shown or folder
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):  # the nearest existing path is where it would be created
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"{what} {shown} cannot be written: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{what} {shown} cannot be written: no write permission in {existing}; "
                         "choose another folder")
    try:  # what access() cannot tell: a read-only or pseudo file system (/proc), root on either
        fd, probe = tempfile.mkstemp(dir=existing, prefix=TEMP_PREFIX + "probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise InputError(f"{what} {shown} cannot be written: {existing} does not take new files "
                         f"({err.strerror or err}); choose another folder") from None


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """A temporary path beside ``path``: write it inside the ``with``; on a clean exit it is
    renamed onto ``path`` (atomic on POSIX: same folder, same file system), otherwise removed --
    also when a Ctrl-C / SIGTERM is pending (``interrupts``): an interrupted command never
    replaces a file.

    Args:
        path: the file to (re)place; its folder is created if missing.
        suffix: the temporary's suffix, for writers that choose a format by it (``.so``).

    Example:
        >>> with atomic_path("build/model.json") as tmp:
        ...     open(tmp, "w").write("{}")
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _default_mode())  # mkstemp creates 0600; give the file the usual mode
        interrupts.check()  # a Ctrl-C that some C++ frame swallowed: the old file stays
        os.replace(tmp, path)
        interrupts.wrote(path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, obj, **kwargs) -> None:
    """Replace ``path`` by ``obj`` as JSON, atomically (``kwargs`` go to ``json.dump``)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, **kwargs)
