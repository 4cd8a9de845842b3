"""Files a run writes in ``--out`` that another local user may have planted links at.

A name in ``--out`` is replaced, never written through: a symbolic or hard link planted in
place of ``report.json`` (to another user's file) is unlinked and the file it pointed to is
left as it was. An append goes only to a regular file of one name.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["open_append", "replace_file"]


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new private file (0600, like the checkpoints) renamed to ``path``:
    a reader sees the old file or the new one, never half of one.

    >>> d = Path(tempfile.mkdtemp()); (d / "theirs").write_text("theirs")
    6
    >>> (d / "report.json").symlink_to(d / "theirs"); replace_file(d / "report.json", b"{}")
    >>> (d / "theirs").read_text(), (d / "report.json").is_symlink()
    ('theirs', False)
    """
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a process killed here
        with contextlib.suppress(OSError):
            stale.unlink()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_append(path: Path) -> int | None:
    """A descriptor that appends to ``path``, or ``None`` when ``path`` is not a regular
    file of one name (missing, a link, a hard-linked file): then rewrite it whole with
    :func:`replace_file`.

    >>> d = Path(tempfile.mkdtemp()); open_append(d / "missing") is None
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
