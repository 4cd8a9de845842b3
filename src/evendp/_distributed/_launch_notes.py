"""What the ranks tell ``evendp launch`` through its private outcome folder (the folder of
``EVENDP_OUTCOME``; nothing outside a launcher): rank 0's outcome, and empty marks, only
looked for.

torchrun reports only exit codes. So a rank leaves the run's exit code for the launcher
(:func:`write_outcome`: the ranks exit 0, so torchrun neither restarts nor reports them), a
mark when it read the launcher's batch sizes (the launcher warns when none did: a script that
ignores them runs its own), and the Trainer one once training began (before it, a start-up
collective has no timeout, and the launcher waits less after a signal).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_BATCH_DEFAULTED",
    "ENV_OUTCOME",
    "note_sizes_read",
    "note_sizes_told",
    "note_training",
    "read_outcome",
    "sizes_read_here",
    "sizes_were_read",
    "sizes_were_told",
    "training_began",
    "write_outcome",
]

#: Where rank 0 leaves the run's exit code for the launcher (a file in the launcher's private
#: folder). ``_torchrun/_quiet.py`` spells it itself (a test keeps them equal).
ENV_OUTCOME = "EVENDP_OUTCOME"
#: Set to ``1`` by ``evendp launch`` when its ``EVENDP_BATCH_SIZES`` is its own default (no
#: --batch, --batch-sizes or --model given): a script's own sizes then win over it.
ENV_BATCH_DEFAULTED = "EVENDP_BATCH_DEFAULTED"
_MARK = "sizes-read"
_TOLD = "sizes-told"
_TRAINING = "training"
_read_here = False  # whether this process read the launcher's sizes


def note_sizes_read() -> None:
    """On a rank under ``evendp launch``: say that this run read the launcher's sizes.

    >>> note_sizes_read()  # no launcher here: nothing to do
    """
    global _read_here
    _read_here = True
    _mark(_MARK)


def sizes_read_here() -> bool:
    """Whether this process read the launcher's sizes (:func:`note_sizes_read`)."""
    return _read_here


def note_sizes_told() -> None:
    """On rank 0: the ranks were told at their first step that they ignore the sizes."""
    _mark(_TOLD)


def sizes_were_told(outcome: Path) -> bool:
    """On the launcher: whether :func:`note_sizes_told` was called."""
    return (outcome.parent / _TOLD).exists()


def note_training() -> None:
    """On a rank under a launcher: training began (the collectives' timeout is set).

    >>> note_training()  # no launcher here: nothing to do
    """
    _mark(_TRAINING)


def _mark(name: str) -> None:
    outcome = os.environ.get(ENV_OUTCOME)
    if not outcome:
        return
    # Any one mark of several is enough; an OSError: the launcher is gone, nobody to warn.
    with contextlib.suppress(OSError):
        (Path(outcome).parent / name).touch(mode=0o600, exist_ok=True)  # private, as all


def sizes_were_read(outcome: Path) -> bool:
    """On the launcher: whether a rank read the sizes (:func:`note_sizes_read`).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> sizes_were_read(folder / "outcome.json")
    False
    """
    return (outcome.parent / _MARK).exists()


def training_began(outcome: Path) -> bool:
    """On the launcher: whether a rank said training began (:func:`note_training`)."""
    return (outcome.parent / _TRAINING).exists()


def write_outcome(code: int, **details: Any) -> None:
    """Under a launcher: leave this run's exit code (and details) for it to exit with.

    >>> write_outcome(0)  # no launcher here: nothing to do
    """
    from ._run_files import open_private

    path = os.environ.get(ENV_OUTCOME)
    if path:
        fd = open_private(Path(path), os.O_WRONLY | os.O_CREAT)  # never through a link
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"code": int(code), **details}).encode())
        finally:
            os.close(fd)


def read_outcome(path: Path) -> dict[str, Any] | None:
    """What :func:`write_outcome` left at ``path`` (``None``: nothing, or unreadable)."""
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return said if isinstance(said, dict) and isinstance(said.get("code"), int) else None
