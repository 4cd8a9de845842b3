"""Work done once per pytest run, even when its users run on different xdist workers."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["once_per_run"]


@contextlib.contextmanager
def once_per_run(factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """``(folder, done)``: the run's folder ``name`` and whether an earlier user (this worker or
    another) finished filling it. The block runs under an exclusive lock; when it ends without
    an exception the folder counts as done. A failed attempt leaves it to the next user."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the run's workers (each has its own basetemp below)
    folder, mark = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = mark.exists()
        if not done:
            folder.mkdir(exist_ok=True)
        yield folder, done
        mark.touch()
