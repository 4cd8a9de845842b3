"""Who trains which rows of a step, decided in one place: the step's layout.

A :class:`StepLayout` says, for one step, which samples each rank takes and how each rank's
share falls on its devices. :func:`layout_step` builds it from data every rank holds alike (the
epoch's permutation, the batch plan's sizes, the samples' costs and the caps), so every rank
computes the same value with no communication: the sampler yields its rank's part of it, the
Trainer adds the devices (:meth:`StepLayout.on_devices`) and reads the step's global count
from it. The OOM guard cuts each device's rows into micro-steps with :func:`micro_spans`; how
many micro-steps a step runs is the one thing a rank cannot know alone (it depends on every
rank's OOM caps), so the ranks agree on it in one all-reduce and :func:`pad_micro_steps` pads
to it.

    plan (sizes, caps) --\\
    permutation, cursor --+--> layout_step --> StepLayout --on_devices--> rows per device
    costs, max_costs ----/                                   |
                                     OOM caps --> micro_spans --> pad_micro_steps (agreed count)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._core._cost import split_by_cost
from .._core._split import split_sizes

__all__ = ["StepLayout", "layout_step", "micro_spans", "pad_micro_steps"]

#: Per micro-step, each device's span ``[start, stop)`` of its own rows.
MicroPlan = list[list[tuple[int, int]]]


@dataclass(frozen=True)
class StepLayout:
    """One step's samples, rank by rank and, within a rank, device by device.

    ``indices`` are the step's dataset indices over every rank; rank ``r`` takes the slice of
    ``sum(rows[r])`` of them after the ranks before it, its device ``d`` the ``rows[r][d]``
    after its devices before ``d``. Immutable, and the same value on every rank.

    >>> layout = layout_step([7, 3, 5, 1, 0], [1, 4])
    >>> layout.rank_rows, layout.rank_indices(1), layout.samples
    ((1, 4), [3, 5, 1, 0], 5)
    >>> two = layout.on_devices(lambda n: [n - n // 2, n // 2])
    >>> two.rows, two.rank_indices(1)
    (((1, 0), (2, 2)), [3, 5, 1, 0])
    """

    indices: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]

    @property
    def samples(self) -> int:
        """The step's samples over every rank: its global batch (short at an epoch's end)."""
        return len(self.indices)

    @property
    def rank_rows(self) -> tuple[int, ...]:
        """Every rank's samples in this step."""
        return tuple(sum(devices) for devices in self.rows)

    def rank_indices(self, rank: int) -> list[int]:
        """Rank ``rank``'s samples, device by device."""
        start = sum(self.rank_rows[:rank])
        return list(self.indices[start : start + self.rank_rows[rank]])

    def device_rows(self, rank: int) -> list[int]:
        """Rank ``rank``'s rows on each of its devices."""
        return list(self.rows[rank])

    def count(self, counts: Sequence[float]) -> float:
        """The step's counted items over every rank from per-sample ``counts`` (e.g. each
        sample's non-ignored tokens): the global count, with no communication."""
        return float(sum(counts[i] for i in self.indices))

    def on_devices(
        self,
        capacities: Callable[[int], list[int]],
        costs: Sequence[float] | None = None,
        max_costs: Sequence[float] | None = None,
    ) -> StepLayout:
        """Each rank's share over its devices: ``capacities(n)`` rows each (the devices'
        weights), or with ``costs`` by padded cost with those capacities
        (:func:`~evendp._core._cost.split_by_cost`, ``max_costs`` capping each device)."""
        if costs is None:  # by weights: the indices keep their order, only the rows change
            rows_by_weight = tuple(tuple(capacities(n)) for n in self.rank_rows)
            if rows_by_weight == self.rows:  # one device per rank: this very layout
                return self
            return StepLayout(self.indices, rows_by_weight)
        indices: list[int] = []
        rows: list[tuple[int, ...]] = []
        for rank in range(len(self.rows)):
            mine = self.rank_indices(rank)
            room = capacities(len(mine))
            # A rank with no rows has nothing to balance (and every capacity is 0).
            balance = costs is not None and bool(mine) and (len(room) > 1 or max_costs is not None)
            if not balance:
                indices += mine
                rows.append(tuple(room))
                continue
            assert costs is not None  # for mypy: balance implies costs
            shares = split_by_cost([costs[i] for i in mine], room, max_costs=max_costs)
            indices += [mine[j] for share in shares for j in share]
            rows.append(tuple(len(share) for share in shares))
        return StepLayout(tuple(indices), tuple(rows))


def layout_step(
    step: Sequence[int],
    sizes: Sequence[int],
    *,
    costs: Sequence[float] | None = None,
    padded: bool = True,
    max_costs: Sequence[float] | None = None,
) -> StepLayout:
    """The layout of a step of the indices ``step`` over ranks planned at ``sizes`` each.

    By count, rank ``r`` takes ``sizes[r]`` in rank order (a short last step is split in
    proportion). With ``costs`` (one per sample of the dataset), the step's samples go to
    ranks so each rank's padded cost follows its size (``max_costs``: each rank's cap), and
    a rank may hold more or fewer samples than its size. One device per rank.

    >>> layout_step([0, 1, 2, 3, 4], [2, 3]).rows
    ((2,), (3,))
    >>> layout_step([0, 1, 2], [2, 3]).rows  # an epoch's short last step
    ((1,), (2,))
    >>> layout_step([0, 1, 2, 3], [2, 2], costs=[9, 1, 1, 9]).rank_indices(0)
    [1, 2]
    """
    if costs is not None:
        shares = split_by_cost(
            [costs[i] for i in step], list(sizes), padded=padded, max_costs=max_costs
        )
        order = [step[j] for share in shares for j in share]
        return StepLayout(tuple(order), tuple((len(share),) for share in shares))
    counts = list(sizes) if len(step) == sum(sizes) else split_sizes(len(step), list(sizes))
    return StepLayout(tuple(step), tuple((n,) for n in counts))


def micro_spans(rows: Sequence[int], sizes: Sequence[int]) -> MicroPlan:
    """A device's rows cut into micro-steps of at most ``sizes[d]`` each: per micro-step,
    every device's span of its own rows (empty once its rows are done).

    >>> micro_spans([3, 1], [2, 1])
    [[(0, 2), (0, 1)], [(2, 3), (1, 1)]]
    """
    steps = max((math.ceil(n / z) for n, z in zip(rows, sizes, strict=True) if n), default=0)
    return [
        [(min(k * z, n), min((k + 1) * z, n)) for n, z in zip(rows, sizes, strict=True)]
        for k in range(steps)
    ]


def pad_micro_steps(plan: MicroPlan, rows: Sequence[int], steps: int) -> MicroPlan:
    """``plan`` with empty micro-steps appended up to ``steps``, the count the ranks agreed:
    under DDP or FSDP2 every rank runs as many forward and backward passes as the others.

    >>> pad_micro_steps([[(0, 2)]], [2], 3)
    [[(0, 2)], [(2, 2)], [(2, 2)]]
    """
    return plan + [[(n, n) for n in rows] for _ in range(steps - len(plan))]
