"""Writing evidence files so that no partial file can ever look valid.

A record, report or plot is written to a temporary file in the same directory,
flushed to disk, and renamed over the final name (``os.replace`` is atomic on
POSIX within one file system). A run that dies mid-write leaves the previous
file or none, plus at worst a hidden ``.NAME.*.tmp`` that no reader opens.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename)."""
    path = pathlib.Path(path)
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; keep the usual mode
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def move_into(staging: pathlib.Path, names: list[str], destination: pathlib.Path) -> None:
    """Rename each of ``names`` from ``staging`` into ``destination`` (same file system),
    then remove ``staging``."""
    try:
        for name in names:
            os.replace(staging / name, destination / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def writable_directory_problem(path: pathlib.Path, flag: str) -> str | None:
    """Why ``path`` cannot be (or become) a directory this process writes into; None if it can.

    An existing path must be a writable, searchable directory; a missing one needs its
    nearest existing ancestor to be one (``mkdir -p`` will create the rest)."""
    if str(path) == "":
        return f"{flag}: an empty path is not a directory"
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return f"{flag} {path}: exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{flag} {path}: the directory is not writable"
        return _write_probe_problem(path, f"{flag} {path}: cannot write there")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{flag} {path}: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{flag} {path}: cannot create it, {ancestor} is not writable"
    return _write_probe_problem(ancestor, f"{flag} {path}: cannot create it in {ancestor}")


def _write_probe_problem(directory: pathlib.Path, what: str) -> str | None:
    """Create and remove a file in `directory`: ``os.access`` says yes to root wherever
    permissions would (``/proc``, some network mounts), and the work must not be done first."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".qwz-write-probe-", dir=directory)
    except OSError as error:
        return f"{what} ({(error.strerror or str(error)).lower()})"
    os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None
