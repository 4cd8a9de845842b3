"""Per-rank batches of different sizes for DDP/FSDP2: a thin iterator over the epoch's layout,
a pure function of (seed, epoch, sizes, costs, caps) every rank computes alike
(:mod:`._step_layout`). The sampler holds the epoch and the sizes; it needs no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._step_layout import EpochSteps, StepLayout, checked_sizes, sampler_inputs

__all__ = ["UnevenBatchSampler"]


class UnevenBatchSampler:
    """Batch sampler for DDP/FSDP2 where rank ``r`` takes ``batch_sizes[r]`` samples per step.

    Every rank yields ``ceil(len / sum(batch_sizes))`` batches (the floor with ``drop_last``),
    each index once per epoch, the last step split in proportion (a batch may be empty).
    ``costs`` (per sample, or a function of ``data[i]``) gives a step's indices to ranks so
    each one's padded cost follows ``batch_sizes``; ``group_steps=k`` sorts ``k`` steps by
    cost; ``max_costs`` caps each rank's cost; ``max_tokens`` makes each step a token budget.
    ``rank``/``world_size`` come from the process group only when ``None``. Use it as
    ``DataLoader(data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))``.

    >>> UnevenBatchSampler(10, [1, 3], rank=0, shuffle=False)
    UnevenBatchSampler(10, batch_sizes=[1, 3], rank=0)
    >>> [list(UnevenBatchSampler(10, [1, 3], rank=r, shuffle=False)) for r in range(2)]
    [[[0], [4], [8]], [[1, 2, 3], [5, 6, 7], [9]]]
    >>> lengths = [9, 1, 1, 9, 2, 2, 8, 1]
    >>> [list(UnevenBatchSampler(8, [2, 2], r, shuffle=False, costs=lengths)) for r in (0, 1)]
    [[[1, 2], [4, 5, 7]], [[0, 3], [6]]]
    """

    def __init__(
        self,
        data: object,
        batch_sizes: Sequence[int],
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        costs: Sequence[float] | Callable[[Any], float] | None = None,
        padded: bool = True,
        group_steps: int = 1,
        max_costs: Sequence[float] | None = None,
        max_tokens: float | None = None,
    ) -> None:
        self.rank, self._sizes, self._draw = sampler_inputs(
            data, batch_sizes, rank, world_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            costs=costs, padded=padded, group_steps=group_steps, max_costs=max_costs,
            max_tokens=max_tokens,
        )  # fmt: skip
        self.world_size = len(self._sizes)
        self.num_samples, self.costs = self._draw.num_samples, self._draw.costs
        self._steps = EpochSteps(self._draw, 0)  # the epoch's walk: its drawn steps kept

    @property
    def epoch(self) -> int:
        """The epoch the sampler draws (:meth:`set_epoch`)."""
        return self._steps.epoch

    @property
    def batch_sizes(self) -> list[int]:
        """The per-rank batch sizes in force for the next step (a copy)."""
        return list(self._sizes)

    @property
    def batch_size(self) -> int:
        """This rank's share of a full step, as torch's ``BatchSampler.batch_size`` means.

        >>> sampler = UnevenBatchSampler(100, [3, 5], rank=1, world_size=2)
        >>> sampler.batch_size, sampler.global_batch_size
        (5, 8)
        """
        return self._sizes[self.rank]

    @property
    def global_batch_size(self) -> int:
        """Samples per full step over all ranks, ``sum(batch_sizes)``: the global batch."""
        return sum(self._sizes)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: call it with the same value on every rank before iterating."""
        self._steps = EpochSteps(self._draw, epoch)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """New per-rank sizes from the next step drawn on (the same on every rank at the same
        step; a loader with workers draws steps ahead): ``on_resplit=sampler.set_batch_sizes``.

        >>> s = UnevenBatchSampler(10, [2, 2], rank=0, shuffle=False); it = iter(s)
        >>> next(it), s.set_batch_sizes([1, 5]), list(it), len(s)
        ([0, 1], None, [[4]], 2)
        """
        self._sizes = checked_sizes(self._draw, batch_sizes, self.world_size)

    @property
    def step_indices(self) -> list[int]:
        """The step last yielded over every rank, rank by rank: the same on every rank.

        >>> sampler = UnevenBatchSampler(6, [1, 2], rank=0, world_size=2, shuffle=False)
        >>> next(iter(sampler)), sampler.step_indices
        ([0], [0, 1, 2])
        """
        return list(self._steps.recent[-1].indices) if self._steps.recent else []

    def layout(self, step: int) -> StepLayout:
        """Step ``step``'s (0-based, of the epoch being iterated) layout over every rank.

        >>> s = UnevenBatchSampler(5, [1, 2], rank=0, shuffle=False)
        >>> [s.layout(step).rank_rows for step, _ in enumerate(s)]
        [(1, 2), (1, 1)]
        """
        return self._steps.layout(step)

    def sizes_in_step(self, step: int) -> list[int]:
        """Every rank's sample count in step ``step`` (0-based) of the epoch being iterated.

        >>> s = UnevenBatchSampler(8, [2, 2], rank=0, shuffle=False, costs=[5, 1, 1, 1, 1, 5, 5, 1])
        >>> [(batch, s.sizes_in_step(step)) for step, batch in enumerate(s)]
        [([0], [1, 3]), ([4, 7], [2, 2])]
        """
        return self._steps.sizes(step)

    def samples_in_step(self, step: int) -> int:
        """Samples over all ranks in step ``step``: :func:`ddp_loss`'s ``global_count`` for a
        per-sample loss, with no communication (``ddp_loss(s, len(y), samples_in_step(k))``).

        >>> s = UnevenBatchSampler(10, [1, 3], rank=0)
        >>> [s.samples_in_step(step) for step, _ in enumerate(s)]
        [4, 4, 2]
        """
        return sum(self._steps.sizes(step))

    def __iter__(self) -> Iterator[list[int]]:
        for layout in self.layouts():
            yield layout.rank_indices(self.rank)

    def layouts(self) -> Iterator[StepLayout]:
        """The epoch's steps, each's layout over every rank (what :meth:`__iter__` cuts).

        >>> [layout.rank_rows for layout in UnevenBatchSampler(5, [1, 2], rank=0).layouts()]
        [(1, 2), (1, 1)]
        """
        self._steps = steps = EpochSteps(self._draw, self.epoch)
        # The sizes are read at every step: set_batch_sizes takes effect at the next one.
        while (layout := steps.next(self._sizes)) is not None:
            yield layout

    def __len__(self) -> int:
        return self._steps.length(self._sizes)

    def __repr__(self) -> str:
        name, sizes = type(self).__name__, self._sizes
        return f"{name}({self.num_samples}, batch_sizes={sizes}, rank={self.rank})"
