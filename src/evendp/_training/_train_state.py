"""Where a training run stands: the Trainer's bookkeeping, and one part of its saved state.

The loop only advances a :class:`TrainState` (``step``, the position in the sampler, the loss
curve, the samples each device ran). It is a ``Stateful`` part
(:mod:`evendp._training._stateful`): ``state_dict``/``load_state_dict``; the checkpointer
(:mod:`evendp._training._checkpointer`) saves and resumes it with the run's other parts.

Step losses stay on their device until someone reads them (:attr:`TrainState.losses`): the
loop never waits for the device just to record a number. Under DDP/FSDP2 each rank records
its own part of a step's loss, and :meth:`TrainState.flush` sums all pending parts over ranks
in one collective when the losses are needed (the progress bar's display steps, see
:func:`evendp._distributed._step_count.display_due`; a checkpoint; the report).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core._errors import TrainingError

__all__ = ["TrainState"]


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
    #: What the last resume restored and what it could not (for the user to read).
    notes: list[str] = field(default_factory=list)
    #: What must match on resume: ``{"global_batch": int, "mode": str}`` (set by the Trainer).
    run_config: dict[str, Any] = field(default_factory=dict)

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

    def state_dict(self) -> dict[str, Any]:
        """The run's position: ``step``, ``epoch``, ``batch_in_epoch``, ``losses``, ``samples``.

        Call :meth:`flush` first where losses are pending per rank (a collective).
        """
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "losses": self.losses,
            "samples": list(self.samples),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> str | None:
        """Continue from a saved position; per-device sample counts saved for another number
        of devices start from 0, and the note returned says so.

        >>> state = TrainState(devices=2)
        >>> state.load_state_dict({"step": 4, "epoch": 1, "losses": [2.0], "samples": [9, 7]})
        >>> state.step, state.epoch, state.batch_in_epoch, state.losses, state.samples
        (4, 1, 0, [2.0], [9, 7])
        """
        step = int(state_dict.get("step", 0))
        epoch = int(state_dict.get("epoch", 0))
        batch_in_epoch = int(state_dict.get("batch_in_epoch", 0))
        losses = [float(v) for v in state_dict.get("losses", [])]
        saved = [int(v) for v in state_dict.get("samples", [])]
        self.step, self.epoch, self.batch_in_epoch = step, epoch, batch_in_epoch
        self._losses, self._parts, self._pending = list(losses), [], []
        if len(saved) == len(self.samples):
            self.samples = saved
            return None
        self.samples = [0] * len(self.samples)
        return (
            f"the checkpoint counted samples for {len(saved)} device(s), this run has "
            f"{len(self.samples)}: per-device sample counts start from 0"
        )
