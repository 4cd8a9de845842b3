"""The first real step against the plan, checked from outside the step: after it, a device
whose reserved peak (:mod:`._peak_memory`) is over its plan has its micro-batch cap lowered
(:class:`~evendp._planning._on_device.FirstStepCheck`, the cap an OOM re-split lowers) before it
runs out, said in one line. The shares and the gradient are unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._planning._on_device import FirstStepCheck
from . import _peak_memory

__all__ = ["FirstStepWatch", "first_step_watch"]

#: Per device, the reserved peak since the run's start (``None``: nothing to read).
PeakReader = Callable[[list[torch.device]], list[int | None]]


class FirstStepWatch:
    """An ``on_step_end`` hook, once: the first step's reserved peaks against ``planned``.

    ``read`` is :func:`._peak_memory.device_peaks` unless given (tests inject figures, or a
    reader that fails: the run goes on unchecked and says so in one line).
    """

    def __init__(
        self, planned: Sequence[int], budgets: Sequence[int], read: PeakReader | None = None
    ) -> None:
        self.check = FirstStepCheck(planned, budgets)
        self.read = read
        self.done = False
        self.caps: list[int | None] = []

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self.done:
            return
        self.done = True
        devices = list(trainer.strategy.devices)
        samples = [sum(c) for c in zip(*trainer.micro_steps, strict=True)]
        if not samples:  # the step was skipped: nothing ran to compare
            return
        read = self.read or _peak_memory.device_peaks
        try:
            peaks = read(devices)
        except Exception as exc:  # a failed read must not stop a run the OOM guard protects
            _say(f"evendp: the first step's memory was not checked: {type(exc).__name__}: {exc}")
            return
        self.caps = self.check.check(peaks, samples)
        self.check.apply(self.caps, trainer.guard.micro_batch_sizes)
        for line in self.check.notes:
            _say(line)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def first_step_watch(devices: Sequence[torch.device], world: int = 1) -> FirstStepWatch | None:
    """The watch for ``devices`` when each is a CUDA device this process planned on live
    memory (one each: replicas sharing a GPU read one figure), else ``None``. One process
    only (``world`` 1): a rank's own cap would change its micro-step count alone, which
    FSDP2's and DeepSpeed's collectives per micro-step cannot follow (and the OOM guard's
    agreement of caps across ranks is not wired to this check).

    >>> first_step_watch([torch.device("cpu")]) is None
    True
    """
    from .._planning._on_device import planned_for

    if world != 1 or len(set(devices)) != len(devices) or any(d.type != "cuda" for d in devices):
        return None
    planned = [planned_for(f"cuda:{d.index if d.index is not None else 0}") for d in devices]
    if any(p is None for p in planned):
        return None
    return FirstStepWatch([p[0] for p in planned if p], [p[1] for p in planned if p])
