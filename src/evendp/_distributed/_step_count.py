"""The step's global count, and the steps on which the loss is read for display.

Two things the Trainer needs beside the step's compute, each kept off the step's critical
path (not the samples' ``costs=``, their lengths for balancing: see :mod:`evendp._core._cost`):

- **The step's global count** of counted items (``count_fn``, e.g. non-ignored tokens) under
  DDP/FSDP2, needed before the first ``backward`` (it weights every micro-batch). Without
  ``count_fn`` it is the samples, which every rank knows from the sampler: no collective.
  With per-sample counts (``Trainer(counts=)``, :func:`sample_counts`) every rank sums them
  over the step's indices, which the sampler gives every rank alike: no collective either.
  Otherwise each rank only knows its own count: :class:`StepWeight` starts their all-reduce
  *before* the first forward, asynchronously, and waits for it only when that forward is
  done, so the collective overlaps the forward instead of stalling it.
- **The progress bar's loss.** Reading a loss is a host sync (on a GPU), and under DDP/FSDP2
  summing the ranks' parts is a collective; doing that every step only to print a number is
  what nanoGPT avoids with ``log_interval``. :func:`display_due` says on which steps the bar
  reads the loss (every ``log_every`` steps, the first and the last); every rank computes the
  same answer, so the collective pairs up. The other steps cost neither. The report and
  ``report.json`` still hold every step's exact loss: the pending parts are summed at the next
  read, a checkpoint or the report, in one collective for all of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._core._errors import EvendpError
from .._core._exact import mean_scale, step_count
from ._group import comm_device

__all__ = ["StepWeight", "display_due", "sample_counts"]


class StepWeight:
    """``world / (the step's global count)``, all-reduced while the first forward runs.

    ``value`` is a 0-dim tensor on ``device`` that holds the weight once :meth:`wait` has
    returned (call it after the forward, before the first ``backward``; later calls are free).
    The arithmetic is :mod:`evendp._core._exact`'s: the count summed in float64
    (:func:`~evendp._core._exact.step_count`), the weight :func:`~evendp._core._exact.mean_scale`
    (0 when nothing is counted anywhere).

    >>> import torch
    >>> weight = StepWeight.ready(2, torch.tensor(8.0))  # no process group: nothing to wait for
    >>> weight.wait()
    tensor(0.2500)
    """

    def __init__(self, world: int, local: torch.Tensor, device: torch.device) -> None:
        self._world = world
        self._work: dist.Work | None = None
        # Started now, waited for after the forward: the collective overlaps it.
        total = step_count(local, device=comm_device(), all_reduce=self._start)
        self._total = torch.as_tensor(total)
        self.value: torch.Tensor | float = torch.empty((), device=device)

    def _start(self, total: torch.Tensor) -> torch.Tensor:
        self._work = dist.all_reduce(total, async_op=True)
        return total

    @classmethod
    def known(cls, world: int, count: float) -> StepWeight:
        """A weight whose global count every process knows already (the samples, or
        ``Trainer(counts=)``): no collective, and its value a Python number.

        >>> StepWeight.known(2, 8).wait()
        0.25
        """
        weight = cls.__new__(cls)
        weight._world, weight._total, weight._work = world, torch.as_tensor(float(count)), None
        weight.value = float(mean_scale(count, numerator=world))
        return weight

    @classmethod
    def ready(cls, world: int, total: torch.Tensor) -> StepWeight:
        """A weight whose global count is already known (one process)."""
        weight = cls.__new__(cls)
        weight._world, weight._total, weight._work = world, total, None
        weight.value = torch.as_tensor(mean_scale(total, numerator=world))
        return weight

    def wait(self) -> torch.Tensor | float:
        """The weight, once the all-reduce is done (NCCL: the stream waits, not the host)."""
        if self._work is not None and isinstance(self.value, torch.Tensor):
            self._work.wait()
            self._work = None
            total = self._total.to(self.value.device)
            self.value.copy_(torch.as_tensor(mean_scale(total, numerator=self._world)))
        return self.value


def sample_counts(data: Any, length: int, counts: Any) -> list[float] | None:
    """``Trainer(counts=)`` as one number per sample: a sequence, or a function of ``data[i]``.

    Each sample's counted items (what ``count_fn`` counts on it alone): every rank then knows
    the step's global count from the sampler's :attr:`~evendp.UnevenBatchSampler.step_indices`,
    with no collective.

    >>> sample_counts(["ab", "c"], 2, len)
    [2.0, 1.0]
    """
    if counts is None:
        return None
    if callable(counts):
        counts = [counts(data[i]) for i in range(length)]
    values = [float(c) for c in counts]
    if len(values) != length or any(not v >= 0 for v in values):
        raise EvendpError(
            f"counts must give one count >= 0 per sample ({length} samples), got {len(values)} "
            "values; pass e.g. counts=[len(x) - 1 for x in texts] or a function of data[i]"
        )
    return values


def display_due(step: int, start: int, steps: int, every: int) -> bool:
    """Whether the progress bar reads the loss after ``step`` (1-based steps done).

    The first step of this run, every ``every``-th step and the last one; the same on every
    rank, so the reads' collective (DDP/FSDP2) pairs up.

    >>> [s for s in range(1, 26) if display_due(s, start=0, steps=25, every=10)]
    [1, 10, 20, 25]
    """
    return step == start + 1 or step % every == 0 or step == steps
