"""One writer per run directory: a lock on the folder held for the run's life.

Nothing in torch guards ``--out``. The lock is an ``flock`` (released the moment its holders
die) on ``<run files>/<sha1 of the folder's real path>.lock``, in this user's private folder
(:func:`~evendp._distributed._run_files.run_files_dir`): ``--out`` holds only the run's files.
The run that starts takes it exclusively for an instant, writes who it is (pid, host,
command, time) and keeps it shared; the ranks it starts (``EVENDP_RUN_LOCK``) join with shared
locks. A second run, or a ``--resume`` while its ranks live, refuses naming the holder
(shown cleaned and cut short). The taker removes the file at its end when nobody holds it,
and a run that starts removes those killed runs left.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._core._errors import CheckpointError
from .._core._trusted import trusted_run_folder
from ._run_files import open_private, owned_by_me, run_files_dir

__all__ = [
    "ENV_RUN_LOCK",
    "RunDirBusy",
    "child_env",
    "hold_run_dir",
    "trainer_lock",
]

#: Set for the processes a run starts: the lock file they join instead of taking it anew.
ENV_RUN_LOCK = "EVENDP_RUN_LOCK"

_held: dict[str, int] = {}  # resolved lock path -> open fd, in this process


class RunDirBusy(CheckpointError):
    """Another live run writes into this folder (exit 2): wait for it, stop it, or use
    another ``--out``."""


def _lock_path(out_dir: str | Path) -> Path:
    import hashlib

    folder = str(Path(out_dir).resolve())
    name = hashlib.sha1(folder.encode()).hexdigest()[:20]
    return run_files_dir() / f"{name}{_SUFFIX}"


_SUFFIX = ".lock"


_HOLDER_BYTES = 4096  # what the taker writes is far shorter; more is not a lock of ours


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder's JSON from the open lock file (this user's), only its fields, each of its
    kind and cut short."""
    if not owned_by_me(os.fstat(fd)):
        return {}
    try:
        info = json.loads(os.pread(fd, _HOLDER_BYTES, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    kinds: dict[str, type | tuple[type, ...]] = {
        "pid": int, "since": (int, float), "host": str, "command": str, "folder": str,
    }  # fmt: skip
    return {
        key: _clean(value) if isinstance(value, str) else value
        for key, value in info.items()
        if key in kinds and isinstance(value, kinds[key]) and not isinstance(value, bool)
    }


def _clean(text: str, limit: int = 200) -> str:
    r"""``text`` printable on one line, cut to ``limit`` characters.

    >>> _clean("rm -rf ~\x1b[2J\nnext"), len(_clean("x" * 500))
    ('rm -rf ~?[2J?next', 201)
    """
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "…"


def _describe(info: dict[str, Any]) -> str:
    if "pid" not in info:
        return "a process that has not said who it is yet"
    since = time.strftime("%H:%M:%S", time.localtime(float(info.get("since", 0))))
    return (
        f"pid {info.get('pid')} on {info.get('host')} since {since} (`{info.get('command', '?')}`)"
    )


@contextlib.contextmanager
def hold_run_dir(out_dir: str | Path, command: str | None = None) -> Iterator[Path]:
    """Hold ``out_dir``'s lock for the ``with`` block (no-op when this process holds it;
    joined when ``EVENDP_RUN_LOCK`` names it); :class:`RunDirBusy` if a live run has it.

    >>> d = getfixture("tmp_path")
    >>> with hold_run_dir(d, "demo") as lock:
    ...     json.loads(lock.read_text())["command"]
    'demo'
    >>> lock.exists()
    False
    """

    trusted_run_folder(out_dir)  # no other user's folder, nor a link of theirs on the way
    path = _lock_path(out_dir)
    key = str(path)
    if key in _held:  # this process holds it already (the CLI around the Trainer)
        yield path
        return
    folder = str(Path(out_dir).resolve())
    joining = os.environ.get(ENV_RUN_LOCK) == key
    if not joining:
        _remove_stale(path.parent)
    fd = _locked(path, folder, command, joining)
    try:
        _held[key] = fd
        try:
            yield path
        finally:
            del _held[key]
            if not joining:
                _remove_if_last(fd, path)
    finally:
        os.close(fd)  # releases this process's lock


def _locked(path: Path, folder: str, command: str | None, joining: bool) -> int:
    """The lock file's descriptor, locked, and still the file at ``path`` (a run that ended
    may have removed it between the open and the lock)."""
    import fcntl

    for _ in range(100):
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            try:  # the taker: exclusive for an instant; a rank of its run joins it shared
                fcntl.flock(fd, (fcntl.LOCK_SH if joining else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:  # joining: someone took it exclusively in between
                who = _describe(_read_holder(fd))
                raise RunDirBusy(
                    f"--out {folder!r} was taken by another run: {who}; pass another --out"
                    if joining
                    else f"--out {folder!r} is in use by a live run: {who}; wait for it to end "
                    "or stop it, then resume with --resume, or pass another --out"
                ) from None
            if not joining:
                _write_holder(fd, folder, command)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed under us: lock the file that is there now
    raise CheckpointError(f"cannot lock --out {folder!r}: {str(path)!r} keeps being replaced")


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = path.lstat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def _remove_if_last(fd: int, path: Path) -> None:
    """At the taker's end: remove the lock file unless a rank that outlived it holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # still held: the last holder's end leaves it for the next run's sweep
    if _same_file(fd, path):
        path.unlink(missing_ok=True)


def _remove_stale(folder: Path) -> None:
    """Remove the lock files no live process holds (runs killed before their end)."""
    import fcntl

    for path in folder.glob(f"*{_SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if owned_by_me(os.fstat(fd)):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, path):
                    path.unlink(missing_ok=True)
        except OSError:  # held (BlockingIOError) or gone: left alone
            pass
        finally:
            os.close(fd)


def _write_holder(fd: int, folder: str, command: str | None) -> None:
    """Say who took the lock, then hold it shared: the ranks this run starts join it."""
    import fcntl

    info = {
        "folder": folder,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command or _this_command(),
        "since": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new exclusive taker cannot have it


def _this_command() -> str:
    """This process's command line as typed (``evendp ...`` for the command line)."""
    import shlex

    first = Path(sys.argv[0]).name
    program = "evendp" if first in ("__main__.py", "evendp") else sys.argv[0]
    return shlex.join([program, *sys.argv[1:]])


def trainer_lock(
    out_dir: str | Path | None, distributed: bool
) -> contextlib.AbstractContextManager[Any]:
    """The Trainer's hold on ``out_dir``: in one process always; under torchrun only when its
    launcher took the lock for the ranks to join (plain torchrun's ranks have no first).

    >>> with trainer_lock(None, distributed=False):
    ...     pass
    """
    if out_dir is None:
        return contextlib.nullcontext()
    trusted_run_folder(out_dir, "out_dir")  # said by the field's name (hold_run_dir: --out)
    if distributed and os.environ.get(ENV_RUN_LOCK) != str(_lock_path(out_dir)):
        return contextlib.nullcontext()  # unlocked, but checked like every run folder
    return hold_run_dir(out_dir)


def child_env(path: Path) -> dict[str, str]:
    """The variables that let the processes a run starts join its lock on ``path``."""
    return {ENV_RUN_LOCK: str(path)}
