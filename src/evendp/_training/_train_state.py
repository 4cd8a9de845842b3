"""Where a training run stands, and how it is saved and resumed: the Trainer's bookkeeping.

The loop only advances a :class:`TrainState` (``step``, the position in the sampler, the loss
curve, the samples each device ran); writing it into a checkpoint and reading it back lives
here, next to :mod:`evendp._training._checkpoint`, which owns the file format.

Step losses stay on their device until someone reads them (:attr:`TrainState.losses`): the
loop never waits for the device just to record a number. Under DDP/FSDP2 each rank records
its own part of a step's loss, and :meth:`TrainState.flush` sums all pending parts over ranks
in one collective when the losses are needed (the progress bar's display steps, see
:func:`evendp._distributed._step_count.display_due`; a checkpoint; the report).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._core._errors import CheckpointError, TrainingError
from .._distributed._rank_errors import agreed
from ._checkpoint import (
    UNVERIFIED,
    CorruptCheckpoint,
    load_checkpoint,
    load_rank_rng,
    load_sharded_checkpoint,
    read_state_file,
    save_checkpoint,
    save_rank_rng,
    save_sharded_checkpoint,
)
from ._checkpoint import previous_path as _previous
from ._oom import OomResplit

__all__ = ["TrainState"]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@dataclass
class TrainState:
    """The position of a run: optimizer steps done, epoch and batch within it, losses, samples.

    ``batch_in_epoch`` counts the batches of ``epoch`` already *trained* (not merely prepared
    by a prefetching loader), so a resume skips exactly those.

    >>> state = TrainState(devices=2)
    >>> state.record(torch.tensor(0.5), [3, 1])
    >>> state.losses, state.samples
    ([0.5], [3, 1])
    """

    devices: int
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: list[int] = field(default_factory=list)
    _losses: list[float | torch.Tensor] = field(default_factory=list)
    _parts: list[torch.Tensor] = field(default_factory=list)
    # Per pending part: the samples each device ran and the step's skip flag (device, unread).
    _pending: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    #: What the last :meth:`resume` restored and what it could not (for the user to read).
    notes: list[str] = field(default_factory=list)
    #: What must match on resume: ``{"global_batch": int, "mode": str}`` (set by the Trainer).
    run_config: dict[str, Any] = field(default_factory=dict)
    #: The file at the checkpoint path is not a good checkpoint (a resume fell back past it):
    #: the next save replaces it without rotating it over the good previous one.
    _latest_bad: bool = False

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [0] * self.devices

    @property
    def losses(self) -> list[float]:
        """The step losses as floats (reading them waits for the device, once per value)."""
        self._losses = [float(v) for v in self._losses]
        return list(self._losses)  # type: ignore[arg-type]

    def record(
        self,
        loss: torch.Tensor | float | None,
        ran: list[int],
        local: bool = False,
        skipped: torch.Tensor | bool = False,
    ) -> None:
        """One step done: its loss (``None``: skipped, not recorded) and each device's samples.

        ``local``: the loss is this rank's part only; :meth:`flush` sums the parts over ranks.
        ``skipped``: the non-finite gate's flag, a device tensor read only at :meth:`flush`;
        a skipped step's loss and samples are then dropped.
        """
        if loss is None or (isinstance(skipped, bool) and skipped):
            # Skipped on the host's knowledge: no loss, no samples (ran is zeros then).
            self.samples = [a + b for a, b in zip(self.samples, ran, strict=True)]
            return
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        if not local:
            self._flush_order_check()
            self._losses.append(value)
            self.samples = [a + b for a, b in zip(self.samples, ran, strict=True)]
            return
        flag = skipped if isinstance(skipped, torch.Tensor) else torch.zeros(())
        self._parts.append(torch.as_tensor(value).float())
        self._pending.append((ran, flag))

    def _flush_order_check(self) -> None:
        if self._parts:  # a global loss after local parts: the parts must be summed first
            raise TrainingError("TrainState.flush() was not called before a global loss")

    def flush(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the pending per-rank parts over ranks, all in one ``reduce`` call (collective),
        and read their skip flags (one host read): a skipped step keeps no loss or samples."""
        if not self._parts:
            return
        summed = reduce(torch.stack(self._parts))  # (pending steps,)
        flags = torch.stack([f.to(summed.device).float() for _, f in self._pending]).tolist()
        for loss, (ran, _), skipped in zip(summed.unbind(), self._pending, flags, strict=True):
            if not skipped:
                self._losses.append(loss)
                self.samples = [a + b for a, b in zip(self.samples, ran, strict=True)]
        self._parts, self._pending = [], []

    @property
    def last_loss(self) -> float:
        """The latest recorded (global) loss, read from the device now."""
        return float(self._losses[-1])

    def _extra(self, guard: OomResplit) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "losses": self.losses,
            "samples": self.samples,
            "micro_batch_sizes": guard.micro_batch_sizes,
            "resplits": guard.resplits,
            "skipped": guard.skipped,
            **self.run_config,
        }

    def save(
        self,
        path: Path,
        *,
        rank: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        scheduler: Any | None,
        guard: OomResplit,
        sharded: bool = False,
    ) -> Path | None:
        """Write the checkpoint at ``path`` for this step.

        DDP and one process: rank 0 writes ``ckpt.pt`` and every other rank only its own RNG
        (no collective). ``sharded`` (FSDP2): a collective DCP save in which every rank writes
        its shards and its RNG into the ``ckpt.dcp`` folder.
        """
        states: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scaler": scaler,
            "scheduler": scheduler,
        }
        extra = self._extra(guard)
        if sharded:
            keep = not self._latest_bad
            saved_dir = save_sharded_checkpoint(
                path, **states, step=self.step, extra=extra, keep_previous=keep
            )
            self._latest_bad = False
            return saved_dir
        distributed = _distributed()

        def write() -> Path | None:
            if rank != 0:
                save_rank_rng(path, rank, self.step)
                return None
            keep = not self._latest_bad
            return save_checkpoint(path, **states, step=self.step, extra=extra, keep_previous=keep)

        saved = agreed(write, distributed)  # a failed write on one rank stops every rank
        self._latest_bad = False
        return saved

    def resume(
        self,
        path: Path,
        *,
        rank: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        scheduler: Any | None,
        guard: OomResplit,
        sharded: bool = False,
        reseed: int | None = None,
    ) -> bool:
        """Load the latest good checkpoint at ``path``; ``False`` (a fresh start) if none.

        Every rank gets its own RNG state back (``reseed`` with a warning when the run was
        saved without this rank). What does not fit this run (another number of devices) is
        left at its fresh value and said in :attr:`notes`.
        """
        candidates = [p for p in (path, _previous(path)) if p.exists()]
        if not candidates:
            return False
        states: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scaler": scaler,
            "scheduler": scheduler,
        }
        distributed = sharded or _distributed()

        def load(found: Path) -> dict[str, Any]:
            if sharded:
                meta = agreed(lambda: read_state_file(found), True)
                agreed(lambda: self._check_run_config(found, meta.get("extra") or {}), True)
                return load_sharded_checkpoint(found, **states, reseed=reseed)
            info = agreed(lambda: self._load_one(found, states), distributed)

            def own_rng() -> None:
                if rank != 0:  # load_checkpoint restored rank 0's generators
                    load_rank_rng(found, rank, info["step"], reseed=reseed)

            agreed(own_rng, distributed)  # every rank joins: a garbled file stops all
            return info

        skipped: list[str] = []
        for found in candidates:
            try:
                info = load(found)
                break
            except CorruptCheckpoint as exc:  # a mismatch with the run falls through: exit 2
                if found == candidates[-1]:
                    last = str(exc)
                    said = [x for x in skipped if not last.startswith(x)]  # each fault once
                    raise CorruptCheckpoint(" and ".join([*said, last])) from None
                skipped.append(str(exc).split(";")[0])
        self._latest_bad = found != path
        extra = info["extra"]
        self.step = info["step"]
        self.notes = [*(f"{s}; fell back to the previous checkpoint" for s in skipped)]
        self.notes.append(f"resumed from {found} at step {self.step}")
        if str(found) in UNVERIFIED:
            self.notes.append(
                f"{found} was written by an older evendp without a checksum: loaded unverified"
            )
        self.epoch = int(extra.get("epoch", 0))
        self.batch_in_epoch = int(extra.get("batch_in_epoch", 0))
        self._losses = [float(v) for v in extra.get("losses", [])]
        saved = [int(v) for v in extra.get("samples", [])]
        if len(saved) == len(self.samples):
            self.samples = saved
        else:
            self.notes.append(
                f"the checkpoint counted samples for {len(saved)} device(s), this run has "
                f"{len(self.samples)}: per-device sample counts start from 0"
            )
        caps = extra.get("micro_batch_sizes")
        if isinstance(caps, list) and len(caps) == len(guard.micro_batch_sizes):
            guard.micro_batch_sizes = [None if c is None else int(c) for c in caps]
        elif isinstance(caps, list) and any(c is not None for c in caps):
            self.notes.append("the saved OOM micro-batch caps are per device: not applied here")
        guard.resplits = int(extra.get("resplits", 0))
        guard.skipped = int(extra.get("skipped", 0))
        return True

    def _load_one(self, found: Path, states: dict[str, Any]) -> dict[str, Any]:
        """Verify ``found`` against this run's configuration, then load it."""
        return load_checkpoint(found, **states, verify=self._check_run_config)

    def _check_run_config(self, found: Path, saved: dict[str, Any]) -> None:
        ours, theirs = self.run_config.get("global_batch"), saved.get("global_batch")
        if ours is not None and theirs is not None and int(ours) != int(theirs):
            raise CheckpointError(
                f"checkpoint {str(found)!r} was trained with a global batch of {theirs}, this "
                f"run has {ours}: resuming would change the order of the remaining samples; "
                f"resume with the same global batch (--batch {theirs}), or start fresh with "
                "another --out"
            )
