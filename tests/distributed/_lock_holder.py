"""Who holds a run folder's lock: what the run-lock tests look at (no src code asks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evendp._distributed._run_files import open_private
from evendp._distributed._run_lock import _lock_path, _read_holder


def run_dir_holder(out_dir: str | Path) -> dict[str, Any] | None:
    """Who holds ``out_dir``'s lock now (pid, host, command, since), or ``None`` when free."""
    import fcntl

    path = _lock_path(out_dir)
    if not path.exists():
        return None
    fd = open_private(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
