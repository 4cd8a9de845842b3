"""The one folder where evendp keeps files outside ``--out``: private to this user.

Run locks and the launcher's outcome folders live in ``$XDG_RUNTIME_DIR/evendp``, else
``$XDG_CACHE_HOME/evendp`` (``~/.cache/evendp``), else ``<tmp>/evendp-<uid>``: made ``0700``
whatever the umask, and checked as OpenSSH checks its files, with ``lstat``: a real folder of
this user's, not writable by others, else refused in one line (:class:`RunFilesUnsafe`, exit
2), so no other user can plant a link there. Files inside are opened with
:func:`open_private`.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .._core._errors import InputError
from .._core._files import mkdir_private

__all__ = ["RunFilesUnsafe", "open_private", "owned_by_me", "run_files_dir"]

_NAME = "evendp"


class RunFilesUnsafe(InputError):
    """evendp's private folder (or a file in it) is not this user's alone (exit 2)."""


def _candidates() -> list[tuple[Path, bool]]:
    """Where the folder may live, best first, and whether its parents may be made."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        found.append((Path(runtime) / _NAME, False))
    cache = os.environ.get("XDG_CACHE_HOME", "")
    home = os.path.expanduser("~")
    if os.path.isabs(cache):
        found.append((Path(cache) / _NAME, True))
    elif os.path.isabs(home):
        found.append((Path(home) / ".cache" / _NAME, True))
    found.append((Path(tempfile.gettempdir()) / f"{_NAME}-{os.geteuid()}", False))
    return found


def run_files_dir() -> Path:
    """This user's private folder for evendp's files outside ``--out`` (made when missing).

    The first place that can hold it is taken; one that exists is checked, never repaired:
    not this user's alone, it raises :class:`RunFilesUnsafe` rather than moving on (a live
    run's lock, in the first, would go unseen).

    >>> d = run_files_dir()
    >>> oct(d.lstat().st_mode & 0o777)
    '0o700'
    """
    candidates = _candidates()
    for folder, parents in candidates:
        try:
            info = folder.lstat()
        except FileNotFoundError:
            if not _make(folder, parents):
                continue  # the parent cannot hold it (no home, read-only cache): the next
            info = folder.lstat()
        except OSError:
            continue
        check_private_dir(folder, info)
        return folder
    raise RunFilesUnsafe(
        f"evendp found no place for its private run files (tried "
        f"{', '.join(repr(str(c)) for c, _ in candidates)}); set XDG_RUNTIME_DIR to a "
        "folder of your own"
    )


def _make(folder: Path, parents: bool) -> bool:
    """Create ``folder`` 0700 (``parents``: its missing parents too); False when it cannot be."""
    if not (parents or folder.parent.is_dir()):
        return False  # a runtime folder is the system's to make
    try:
        mkdir_private(folder)
    except OSError:
        return folder.exists()  # made by another process in between: checked by the caller
    return True


def check_private_dir(folder: Path, info: os.stat_result | None = None) -> None:
    """:class:`RunFilesUnsafe` unless ``folder`` is a real folder of this user's that group
    and others cannot write (``info``: its ``lstat``).

    >>> check_private_dir(run_files_dir())
    """
    info = folder.lstat() if info is None else info
    why = None
    if stat.S_ISLNK(info.st_mode):
        why = f"is a symbolic link (to {os.readlink(folder)!r})"
    elif not stat.S_ISDIR(info.st_mode):
        why = "is not a folder"
    elif info.st_uid != os.geteuid():
        why = f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
    elif info.st_mode & 0o022:
        why = f"is writable by group or others (mode {oct(info.st_mode & 0o777)})"
    if why is not None:
        raise RunFilesUnsafe(
            f"evendp's private run folder {str(folder)!r} {why}; remove it (evendp makes it "
            "again, 0700) or set XDG_RUNTIME_DIR to a folder of your own"
        )


def owned_by_me(info: os.stat_result) -> bool:
    """Whether ``info`` (an ``fstat``/``lstat``) is a regular file this user owns.

    >>> import os
    >>> owned_by_me(os.stat(__file__)) == (os.stat(__file__).st_uid == os.geteuid())
    True
    """
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0o600)``, refused unless it opened a
    regular file this user owns (checked on the descriptor, before any write).

    >>> import os, tempfile
    >>> fd = open_private(Path(tempfile.mkdtemp()) / "f", os.O_RDWR | os.O_CREAT)
    >>> oct(os.fstat(fd).st_mode & 0o777); os.close(fd)
    '0o600'
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        link = path.is_symlink()
        raise RunFilesUnsafe(
            f"cannot open evendp's run file {str(path)!r}: "
            + ("it is a symbolic link" if link else f"{exc.strerror or exc} (errno {exc.errno})")
            + f"; remove it, and check who can write to {str(path.parent)!r}"
        ) from None
    info = os.fstat(fd)
    if not owned_by_me(info):
        os.close(fd)
        raise RunFilesUnsafe(
            f"evendp's run file {str(path)!r} is not a file of yours (uid {info.st_uid}); "
            f"remove it, and check who can write to {str(path.parent)!r}"
        )
    return fd
