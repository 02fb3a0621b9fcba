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


def check_output_file(path: str, what: str = "output") -> None:
    """Refuse, before any work, a file path that cannot be written: an existing folder, a path
    under a file, or a folder this user cannot write into.

    Raises:
        InputError: naming the problem and what to do.
    """
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
        raise InputError(f"{what} {path} is a folder: give a file path (e.g. {os.path.join(path, 'model.so')})")
    check_output_folder(os.path.dirname(os.path.abspath(path)), what, path)


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
