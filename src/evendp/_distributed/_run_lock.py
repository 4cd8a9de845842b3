"""One writer per run directory: a lock on the folder held for the run's life.

The lock file lives outside the folder, in ``<tmp>/evendp-locks/<sha1 of its real path>.lock``
(so ``--out`` holds only the run's own files, and a run that never started leaves nothing in
it); it names the folder it guards.

The lock is an ``flock`` on the file, so the operating system releases it the moment its
holders die (a stale lock file from a killed run is simply taken over). The run that starts
takes it exclusively for an instant (nobody else may hold it), writes who it is (pid, host,
command, time) into the file, and keeps it *shared*; the processes it starts (torchrun's
ranks, told by ``EVENDP_RUN_LOCK``) join with shared locks of their own. A second run, or a
``--resume`` into a folder whose ranks still train, cannot get the exclusive lock while any
of them lives and refuses with one line naming the holder.

``evendp train`` (every mode), ``evendp launch``'s ranks and the Trainer with ``out_dir``
take it; in one process a second :func:`hold_run_dir` of the same folder is a no-op.
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

__all__ = [
    "ENV_RUN_LOCK",
    "LOCK_DIR",
    "RunDirBusy",
    "child_env",
    "hold_run_dir",
    "run_dir_holder",
    "trainer_lock",
]

LOCK_DIR = "evendp-locks"
#: Set for the processes a run starts: the lock file they join instead of taking it anew.
ENV_RUN_LOCK = "EVENDP_RUN_LOCK"

_held: dict[str, int] = {}  # resolved lock path -> open fd, in this process


class RunDirBusy(CheckpointError):
    """Another live run writes into this folder (exit 2): wait for it, stop it, or use
    another ``--out``."""


def _lock_path(out_dir: str | Path) -> Path:
    import hashlib
    import tempfile

    folder = str(Path(out_dir).resolve())
    name = hashlib.sha1(folder.encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / LOCK_DIR / f"{name}.lock"


def run_dir_holder(out_dir: str | Path) -> dict[str, Any] | None:
    """Who holds ``out_dir``'s lock now (pid, host, command, since), or ``None`` when free.

    >>> import tempfile
    >>> run_dir_holder(tempfile.mkdtemp()) is None
    True
    """
    import fcntl

    path = _lock_path(out_dir)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict[str, Any]) -> str:
    if not info:
        return "a process that has not said who it is yet"
    since = time.strftime("%H:%M:%S", time.localtime(float(info.get("since", 0))))
    return (
        f"pid {info.get('pid')} on {info.get('host')} since {since} (`{info.get('command', '?')}`)"
    )


@contextlib.contextmanager
def hold_run_dir(out_dir: str | Path, command: str | None = None) -> Iterator[Path]:
    """Hold ``out_dir``'s lock for the ``with`` block; :class:`RunDirBusy` if a live run has it.

    Joins the run that started this process when ``EVENDP_RUN_LOCK`` names this folder's
    lock (torchrun's ranks under ``evendp launch`` or ``evendp train --mode ddp``).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with hold_run_dir(d, "demo"):
    ...     run_dir_holder(d)["command"]
    'demo'
    >>> run_dir_holder(d) is None
    True
    """

    path = _lock_path(out_dir)
    key = str(path)
    if key in _held:  # this process holds it already (the CLI around the Trainer)
        yield path
        return
    folder = str(Path(out_dir).resolve())
    try:
        path.parent.mkdir(mode=0o1777, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise CheckpointError(
            f"cannot lock --out {folder!r} through {str(path)!r}: {exc.strerror or exc} "
            f"(errno {exc.errno}); make {str(path.parent)!r} writable"
        ) from None
    try:
        if os.environ.get(ENV_RUN_LOCK) == key:
            _join(fd, path, folder)
        else:
            _take(fd, path, folder, command)
        _held[key] = fd
        try:
            yield path
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases this process's lock


def _take(fd: int, path: Path, folder: str, command: str | None) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirBusy(
            f"--out {folder!r} is in use by a live run: {_describe(_read_holder(path))}; "
            "wait for it to end or stop it, then resume with --resume, or pass another --out"
        ) from None
    info = {
        "folder": folder,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command or _this_command(),
        "since": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    # Shared from now on: the ranks this run starts join it; a new exclusive taker cannot.
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def _this_command() -> str:
    """This process's command line as typed (``evendp ...`` for the command line)."""
    import shlex

    first = Path(sys.argv[0]).name
    program = "evendp" if first in ("__main__.py", "evendp") else sys.argv[0]
    return shlex.join([program, *sys.argv[1:]])


def _join(fd: int, path: Path, folder: str) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # someone took it exclusively in between: not our run any more
        raise RunDirBusy(
            f"--out {folder!r} was taken by another run: "
            f"{_describe(_read_holder(path))}; pass another --out"
        ) from None


def trainer_lock(
    out_dir: str | Path | None, distributed: bool
) -> contextlib.AbstractContextManager[Any]:
    """The Trainer's hold on ``out_dir``: in one process always; under torchrun only when its
    launcher took the lock for the ranks to join (``EVENDP_RUN_LOCK``): ranks started by
    plain torchrun cannot tell which of them is first.

    >>> with trainer_lock(None, distributed=False):
    ...     pass
    """
    if out_dir is None or (
        distributed and os.environ.get(ENV_RUN_LOCK) != str(_lock_path(out_dir))
    ):
        return contextlib.nullcontext()
    return hold_run_dir(out_dir)


def child_env(path: Path) -> dict[str, str]:
    """The variables that let the processes a run starts join its lock on ``path``."""
    return {ENV_RUN_LOCK: str(path)}
