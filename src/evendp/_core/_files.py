"""Files in ``--out`` that another local user may have planted links, FIFOs or giants at.

A name in ``--out`` is replaced, never written through: a symbolic or hard link planted in
place of ``report.json`` (to another user's file) is unlinked and the file it pointed to is
left as it was. An append goes only to a regular file of one name. A file read back is opened
without blocking (a FIFO cannot hang the run), must be a regular file and is refused by its
size (``fstat``) before a byte of it is read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = [
    "NotReadable",
    "fsync_dir",
    "mkdir_private",
    "open_append",
    "open_regular",
    "replace_file",
]


class NotReadable(ValueError):
    """A file :func:`open_regular` will not read: not a regular file, or over its cap."""


def replace_file(
    path: Path,
    data: bytes | Callable[[IO[bytes]], None],
    *,
    previous: Path | None = None,
    durable: bool = False,
) -> None:
    """Write ``data`` (bytes, or a function writing to the file) to a new private file (0600,
    like the checkpoints) renamed to ``path``: a reader sees the old file or the new one, never
    half of one. ``previous``: the file already at ``path`` is first moved there. ``durable``:
    the bytes and the rename are on disk (``fsync``) when this returns.

    >>> d = getfixture("tmp_path"); (d / "theirs").write_text("theirs")
    6
    >>> (d / "report.json").symlink_to(d / "theirs"); replace_file(d / "report.json", b"{}")
    >>> (d / "theirs").read_text(), (d / "report.json").is_symlink()
    ('theirs', False)
    """
    # Left by a process killed here: one writer per run folder (the run lock), so nobody else
    # is writing them.
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the rename shows them
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries: the renames in it are durable only then (POSIX only)."""
    if os.name != "posix":  # pragma: no cover
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_append(path: Path) -> int | None:
    """A descriptor that appends to ``path``, or ``None`` when ``path`` is not a regular
    file of one name (missing, a link, a hard-linked file): then rewrite it whole with
    :func:`replace_file`.

    >>> d = getfixture("tmp_path"); open_append(d / "missing") is None
    True
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, or a symbolic link (ELOOP)
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        return None
    return fd


def open_regular(path: str | Path, cap: int | None = None, *, mine: bool = False) -> IO[bytes]:
    """``path`` opened for reading, once it is known to be a regular file of at most ``cap``
    bytes: opened non-blocking (a FIFO or a device answers at once instead of waiting for a
    writer), checked with ``fstat`` on the open descriptor (the file read is the file checked).
    ``mine``: it must belong to this user too (a run's own files: what another user put in a
    run folder while it was open to them is not read). :class:`NotReadable` says why not, a
    link named with its target.

    >>> d = getfixture("tmp_path"); _ = (d / "f").write_bytes(b"abc")
    >>> with open_regular(d / "f", cap=3) as f: f.read()
    b'abc'
    >>> os.mkfifo(d / "fifo"); open_regular(d / "fifo")
    Traceback (most recent call last):
    ...
    evendp._core._files.NotReadable: it is a FIFO, not a regular file
    >>> (d / "zero").symlink_to("/dev/zero"); open_regular(d / "zero")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp._core._files.NotReadable: it is a link to '/dev/zero', a character device, not a ...
    >>> open_regular(d / "f", cap=2)
    Traceback (most recent call last):
    ...
    evendp._core._files.NotReadable: it is 3 bytes, more than the 2 such a file can be
    """
    link = os.readlink(path) if os.path.islink(path) else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if link is None:
            raise
        raise NotReadable(f"it is a link to {link!r}, which does not exist") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = (
                _kind(info.st_mode)
                if link is None
                else f"a link to {link!r}, {_kind(info.st_mode)}"
            )
            raise NotReadable(f"it is {what}, not a regular file")
        if mine and info.st_uid != os.geteuid():
            raise NotReadable(
                f"it belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): another "
                "user wrote it"
            )
        if cap is not None and info.st_size > cap:
            raise NotReadable(f"it is {info.st_size} bytes, more than the {cap} such a file can be")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
        stat.S_ISDIR: "a folder",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def mkdir_private(folder: Path) -> None:
    """Create ``folder`` and its missing parents 0700, whatever the umask: a run's files are
    its owner's (folders that exist already keep their mode). A missing folder that someone
    else makes first (between a run's check of its folder and its first save) is refused, not
    written into: a ``PermissionError``. An ``OSError`` is the caller's to word.

    >>> new = getfixture("tmp_path") / "a" / "b"
    >>> mkdir_private(new)
    >>> oct(new.stat().st_mode & 0o777), oct(new.parent.stat().st_mode & 0o777)
    ('0o700', '0o700')
    """
    missing = []
    here = folder.absolute()
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for part in reversed(missing):
        try:
            part.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile: by another rank, or by another user
            info = os.lstat(part)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise PermissionError(
                    errno.EPERM, f"made meanwhile by uid {info.st_uid}, not by you", str(part)
                ) from None
            continue
        os.chmod(part, 0o700)  # mkdir's mode is masked by the umask; chmod's is not
