"""One checkpointer for the run's state: named ``Stateful`` parts, in a format the strategy picks.

The Trainer names the run's parts in one dict, in the style of torchtitan's ``states={...}``::

    {"model": ..., "optimizer": ..., "scheduler": ..., "scaler": ..., "train": TrainState,
     "rng": RngState, "guard": OomCaps, "balancer": SpeedBalancer}

(a part that is ``None``, no scheduler or no scaler, is simply absent). :class:`Checkpointer`
saves and resumes them; *where* they go on disk is a :class:`CheckpointFormat`, an object the
strategy supplies (``Strategy.checkpoint_format``):

- :class:`WholeFile` (one process, DDP): rank 0 writes ``ckpt.pt``, every other rank its own
  generators in ``ckpt.rng{rank}.pt`` (no collective but the agreement on errors); at a
  resume the ranks of other machines take rank 0's ``ckpt.pt`` over the process group.
- :class:`DcpShards` (FSDP2): a collective ``torch.distributed.checkpoint`` save into the
  ``ckpt.dcp`` folder, each rank its shards and generators, rank 0 ``state.pt``.

The layout is the one every evendp has written, so older checkpoints resume. The model,
optimizer, scaler and scheduler are the format's own fields, checked against this run's objects
before anything loads (:mod:`evendp._training._checkpoint`); ``rng`` is one per rank. Every
other part is plain data in the checkpoint's ``extra``: ``train`` and ``guard`` keep their keys
at its top level, where they have always been (``epoch``, ``batch_in_epoch``, ``losses``,
``samples``, ``micro_batch_sizes``, ``resplits``, ``skipped``; the train part's ``step`` is the
checkpoint's own ``step``), any other part sits under its name (``extra["balancer"]``). So one
more part is one more entry in the Trainer's dict. A part that refuses its saved state (a
``ValueError``, ``TypeError`` or ``KeyError`` from ``load_state_dict``) makes the checkpoint
corrupt: the resume falls back to the previous one, as for a garbled file.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._core._errors import CheckpointError
from .._distributed._rank0_files import rank0_files
from .._distributed._rank_errors import agreed
from ._checkpoint import (
    UNVERIFIED,
    CorruptCheckpoint,
    first_good,
    fix_for,
    load_checkpoint,
    load_rank_rng,
    load_sharded_checkpoint,
    previous_path,
    read_state_file,
    save_checkpoint,
    save_rank_rng,
    save_sharded_checkpoint,
)
from ._stateful import Stateful

__all__ = ["CheckpointFormat", "Checkpointer", "DcpShards", "WholeFile"]

#: Parts the format stores as its own checked fields (the rest are plain data in ``extra``).
TENSOR_PARTS = ("model", "optimizer", "scaler", "scheduler")
#: Parts whose keys sit at the top of ``extra``, where every evendp has kept them.
_FLAT = ("train", "guard")
#: ``verify(found, extra)``: refuse a checkpoint whose saved configuration does not fit the run.
Verify = Callable[[Path, dict[str, Any]], None]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _tensors(parts: Mapping[str, Any]) -> dict[str, Any]:
    return {name: parts.get(name) for name in TENSOR_PARTS}


class CheckpointFormat(abc.ABC):
    """Where the parts go on disk: a strategy's ``checkpoint_format``.

    ``parts`` hold the format's fields by name (:data:`TENSOR_PARTS`, and ``rng``, this rank's
    generators, when present); ``extra`` is every other part as plain data.
    """

    #: The checkpoint's name in ``out_dir`` (a file or a folder).
    name: str
    #: Whether saving and loading are collectives (every rank reads and writes its own part).
    collective: bool = False

    @abc.abstractmethod
    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        step: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        """Write this step's checkpoint at ``path`` (every rank calls it); its path, or ``None``
        on a rank that wrote no checkpoint of its own."""

    def candidates(self, path: Path) -> tuple[list[Path], list[str]]:
        """The checkpoints a resume may take, latest first (every rank the same list), and
        lines on how they came here: ``path`` and its previous copy where they exist."""
        return [p for p in (path, previous_path(path)) if p.exists()], []

    @abc.abstractmethod
    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        """Check, then restore the format's fields from ``path`` (every rank calls it):
        ``{"step": int, "extra": dict}`` (and ``"notes"``, lines on what it fell back past
        inside ``path``). :class:`CorruptCheckpoint` when it cannot be read back whole;
        ``verify`` runs on the saved ``extra`` before anything is loaded."""


class WholeFile(CheckpointFormat):
    """``ckpt.pt``, written by rank 0 alone, beside each other rank's ``ckpt.rng{rank}.pt``.

    >>> import tempfile, torch
    >>> path = Path(tempfile.mkdtemp()) / WholeFile.name
    >>> net = torch.nn.Linear(1, 1)
    >>> WholeFile().save(path, {"model": net}, rank=0, step=2, extra={}, keep_previous=True).name
    'ckpt.pt'
    >>> WholeFile().load(path, {"model": net}, rank=0, verify=lambda p, e: None)["step"]
    2
    """

    name = "ckpt.pt"

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        step: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        def write() -> Path | None:
            if rank != 0:  # no collective: a fault on one rank cannot hang the others
                if parts.get("rng") is not None:
                    save_rank_rng(path, rank, step)
                return None
            return save_checkpoint(
                path, **_tensors(parts), step=step, extra=extra, keep_previous=keep_previous
            )

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
        distributed, rng = _distributed(), parts.get("rng")
        info = agreed(
            lambda: load_checkpoint(
                path, **_tensors(parts), restore_rng=rng is not None, verify=verify
            ),
            distributed,
        )

        def own_rng() -> None:
            if rank != 0 and rng is not None:  # load_checkpoint restored rank 0's generators
                load_rank_rng(path, rank, info["step"], reseed=getattr(rng, "reseed", None))

        agreed(own_rng, distributed)  # every rank joins: a garbled file stops all
        return info


class DcpShards(CheckpointFormat):
    """The ``ckpt.dcp`` folder of ``torch.distributed.checkpoint`` shards (FSDP2): every rank
    writes its shards and its generators, rank 0 the run's position (``state.pt``); it
    resumes on any number of ranks. A collective."""

    name = "ckpt.dcp"
    collective = True

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        step: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        return save_sharded_checkpoint(
            path, **_tensors(parts), step=step, extra=extra, keep_previous=keep_previous
        )

    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        meta = agreed(lambda: read_state_file(path), True)
        agreed(lambda: verify(path, dict(meta.get("extra") or {})), True)
        rng = parts.get("rng")
        return load_sharded_checkpoint(path, **_tensors(parts), reseed=getattr(rng, "reseed", None))


class Checkpointer:
    """Saves and resumes the run's named parts in ``format``; the fallback to the previous
    checkpoint and the run's configuration check (``run_config``: what a resume must match,
    ``{"global_batch": int, "mode": str}``, also saved in ``extra``) live here.

    >>> import tempfile, torch
    >>> from evendp._training._train_state import TrainState
    >>> path = Path(tempfile.mkdtemp()) / "ckpt.pt"
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
        step, extra = self._extra(present)
        saved = self.format.save(
            path, present, rank=self.rank, step=step, extra=extra,
            keep_previous=not self._latest_bad,
        )  # fmt: skip
        self._latest_bad = False
        return saved

    def _extra(self, parts: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """The checkpoint's ``step`` and the plain-data parts as its ``extra``."""
        step, extra = 0, {}
        for name, part in parts.items():
            if name in TENSOR_PARTS or name == "rng":
                continue
            if not isinstance(part, Stateful):
                raise TypeError(f"the checkpoint part {name!r} has no state_dict/load_state_dict")
            state = dict(part.state_dict())
            if name in _FLAT:
                step = int(state.pop("step", step))
                extra.update(state)
            else:
                extra[name] = state
        extra.update(self.run_config)
        return step, extra

    def resume(self, path: Path, parts: Mapping[str, Any]) -> list[str] | None:
        """Load the latest good checkpoint at ``path`` into ``parts``: what it restored and
        what it could not (one line each), or ``None`` when there is none (a fresh start).
        A corrupt latest one falls back to the previous; every rank calls it."""
        candidates, fetched = self.format.candidates(path)
        self.received = fetched
        if not candidates:
            return None
        present = {name: part for name, part in parts.items() if part is not None}
        distributed = self.format.collective or _distributed()
        # A mismatch with the run (CheckpointError) falls through: exit 2, no fallback.
        found, (info, said), skipped = first_good(
            candidates, lambda p: self._load(p, present, distributed)
        )
        self._latest_bad = found != path
        notes = fetched + [f"{s}; fell back to the previous checkpoint" for s in skipped]
        notes += info.get("notes", [])  # the format's own fallbacks inside one checkpoint
        notes.append(f"resumed from {found} at step {info['step']}")
        if str(found) in UNVERIFIED:
            notes.append(
                f"{found} was written by an older evendp without a checksum: loaded unverified"
            )
        return notes + said

    def _load(
        self, found: Path, parts: Mapping[str, Any], distributed: bool
    ) -> tuple[dict[str, Any], list[str]]:
        """The format's fields, then the plain-data parts, from ``found``; their notes."""
        info = self.format.load(found, parts, rank=self.rank, verify=self._check)
        return info, agreed(lambda: self._load_parts(found, parts, info), distributed)

    def _load_parts(
        self, found: Path, parts: Mapping[str, Any], info: Mapping[str, Any]
    ) -> list[str]:
        """Restore the plain-data parts from ``extra``; a part the file has none of keeps its
        fresh state (a checkpoint older than the part)."""
        extra, said = info["extra"], []
        for name, part in parts.items():
            if name in TENSOR_PARTS or name == "rng":
                continue
            saved = {**extra, "step": info["step"]} if name in _FLAT else extra.get(name)
            if saved is None:
                continue
            try:
                if not isinstance(saved, dict):
                    raise TypeError(f"must be a dict, got {type(saved).__name__}")
                note = part.load_state_dict(saved)
            except (ValueError, TypeError, KeyError) as exc:
                raise CorruptCheckpoint(
                    f"checkpoint {str(found)!r} is refused: field {name}: {exc}; {fix_for(found)}"
                ) from None
            if isinstance(note, str):
                said.append(note)
        return said

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
