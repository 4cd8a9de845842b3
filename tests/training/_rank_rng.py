"""A rank's generator file (``ckpt.rng{rank}.pt``) on its own: what ``WholeFile`` writes and
reads for each rank's ``rng`` part, through the same functions, for the file-level tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evendp._training._checkpoint import (
    RngState,
    _read_rank,
    previous_path,
    rank_rng_path,
    read_rank_file,
    save_rank_file,
)


def save_rank_rng(path: str | Path, rank: int, step: int) -> Path:
    """This process's generators for ``step`` beside checkpoint ``path``, the last kept."""
    previous = rank_rng_path(previous_path(path), rank)
    return save_rank_file(
        rank_rng_path(path, rank), step, {"rng": RngState().state_dict()}, previous
    )


def load_rank_rng(path: str | Path, rank: int, step: int, reseed: int | None = None) -> bool:
    """Restore rank ``rank``'s generators of ``step`` (True), else warn and reseed (False)."""
    payload, why = read_rank_file(path, rank, step, rng=True)
    if payload is not None:
        RngState().load_state_dict(payload["rng"])
        return True
    RngState(reseed).without_saved(f"its RNG {why}", rank)
    return False


def read_rng(path: Path) -> dict[str, Any]:
    """A rank's generator file, whole."""
    return _read_rank(path, rng=True)
