"""Rank 0's checkpoint, on every machine of a run (issue 35).

Rank 0 alone writes ``ckpt.pt``, in its machine's ``--out``; with no shared file system the
other machines hold none, or an older one. So at a resume rank 0 says which files it holds
(size, SHA-256), one all-reduce says which any rank lacks, and rank 0 broadcasts those bytes,
written privately and atomically where they lacked. Every rank runs the same collectives,
decided from data every rank has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .._core._digest import digest_words
from .._core._files import mkdir_private, open_regular, replace_file
from .._core._units import format_bytes
from ._group import comm_device

__all__ = ["rank0_files"]

_HELD, _SIZE, _DIGEST = 0, 1, slice(2, 6)  # a file's row: held, size, SHA-256 as 4 int64
_UNREADABLE = -1  # rank 0 holds it but cannot read it: nobody copies (its load says why)


def rank0_files(
    paths: Sequence[Path], *, machine: int | None = None, local_rank: int | None = None
) -> tuple[list[bool], list[str]]:
    """Which of ``paths`` rank 0 holds (on every rank alike), and a note per file this
    rank's machine received (a collective of the default group). ``machine`` (else
    ``GROUP_RANK``): machine 0's ranks read rank 0's folder; ``local_rank`` (else
    ``LOCAL_RANK``): on another machine local rank 0 writes what its ranks lacked.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "ckpt.pt"
    >>> rank0_files([path]) if not dist.is_initialized() else None
    ([False], [])
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [os.path.lexists(p) for p in paths], []
    rank, device = dist.get_rank(), comm_device()
    facts = torch.stack([_facts(p) for p in paths]) if rank == 0 else torch.zeros(len(paths), 6)
    facts = facts.to(torch.int64).to(device)
    dist.broadcast(facts, 0)
    rows = facts.cpu().tolist()
    if machine is None:
        machine = int(os.environ.get("GROUP_RANK", "0") or 0)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    on_rank0s_machine = machine == 0
    mine = [
        rank != 0 and not on_rank0s_machine and row[_HELD] == 1 and row[_SIZE] >= 0
        and not _same(path, row)
        for path, row in zip(paths, rows, strict=True)
    ]  # fmt: skip
    needed = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(needed, op=dist.ReduceOp.MAX)
    notes = []
    for path, row, want, anyone in zip(paths, rows, mine, needed.tolist(), strict=True):
        if anyone:
            data = _broadcast_bytes(path if rank == 0 else None, row[_SIZE], device)
            if want and local_rank == 0:  # one writer a machine: its ranks share --out
                notes.append(_keep(path, data, row))
    if any(needed.tolist()):
        dist.barrier()  # every machine's copy is written before any rank reads it
    return [row[_HELD] == 1 for row in rows], notes


def _facts(path: Path) -> torch.Tensor:
    """``[held, size, digest...]`` of rank 0's ``path``."""
    if not os.path.lexists(path):  # anything there (a FIFO, a link): its load says why not
        return torch.zeros(6, dtype=torch.int64)
    try:
        data = _read(path)
    except (OSError, ValueError):
        return torch.tensor([1, _UNREADABLE, 0, 0, 0, 0], dtype=torch.int64)
    return torch.tensor([1, len(data), *digest_words(data)], dtype=torch.int64)


def _read(path: Path) -> bytes:
    with open_regular(path, mine=True) as source:  # no FIFO, no link's target outside the folder
        return source.read()


def _same(path: Path, row: list[int]) -> bool:
    """Whether this rank's ``path`` is rank 0's (its size, then its digest)."""
    try:
        if not path.is_file() or path.stat().st_size != row[_SIZE]:
            return False
        return digest_words(_read(path)) == row[_DIGEST]
    except (OSError, ValueError):
        return False


def _broadcast_bytes(source: Path | None, size: int, device: torch.device) -> bytes:
    """Rank 0's bytes of ``source`` (``size`` of them) on every rank."""
    if source is not None:
        buffer = torch.frombuffer(bytearray(_read(source)), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, 0)
    return buffer.cpu().numpy().tobytes()


def _keep(path: Path, data: bytes, row: list[int]) -> str:
    """Write rank 0's ``data`` at ``path``, private and whole; the note that says so."""
    if len(data) != row[_SIZE] or digest_words(data) != row[_DIGEST]:  # never a torn copy
        return f"{path.name} from rank 0 arrived damaged; not kept (the resume reads it again)"
    mkdir_private(path.parent)
    replace_file(path, data, durable=True)
    return f"took rank 0's {path.name} ({format_bytes(len(data))}) over the process group"
