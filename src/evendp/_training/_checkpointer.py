"""One checkpointer for the run's named ``Stateful`` parts (torchtitan's ``states={...}``), in
the strategy's :class:`CheckpointFormat`: each part saved once for all ranks, a
:class:`~evendp._training._stateful.PerRank` one by every rank into its own file.

A part named by a format's field (``ckpt.pt``: :data:`~._checkpoint.FIELDS`; ``ckpt.dcp``: its
shards and :data:`~._checkpoint.STATE_FIELDS`) is checked against this run's object before
anything loads. Every other shared part is plain data in the checkpoint's ``extra`` (``train``
and ``guard`` flat, where every evendp has kept them); a part an older checkpoint lacks keeps
its fresh state. A part that refuses its saved state (``ValueError``, ``TypeError``,
``KeyError``) makes the checkpoint corrupt: the resume falls back, as for a garbled file.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._core._errors import CheckpointError
from .._distributed._rank0_files import rank0_files
from .._distributed._rank_errors import agreed
from ._checkpoint import (
    FIELDS,
    STATE_FIELDS,
    UNVERIFIED,
    CorruptCheckpoint,
    first_good,
    fix_for,
    load_sharded_checkpoint,
    previous_path,
    rank_rng_path,
    read_rank_file,
    read_whole,
    save_rank_file,
    save_sharded_checkpoint,
    write_whole,
)
from ._checkpoint_names import DCP_SHARDS, WHOLE_FILE
from ._stateful import PerRank

__all__ = ["CheckpointFormat", "Checkpointer", "DcpShards", "WholeFile"]

#: Parts whose keys sit at the top of ``extra``, where every evendp has kept them.
_FLAT = ("train", "guard")
#: What a sharded checkpoint stores as its own fields (the rest is plain data in ``extra``).
_SHARDED = ("model", "optimizer", *STATE_FIELDS)
#: ``verify(found, extra)``: refuse a checkpoint whose saved configuration does not fit the run.
Verify = Callable[[Path, dict[str, Any]], None]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def split(parts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's parts and this rank's own (:class:`PerRank`, unwrapped), by name."""
    shared = {n: p for n, p in parts.items() if not isinstance(p, PerRank)}
    own = {n: p.part for n, p in parts.items() if isinstance(p, PerRank)}
    return shared, own


def step_of(parts: Mapping[str, Any]) -> int:
    """The step the parts are at (the ``train`` part's), 0 without one."""
    for name in _FLAT:
        if name in parts and "step" in (state := parts[name].state_dict()):
            return int(state["step"])
    return 0


def plain_data(
    parts: Mapping[str, Any], fields: tuple[str, ...], extra: Mapping[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The checkpoint's ``step`` and its ``extra``: the parts not among ``fields`` as plain
    data (``train`` and ``guard`` flat), then ``extra``."""
    step, data = 0, {}
    for name, part in parts.items():
        if name in fields:
            continue
        state = dict(part.state_dict())
        if name in _FLAT:
            step = int(state.pop("step", step))
            data.update(state)
        else:
            data[name] = state
    data.update(extra)
    return step, data


def restore(found: Path, name: str, part: Any, saved: Any) -> list[str]:
    """``part.load_state_dict(saved)``, its note; a refusal makes ``found`` corrupt."""
    try:
        if not isinstance(saved, dict):
            raise TypeError(f"must be a dict, got {type(saved).__name__}")
        note = part.load_state_dict(saved)
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptCheckpoint(
            f"checkpoint {str(found)!r} is refused: field {name}: {exc}; {fix_for(found)}"
        ) from None
    return [note] if isinstance(note, str) else []


def restore_plain(
    found: Path, parts: Mapping[str, Any], fields: tuple[str, ...], info: Mapping[str, Any]
) -> list[str]:
    """The parts not among ``fields`` from ``extra``; a part the file has none of keeps its
    fresh state (a checkpoint older than the part)."""
    extra, said = info["extra"], []
    for name, part in parts.items():
        saved = {**extra, "step": info["step"]} if name in _FLAT else extra.get(name)
        if name not in fields and saved is not None:
            said += restore(found, name, part, saved)
    return said


def restore_own(
    found: Path, own: Mapping[str, Any], saved: Mapping[str, Any] | None, missing: str, rank: int
) -> list[str]:
    """This rank's parts from its ``saved`` states; one it has none of keeps its fresh state
    and hears why (``missing`` when nothing was saved for this rank, its ``{what}`` the part's
    name in words)."""
    said: list[str] = []
    for name, part in own.items():
        if saved is not None and name in saved:
            said += restore(found, name, part, saved[name])
            continue
        what = getattr(part, "what", f"{name!r} state")
        why = missing if saved is None else f"the checkpoint {str(found)!r} holds no {{what}}"
        if callable(getattr(part, "without_saved", None)):  # else: fresh, nothing to say
            part.without_saved(why.replace("{what}", what), rank)
    return said


class CheckpointFormat(abc.ABC):
    """Where the parts go on disk: a strategy's ``checkpoint_format``. ``parts`` hold every
    part by name, this rank's :class:`PerRank` ones among them; ``extra`` is plain data saved
    beside them (the run's configuration)."""

    #: The checkpoint's name in ``out_dir`` (a file or a folder).
    name: str

    @abc.abstractmethod
    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        """Write this step's checkpoint at ``path`` (every rank calls it); its path, or ``None``
        on a rank that wrote no checkpoint of its own."""

    def candidates(self, path: Path) -> tuple[list[Path], list[str]]:
        """The checkpoints a resume may take, latest first (the same on every rank), and lines
        on how they came here."""
        # Anything at the name (a FIFO, a dangling link): its load says why it is skipped.
        return [p for p in (path, previous_path(path)) if os.path.lexists(p)], []

    @abc.abstractmethod
    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        """Check, then restore ``parts`` from ``path`` (every rank calls it): ``{"step": int,
        "extra": dict, "said": [the parts' notes]}`` (``"notes"``: what it fell back past
        inside ``path``). :class:`CorruptCheckpoint` when it cannot be read back whole;
        ``verify`` runs on the saved ``extra`` before anything is loaded."""


class WholeFile(CheckpointFormat):
    """``ckpt.pt``, written by rank 0 alone, beside each rank's ``ckpt.rng{rank}.pt``.

    >>> import torch
    >>> from evendp._training._recorder import TrainState
    >>> path = getfixture("tmp_path") / WholeFile.name
    >>> net, state = torch.nn.Linear(1, 1), TrainState(devices=1, step=2)
    >>> parts = {"model": net, "train": state}
    >>> WholeFile().save(path, parts, rank=0, extra={}, keep_previous=True).name
    'ckpt.pt'
    >>> WholeFile().load(path, parts, rank=0, verify=lambda p, e: None)["step"]
    2
    """

    name = WHOLE_FILE

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        shared, own = split(parts)
        in_file, own_file = _own_split(own, rank)

        def write() -> Path | None:  # no collective: a fault on one rank cannot hang the others
            step, data = plain_data(shared, FIELDS, extra)
            if rank == 0:
                whole = {**shared, **in_file}
                write_whole(path, whole, step=step, extra=data, keep_previous=keep_previous)
            mine = {n: p.state_dict() for n, p in own_file.items()}
            if mine:
                previous = rank_rng_path(previous_path(path), rank)
                save_rank_file(rank_rng_path(path, rank), step, mine, previous)
            return path if rank == 0 else None

        return agreed(write, _distributed())  # a failed write on one rank stops every rank

    def candidates(self, path: Path) -> tuple[list[Path], list[str]]:
        """Rank 0's: a rank on another machine whose ``--out`` lacks rank 0's file (or holds
        an older copy) receives it over the process group (:mod:`.._distributed._rank0_files`)."""
        both = [path, previous_path(path)]
        held, notes = rank0_files(both)
        return [p for p, h in zip(both, held, strict=True) if h], notes

    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        distributed, (shared, own) = _distributed(), split(parts)
        in_file, mine = _own_split(own, rank)
        info = agreed(lambda: read_whole(path, {**shared, **in_file}, verify=verify), distributed)
        said = agreed(lambda: restore_plain(path, shared, FIELDS, info), distributed)

        def own_parts() -> list[str]:
            if not mine:
                return []
            saved, why = read_rank_file(path, rank, info["step"], rng="rng" in mine)
            return restore_own(path, mine, saved, f"its {{what}} {why}", rank)

        said += agreed(own_parts, distributed)  # every rank joins: a garbled file stops all
        return {**info, "said": said}


def _own_split(own: Mapping[str, Any], rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's parts ``ckpt.pt`` has a field for (rank 0's ``rng``: where its generators
    have always been), and those of its own file."""
    in_file = {n: p for n, p in own.items() if rank == 0 and n in FIELDS}
    return in_file, {n: p for n, p in own.items() if n not in in_file}


class DcpShards(CheckpointFormat):
    """The ``ckpt.dcp`` folder of ``torch.distributed.checkpoint`` shards (FSDP2): every rank
    writes its shards and its per-rank parts, rank 0 the run's position (``state.pt``); it
    resumes on any number of ranks. A collective."""

    name = DCP_SHARDS

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        shared, own = split(parts)
        step, data = plain_data(shared, _SHARDED, extra)
        mine = {name: part.state_dict() for name, part in own.items()}
        return save_sharded_checkpoint(
            path, shared, mine, step=step, extra=data, keep_previous=keep_previous
        )

    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        shared, own = split(parts)
        info = load_sharded_checkpoint(path, shared, rng="rng" in own, verify=verify)
        said = agreed(lambda: restore_plain(path, shared, _SHARDED, info), True)
        missing = (
            f"the checkpoint {str(path)!r} was saved by {info['world_size']} rank(s) and holds "
            "no {what} for this rank"
        )
        said += agreed(lambda: restore_own(path, own, info["own"], missing, rank), True)
        return {**info, "said": said}


class Checkpointer:
    """Saves and resumes the run's named parts in ``format``; the fallback to the previous
    checkpoint and the run's configuration check (``run_config``: what a resume must match,
    ``{"global_batch": int, "mode": str}``, also saved in ``extra``) live here.

    >>> import torch
    >>> from evendp._training._recorder import TrainState
    >>> path = getfixture("tmp_path") / "ckpt.pt"
    >>> net, state = torch.nn.Linear(1, 1), TrainState(devices=1, step=3)
    >>> _ = Checkpointer(WholeFile()).save(path, {"model": net, "train": state})
    >>> again = TrainState(devices=1)
    >>> notes = Checkpointer(WholeFile()).resume(path, {"model": net, "train": again})
    >>> again.step, notes[-1].endswith("at step 3")
    (3, True)
    """

    def __init__(
        self, format: CheckpointFormat, *, rank: int = 0, run_config: dict[str, Any] | None = None
    ) -> None:
        self.format, self.rank = format, rank
        self.run_config = {} if run_config is None else run_config
        # The file at the checkpoint path is not a good checkpoint (a resume fell back past
        # it): the next save replaces it without rotating it over the good previous one.
        self._latest_bad = False
        #: What this rank received from rank 0 at the last resume (one line a file).
        self.received: list[str] = []

    def save(self, path: Path, parts: Mapping[str, Any]) -> Path | None:
        """Write ``parts`` (``None`` ones left out) as this step's checkpoint at ``path``."""
        present = {name: part for name, part in parts.items() if part is not None}
        saved = self.format.save(
            path, present, rank=self.rank, extra=dict(self.run_config),
            keep_previous=not self._latest_bad,
        )  # fmt: skip
        self._latest_bad = False
        return saved

    def resume(self, path: Path, parts: Mapping[str, Any]) -> list[str] | None:
        """Load the latest good checkpoint at ``path`` into ``parts``: what it restored and
        what it could not (one line each), or ``None`` when there is none (a fresh start).
        A corrupt latest one falls back to the previous; every rank calls it."""
        candidates, fetched = self.format.candidates(path)
        self.received = fetched
        if not candidates:
            return None
        present = {name: part for name, part in parts.items() if part is not None}
        # A mismatch with the run (CheckpointError) falls through: exit 2, no fallback.
        found, info, skipped = first_good(
            candidates, lambda p: self.format.load(p, present, rank=self.rank, verify=self._check)
        )
        self._latest_bad = found != path
        notes = fetched + [
            f"{s}; fell back to the previous checkpoint {str(found)!r}" for s in skipped
        ]
        notes += info.get("notes", [])  # the format's own fallbacks inside one checkpoint
        notes.append(f"resumed from {found} at step {info['step']}")
        if str(found) in UNVERIFIED:
            notes.append(
                f"{found} was written by an older evendp without a checksum: loaded unverified"
            )
        return notes + info["said"]

    def _check(self, found: Path, saved: dict[str, Any]) -> None:
        """The run's configuration against the saved one: another global batch is refused."""
        ours, theirs = self.run_config.get("global_batch"), saved.get("global_batch")
        if ours is not None and theirs is not None and int(ours) != int(theirs):
            raise CheckpointError(
                f"checkpoint {str(found)!r} was trained with a global batch of {theirs}, this "
                f"run has {ours}: resuming would change the order of the remaining samples; "
                f"resume with the same global batch (--batch {theirs}), or start fresh with "
                "another --out"
            )
