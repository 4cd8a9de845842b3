"""Who trains which rows of which step, decided in one place: the layout.

An epoch's steps are a pure function of (seed, epoch, sizes, costs, caps) that every rank
computes alike, with no communication: one order (:func:`epoch_order`, seeded by
``seed + epoch``) walked with one cursor (:class:`EpochSteps`; :class:`Draw` holds the
sampler's options); each step takes ``sum(sizes)`` indices (or a token budget's:
:func:`step_length`), laid out over the ranks by :func:`layout_step` as a :class:`StepLayout`
(each rank's samples; :meth:`StepLayout.on_devices`: each rank's rows on its devices). A
step's rows run as micro-steps cut by :func:`micro_plan` (the accumulation's and the OOM
guard's caps, padded to the strategy's floor).

    plan (sizes, caps) --\\
    permutation, cursor --+--> layout_step --> StepLayout --on_devices--> rows per device
    costs, max_costs ----/                                                     |
                     accumulation, OOM caps, floor --> micro_plan --> micro-steps' spans
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._core._cost import (
    budget_step_length,
    sample_costs,
    split_by_cost,
    validate_caps,
    validate_costs,
)
from .._core._errors import EvendpError
from .._core._split import split_sizes
from .._core._validate import is_int, shown, validate_bool, validate_int, validate_numbers
from ._batch_plan import validate_batch_plan

__all__ = [
    "KEPT_LAYOUTS",
    "Draw",
    "EpochSteps",
    "StepLayout",
    "checked_sizes",
    "epoch_order",
    "layout_step",
    "micro_plan",
    "micro_spans",
    "pad_micro_steps",
    "sampler_inputs",
    "step_length",
]

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
    #: Every rank's samples in this step.
    rank_rows: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: The step's samples over every rank: its global batch (short at an epoch's end).
    samples: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_rows", tuple(map(sum, self.rows)))
        object.__setattr__(self, "samples", len(self.indices))

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
    _validate_layout_inputs(step, sizes, costs, padded, max_costs)
    return _layout(step, sizes, costs, padded, max_costs)


def _layout(
    step: Sequence[int],
    sizes: Sequence[int],
    costs: Sequence[float] | None,
    padded: bool,
    max_costs: Sequence[float] | None,
) -> StepLayout:
    """:func:`layout_step` on values evendp checked already (the sampler's, every step)."""
    if costs is not None:
        shares = split_by_cost(
            [costs[i] for i in step], list(sizes), padded=padded, max_costs=max_costs
        )
        order = [step[j] for share in shares for j in share]
        return StepLayout(tuple(order), tuple((len(share),) for share in shares))
    counts = list(sizes) if len(step) == sum(sizes) else split_sizes(len(step), list(sizes))
    return StepLayout(tuple(step), tuple((n,) for n in counts))


def micro_plan(
    rows: Sequence[int], accum: int, caps: Sequence[int | None], min_steps: int = 0
) -> MicroPlan:
    """How a step's rows run as micro-steps, decided here for the Trainer and the OOM guard:
    each device's rows cut into pieces of at most ``ceil(rows / accum)`` (the accumulation's)
    and ``caps[d]`` (an OOM's, ``None``: none), then padded with empty micro-steps up to
    ``min_steps`` (every rank must run as many when collectives run inside them).

    >>> micro_plan([3, 1], 1, [2, None]), micro_plan([4], 2, [None], min_steps=3)
    ([[(0, 2), (0, 1)], [(2, 3), (1, 1)]], [[(0, 2)], [(2, 4)], [(4, 4)]])
    """
    pairs = zip(rows, caps, strict=True)
    plan = micro_spans(rows, [min(math.ceil(n / accum), cap or n) for n, cap in pairs])
    return plan if len(plan) >= min_steps else pad_micro_steps(plan, rows, min_steps)


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


#: Steps whose whole layout an epoch's walk keeps: a loader's workers sample num_workers *
#: prefetch_factor steps ahead (16 with 8 workers), the training loop reads the current one.
KEPT_LAYOUTS = 64


@dataclass(frozen=True, eq=False)
class Draw:
    """How an epoch's samples are drawn into steps: fixed for a sampler's life, the same on
    every rank. Build it with :meth:`checked` (the boundary's checks).

    >>> draw = Draw.checked(10, [1, 3], shuffle=False)
    >>> order = epoch_order(draw, 0, 4)
    >>> step_length(draw, order, 8, 4), layout_step(order[8:10], [1, 3]).rank_rows
    (2, (1, 1))
    """

    num_samples: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    costs: list[float] | None = None
    padded: bool = True
    group_steps: int = 1
    max_costs: list[float] | None = None
    max_tokens: float | None = None

    @classmethod
    def checked(
        cls,
        data: object,
        sizes: list[int],
        *,
        shuffle: object = True,
        seed: int = 0,
        drop_last: object = False,
        costs: object = None,
        padded: object = True,
        group_steps: object = 1,
        max_costs: Sequence[float] | None = None,
        max_tokens: object = None,
    ) -> Draw:
        """The draw of ``data`` at ``sizes`` (one per rank), each option checked."""
        validate_flags(shuffle, seed, drop_last, padded)
        length = _validate_length(data)
        validate_coverage(length, sizes, bool(drop_last))
        # Computed once, identically on every rank (the data and the function are the same).
        values = sample_costs(data, length, costs)
        steps = _validate_group_steps(group_steps, values)
        return cls(
            length, bool(shuffle), int(seed), bool(drop_last), values, bool(padded), steps,
            _validate_max_costs(max_costs, values, len(sizes)),
            _validate_max_tokens(max_tokens, values, bool(drop_last), steps),
        )  # fmt: skip


def epoch_order(draw: Draw, epoch: int, global_batch: int) -> list[int]:
    """The epoch's order of the indices: the same on every rank (one generator, one seed)."""
    generator = torch.Generator()
    generator.manual_seed(draw.seed + epoch)
    if not draw.shuffle:
        order = list(range(draw.num_samples))
    else:
        order = torch.randperm(draw.num_samples, generator=generator).tolist()
    if draw.group_steps > 1:
        order = _grouped(draw, order, global_batch, generator)
    return order


def _grouped(draw: Draw, order: list[int], step: int, generator: torch.Generator) -> list[int]:
    """Sort each window of ``group_steps`` steps by cost, cut it into steps, shuffle them.

    Steps of similar lengths pad little (as ``group_by_length`` in transformers); the
    full steps of a window are shuffled so lengths do not grow along the epoch, and the
    epoch's short last step stays last. Still a permutation: each index once per epoch.
    """
    costs, window = draw.costs, step * draw.group_steps
    assert costs is not None  # _validate_group_steps: grouping needs costs
    out: list[int] = []
    for start in range(0, len(order), window):
        ranked = sorted(order[start : start + window], key=lambda i: (costs[i], i))
        steps = [ranked[k : k + step] for k in range(0, len(ranked), step)]
        full = [s for s in steps if len(s) == step]
        shuffled = torch.randperm(len(full), generator=generator).tolist()
        out += [i for k in shuffled for i in full[k]]
        out += [i for s in steps if len(s) < step for i in s]
    return out


def step_length(draw: Draw, order: Sequence[int], cursor: int, global_batch: int) -> int:
    """Indices the step at ``cursor`` takes: the global batch, or what the token budget
    holds; 0 when the epoch has no further step."""
    remaining = len(order) - cursor
    if remaining <= 0 or (draw.drop_last and remaining < global_batch):
        return 0
    if draw.max_tokens is None:
        return min(remaining, global_batch)
    assert draw.costs is not None  # _validate_max_tokens: a budget needs costs
    return budget_step_length(draw.costs, order, draw.max_tokens, cursor)


def _steps(remaining: int, global_batch: int, drop_last: bool) -> int:
    """Steps needed for ``remaining`` indices at ``global_batch`` per step."""
    if remaining <= 0:
        return 0
    return remaining // global_batch if drop_last else math.ceil(remaining / global_batch)


class EpochSteps:
    """One epoch's steps, drawn one at a time at the sizes in force when each is drawn, and
    kept: every step's rows, the last :data:`KEPT_LAYOUTS` layouts (an epoch's whole layouts
    would be a second copy of its permutation).

    >>> walk = EpochSteps(Draw.checked(5, [1, 2], shuffle=False), epoch=0)
    >>> walk.next([1, 2]).rank_rows, walk.next([1, 2]).rank_rows, walk.next([1, 2])
    ((1, 2), (1, 1), None)
    >>> walk.sizes(1), walk.layout(0).indices
    ([1, 1], (0, 1, 2))
    """

    def __init__(self, draw: Draw, epoch: int) -> None:
        self.draw, self.epoch = draw, int(epoch)
        self.rows: list[tuple[int, ...]] = []
        self.recent: collections.deque[StepLayout] = collections.deque(maxlen=KEPT_LAYOUTS)
        self._order: list[int] | None = None
        self._cursor: int | None = None  # indices drawn in the running walk; None: not running
        self._budget_steps: int | None = None

    def next(self, sizes: list[int]) -> StepLayout | None:
        """The next step's layout at ``sizes``, or ``None`` at the epoch's end."""
        if self._order is None:
            self._order = epoch_order(self.draw, self.epoch, sum(sizes))
        cursor = self._cursor or 0
        taken = step_length(self.draw, self._order, cursor, sum(sizes))
        if not taken:
            self._cursor = None
            return None
        try:
            layout = _layout(
                self._order[cursor : cursor + taken], sizes, self.draw.costs,
                self.draw.padded, self.draw.max_costs,
            )  # fmt: skip
        except EvendpError as err:
            raise EvendpError(
                f"step {len(self.rows)} of epoch {self.epoch} does not fit max_costs: {err}"
            ) from None
        self._cursor = cursor + taken
        self.rows.append(layout.rank_rows)
        self.recent.append(layout)
        return layout

    def length(self, sizes: list[int]) -> int:
        """Steps in the epoch: those drawn in a running walk plus the rest at ``sizes``."""
        if self.draw.max_tokens is not None:  # the budget's cuts do not depend on the sizes
            if self._budget_steps is None:
                order, steps, cursor = epoch_order(self.draw, self.epoch, sum(sizes)), 0, 0
                while taken := step_length(self.draw, order, cursor, sum(sizes)):
                    steps, cursor = steps + 1, cursor + taken
                self._budget_steps = steps
            return self._budget_steps
        drawn, cursor = (0, 0) if self._cursor is None else (len(self.rows), self._cursor)
        return drawn + _steps(self.draw.num_samples - cursor, sum(sizes), self.draw.drop_last)

    def sizes(self, step: int) -> list[int]:
        """Every rank's samples in step ``step`` (0-based) of this epoch."""
        validate_int("step", step, minimum=0)
        if step >= len(self.rows):
            raise EvendpError(
                f"step {step} has not been sampled yet this epoch (steps 0 to "
                f"{len(self.rows) - 1} have); count steps from 0 in each epoch, "
                "e.g. `for step, batch in enumerate(loader)`"
            )
        return list(self.rows[step])

    def layout(self, step: int) -> StepLayout:
        """Step ``step``'s layout, while it is among the last kept."""
        self.sizes(step)  # the step was drawn
        first_kept = len(self.rows) - len(self.recent)
        if step < first_kept:
            raise EvendpError(
                f"step {step}'s layout is no longer kept (the last {KEPT_LAYOUTS} steps' are, "
                f"from step {first_kept}); read it when its batch arrives, or its sizes with "
                "sizes_in_step(step)"
            )
        return self.recent[step - first_kept]


# ---------------------------------------------------------------------------------------------
# Validation at the boundary


def sampler_inputs(
    data: object, batch_sizes: object, rank: int | None, world_size: int | None, **options: Any
) -> tuple[int, list[int], Draw]:
    """A sampler's rank, per-rank sizes and :class:`Draw`, each checked at the boundary."""
    validate_flags(*(options[k] for k in ("shuffle", "seed", "drop_last", "padded")))
    rank, world_size = default_rank_and_world(rank, world_size)
    sizes = validate_batch_plan(batch_sizes, None, world_size)[0]
    validate_rank(rank, len(sizes))
    return rank, sizes, Draw.checked(data, sizes, **options)


def checked_sizes(draw: Draw, batch_sizes: object, world_size: int) -> list[int]:
    """New per-rank sizes for a sampler of ``draw``, checked as its first were."""
    sizes = validate_batch_plan(batch_sizes, None, world_size)[0]
    validate_coverage(draw.num_samples, sizes, draw.drop_last)
    return sizes


def default_rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int | None]:
    """Fill ``rank``/``world_size`` from the process group, but only where they are ``None``."""
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None and initialized:
        world_size = dist.get_world_size()
    if rank is None:
        if not initialized:
            raise EvendpError(
                "rank=None but no torch.distributed process group is initialized; "
                "call dist.init_process_group(...) first or pass rank= explicitly"
            )
        rank = dist.get_rank()
    return rank, world_size


def _validate_layout_inputs(
    step: object, sizes: object, costs: object, padded: object, max_costs: object
) -> None:
    """:func:`layout_step`'s arguments, each refused in one line naming the fix."""
    indices: list[int] = list(
        validate_numbers("step", step, integral=True, example="step=[0, 1, 2] (sample indices)")
    )
    shares: list[int] = list(
        validate_numbers("sizes", sizes, integral=True, example="sizes=[2, 3] (one per rank)")
    )
    if not shares or (indices and not sum(shares)):
        raise EvendpError(f"sizes={shown(sizes)} takes no sample; give one size > 0 per rank")
    validate_bool("padded", padded)
    if costs is not None and indices and max(indices) >= len(validate_costs(costs)):
        raise EvendpError(
            f"costs has no entry for sample {max(indices)} of step; give one cost per sample "
            "of the dataset"
        )
    validate_caps(max_costs, len(shares), "max_costs")  # type: ignore[arg-type]


def validate_flags(shuffle: object, seed: object, drop_last: object, padded: object) -> None:
    for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("padded", padded)):
        validate_bool(name, flag)
    validate_int("seed", seed, example="seed=0")


def validate_rank(rank: int, world_size: int) -> None:
    if not is_int(rank) or not 0 <= rank < world_size:
        raise EvendpError(
            f"rank {rank!r} is out of range for world_size={world_size}; "
            f"expected an int in [0, {world_size - 1}]"
        )


def validate_coverage(length: int, sizes: list[int], drop_last: bool) -> None:
    """Refuse data that cannot give every rank a sample, or a drop_last epoch with no step."""
    if length < len(sizes):
        raise EvendpError(
            f"the data has {length} samples, fewer than the {len(sizes)} ranks; some ranks "
            "would never see a sample. Use more data or fewer ranks"
        )
    if drop_last and length < sum(sizes):
        raise EvendpError(
            f"drop_last=True with {length} samples and a global batch of {sum(sizes)} "
            f"(batch_sizes={shown(sizes)}) leaves no step at all; use drop_last=False or smaller "
            "batch sizes"
        )


def _validate_length(data: object) -> int:
    """The number of samples in ``data`` (a dataset with ``len()`` or an int)."""
    if isinstance(data, bool):
        raise EvendpError(f"data must be a dataset with len() or an int length, got {data!r}")
    if isinstance(data, int):
        length = data
    else:
        try:
            length = len(data)  # type: ignore[arg-type]
        except TypeError:
            raise EvendpError(
                f"data must be a dataset with len() (a map-style dataset) or an int length, "
                f"got {type(data).__name__}; iterable datasets have no length to split"
            ) from None
    if length < 0:
        raise EvendpError(f"data length must be >= 0, got {length}")
    return length


def _validate_group_steps(group_steps: object, costs: list[float] | None) -> int:
    steps = int(
        validate_int(
            "group_steps", group_steps, minimum=1, example="1 keeps each step's samples as drawn"
        )
    )
    if steps > 1 and costs is None:
        raise EvendpError(
            f"group_steps={group_steps} groups samples by cost, but no costs were given; "
            "pass costs= (e.g. each sample's length) or leave group_steps=1"
        )
    return steps


def _validate_max_costs(
    max_costs: Sequence[float] | None, costs: list[float] | None, world_size: int
) -> list[float] | None:
    """``max_costs``: one cap per rank in cost units (``Plan.max_tokens``), only with costs."""
    if max_costs is None:
        return None
    if costs is None:
        raise EvendpError(
            f"max_costs={max_costs!r} caps each rank's padded cost, but no costs were given; "
            "pass costs= (e.g. each sample's length) or leave max_costs=None"
        )
    return validate_caps(max_costs, world_size, "max_costs")  # one per rank, each >= 0


def _validate_max_tokens(
    max_tokens: object, costs: list[float] | None, drop_last: bool, group_steps: int
) -> float | None:
    """``max_tokens``: the step's budget in cost units (tokens), only with costs."""
    if max_tokens is None:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, float)):
        raise EvendpError(
            f"max_tokens must be a positive number (the tokens one step takes over all ranks), "
            f"got {max_tokens!r}; e.g. max_tokens=4096"
        )
    if costs is None:
        raise EvendpError(
            f"max_tokens={max_tokens!r} fills each step up to a token budget, but no costs were "
            "given; pass costs= (each sample's length in tokens) or leave max_tokens=None"
        )
    if drop_last or group_steps > 1:
        raise EvendpError(
            f"max_tokens={max_tokens!r} cuts steps by tokens; it takes drop_last=False and "
            f"group_steps=1, got drop_last={drop_last}, group_steps={group_steps}"
        )
    longest = max(costs, default=0.0)
    if not math.isfinite(max_tokens) or max_tokens < max(longest, 1e-300):
        raise EvendpError(
            f"max_tokens={max_tokens!r} is below the longest sample's {longest:g} tokens; no "
            f"step could take it. Raise max_tokens to at least {longest:g} or truncate the sample"
        )
    return float(max_tokens)
