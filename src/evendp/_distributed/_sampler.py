"""Per-rank batches of different sizes for DDP/FSDP2: the sampler, its collate, its sizes.

:class:`UnevenBatchSampler` gives rank ``r`` batches of ``batch_sizes[r]`` indices. All ranks
walk ONE global permutation (seeded by ``seed + epoch``, identical everywhere) with one global
cursor: a step consumes ``B = sum(batch_sizes)`` indices and rank ``r`` takes the slice at
offset ``sum(batch_sizes[:r])``. Who takes which is the step's layout
(:mod:`evendp._distributed._step_layout`, :meth:`UnevenBatchSampler.layout`), decided there and
nowhere else. So every rank yields the same number of steps and every index appears exactly
once per epoch. The final, partial step of ``R < B`` indices is split in proportion.
:class:`EmptySafeCollate` gives a rank with no samples a real, empty batch. With ``costs=`` (a
cost per sample, e.g. its token length) each step still takes the same ``B`` indices, but they
go to ranks by :func:`evendp._core._cost.split_by_cost` with ``batch_sizes`` as the capacities,
so each rank's padded cost, not its sample count, follows its size. Scaling the loss so the
gradient stays exact is :func:`evendp._distributed._group.ddp_loss`'s job; nothing here needs a
process group.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from .._core._cost import validate_caps, validate_costs
from .._core._errors import EvendpError
from .._core._exact import stand_in_batch
from .._core._validate import is_int, shown, validate_bool, validate_int
from ._batch_plan import validate_batch_plan
from ._step_layout import StepLayout, layout_step

#: Steps whose whole layout a sampler keeps: a loader's workers sample num_workers *
#: prefetch_factor steps ahead (16 with 8 workers), the training loop reads the current one.
KEPT_LAYOUTS = 64

__all__ = [
    "EmptySafeCollate",
    "UnevenBatchSampler",
]

# ---------------------------------------------------------------------------------------------
# Validation at the boundary


def _validate_batch_sizes(batch_sizes: object, world_size: int | None = None) -> list[int]:
    """Return ``batch_sizes`` as a list of ints, or raise naming the bad value and the fix."""
    return validate_batch_plan(batch_sizes, None, world_size)[0]


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


def sample_costs(data: object, length: int, costs: object) -> list[float] | None:
    """Per-sample costs from a sequence (one per sample) or a function of ``data[i]``."""
    if costs is None:
        return None
    if callable(costs):
        if isinstance(data, int) or not hasattr(data, "__getitem__"):
            raise EvendpError(
                f"costs is a function of the dataset item, but data is {data!r}, not a "
                "dataset; pass the dataset as data, or costs as a list (one number per sample)"
            )
        values: list[object] = []
        for i in range(length):
            values.append(costs(data[i]))
        try:
            return validate_costs(values)
        except EvendpError as err:
            raise EvendpError(
                f"costs({type(data).__name__}[i]) returned a bad value: {err}"
            ) from None
    checked = validate_costs(costs)
    if len(checked) != length:
        raise EvendpError(
            f"costs has {len(checked)} values for {length} samples; pass one cost per sample "
            "(e.g. [len(x) for x in texts]) or a function of the dataset item"
        )
    return checked


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


def budget_step_length(
    costs: Sequence[float], order: Sequence[int], budget: float, start: int = 0
) -> int:
    """How many samples of ``order`` from ``start`` on one step takes under a token budget.

    Samples are taken in order while their summed cost stays within ``budget`` (at least
    one: the caller checks no sample alone exceeds it), as fairseq's ``max_tokens``.

    >>> budget_step_length([3, 4, 2, 5], [0, 1, 2, 3], budget=9)
    3
    >>> budget_step_length([3, 4, 2, 5], [0, 1, 2, 3], budget=9, start=2)
    2
    """
    total, taken = 0.0, 0
    for k in range(start, len(order)):
        i = order[k]
        if taken and total + costs[i] > budget:
            break
        total += costs[i]
        taken += 1
    return taken


def _validate_rank(rank: int, world_size: int) -> None:
    if not is_int(rank) or not 0 <= rank < world_size:
        raise EvendpError(
            f"rank {rank!r} is out of range for world_size={world_size}; "
            f"expected an int in [0, {world_size - 1}]"
        )


def _validate_coverage(length: int, sizes: list[int], drop_last: bool) -> None:
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


# ---------------------------------------------------------------------------------------------
# The sampler


def _default_rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int | None]:
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


def _steps(remaining: int, global_batch: int, drop_last: bool) -> int:
    """Steps needed for ``remaining`` indices at ``global_batch`` per step."""
    if remaining <= 0:
        return 0
    return remaining // global_batch if drop_last else math.ceil(remaining / global_batch)


class UnevenBatchSampler:
    """Batch sampler for DDP/FSDP2 where rank ``r`` takes ``batch_sizes[r]`` samples per step.

    Every rank yields the same number of batches (``ceil(len / sum(batch_sizes))``, or the
    floor with ``drop_last=True``), so no rank waits forever in an all-reduce; over all ranks
    every index appears exactly once per epoch (``drop_last=False``). With ``costs`` (one
    number per sample, or a function of ``data[i]``: its length in tokens, or ``len +
    len**2 / k`` for attention) each step takes the same indices as without, but they go to
    ranks so each rank's padded cost (``len * max`` cost, or the sum with ``padded=False``)
    follows ``batch_sizes``, similar lengths together; a rank's batch may then hold more or
    fewer than ``batch_sizes[r]`` samples (:meth:`sizes_in_step` says how many). Every rank
    computes the same plan with no communication. ``group_steps=k > 1`` also sorts each
    window of ``k`` steps' samples by cost and cuts it into steps (in shuffled order), so a
    step holds similar lengths and pads little; each index still appears once per epoch, but
    which samples share a step changes (as transformers' ``group_by_length`` does). The last
    step's
    ``R < sum(batch_sizes)`` indices are split in proportion to ``batch_sizes``, so a rank may
    get an empty batch there (and always does when its size is 0). Use it as
    ``DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))`` and
    scale the loss with :func:`ddp_loss`. ``max_costs`` (with ``costs``; one per rank, e.g.
    ``plan(..., seq_len=L).max_tokens``) caps each rank's share in cost units: a step
    whose samples cannot fit raises :class:`EvendpError` naming the step.
    ``max_tokens`` (with ``costs``; fairseq's option) makes the global batch a token budget:
    each step takes samples from the permutation while their summed cost stays within
    ``max_tokens``, and splits them across ranks by cost with ``batch_sizes`` as the ranks'
    capacities (and ``max_costs`` as their hard caps); steps then hold different numbers of
    samples, the same steps whatever the split or the world size.
    ``rank``/``world_size`` come from the process group only when ``None``; ``world_size``
    defaults to ``len(batch_sizes)`` without one.

    >>> UnevenBatchSampler(10, [1, 3], rank=0, shuffle=False)
    UnevenBatchSampler(10, batch_sizes=[1, 3], rank=0)
    >>> list(UnevenBatchSampler(10, [1, 3], rank=0, shuffle=False))
    [[0], [4], [8]]
    >>> list(UnevenBatchSampler(10, [1, 3], rank=1, shuffle=False))
    [[1, 2, 3], [5, 6, 7], [9]]
    >>> lengths = [9, 1, 1, 9, 2, 2, 8, 1]
    >>> [list(UnevenBatchSampler(8, [2, 2], rank=r, shuffle=False, costs=lengths))
    ...  for r in range(2)]
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
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("padded", padded)):
            validate_bool(name, flag)
        validate_int("seed", seed, example="seed=0")
        rank, world_size = _default_rank_and_world(rank, world_size)
        sizes = _validate_batch_sizes(batch_sizes, world_size)
        _validate_rank(rank, len(sizes))
        self.num_samples = _validate_length(data)
        _validate_coverage(self.num_samples, sizes, drop_last)
        # Computed once, identically on every rank (the data and the function are the same).
        self.costs = sample_costs(data, self.num_samples, costs)
        self.padded = bool(padded)
        self.group_steps = _validate_group_steps(group_steps, self.costs)
        self.max_costs = _validate_max_costs(max_costs, self.costs, len(sizes))
        self.max_tokens = _validate_max_tokens(max_tokens, self.costs, drop_last, group_steps)
        self._budget_cuts: tuple[int, list[int]] | None = None  # (epoch, step lengths)
        self.rank = rank
        self.world_size = len(sizes)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._set_sizes(sizes)
        # Progress of the running iteration, so len() stays right after set_batch_sizes.
        self._cursor = 0
        self._steps_done = 0
        # Every rank's rows in each step yielded this epoch, and the last steps' whole
        # layouts (kept after the epoch ends: a DataLoader samples ahead of the loop that
        # asks; the indices of a whole epoch would be a second copy of the permutation).
        self._rows: list[tuple[int, ...]] = []
        self._recent: collections.deque[StepLayout] = collections.deque(maxlen=KEPT_LAYOUTS)

    @property
    def step_indices(self) -> list[int]:
        """The step last yielded, over every rank: the same indices on every rank, no comm.

        With a count per sample (e.g. its non-ignored tokens) their sum over these indices is
        the step's global count, known to every rank without an all-reduce. They come rank by
        rank (the step's layout: with ``costs``, as the cost split gave them to ranks).

        >>> sampler = UnevenBatchSampler(6, [1, 2], rank=0, world_size=2, shuffle=False)
        >>> next(iter(sampler)), sampler.step_indices
        ([0], [0, 1, 2])
        """
        return list(self._recent[-1].indices) if self._recent else []

    def layout(self, step: int) -> StepLayout:
        """Step ``step``'s (0-based, of the epoch being iterated) :class:`StepLayout`: every
        rank's samples, the same value on every rank with no communication.

        >>> s = UnevenBatchSampler(5, [1, 2], rank=0, shuffle=False)
        >>> [s.layout(step).rank_rows for step, _ in enumerate(s)]
        [(1, 2), (1, 1)]
        """
        self._check_sampled(step)
        first_kept = len(self._rows) - len(self._recent)
        if step < first_kept:
            raise EvendpError(
                f"step {step}'s layout is no longer kept (the last {KEPT_LAYOUTS} steps' are, "
                f"from step {first_kept}); read it when its batch arrives, or its sizes with "
                "sizes_in_step(step)"
            )
        return self._recent[step - first_kept]

    def _check_sampled(self, step: int) -> None:
        validate_int("step", step, minimum=0)
        if step >= len(self._rows):
            raise EvendpError(
                f"step {step} has not been sampled yet this epoch (steps 0 to "
                f"{len(self._rows) - 1} have); count steps from 0 in each epoch, "
                "e.g. `for step, batch in enumerate(loader)`"
            )

    def _set_sizes(self, sizes: list[int]) -> None:
        self._sizes = sizes
        self._global = sum(sizes)

    @property
    def batch_sizes(self) -> list[int]:
        """The per-rank batch sizes in force for the next step (a copy)."""
        return list(self._sizes)

    @property
    def batch_size(self) -> int:
        """This rank's share of a full step, ``batch_sizes[rank]``: the size of the batches this
        rank's iterator yields, as torch's ``BatchSampler.batch_size`` means (Accelerate and
        Lightning read it so). Not the global batch: that is :attr:`global_batch_size`, what
        ``TrainConfig.batch_size`` and ``evendp train --batch`` set. The short last step of an
        epoch (``drop_last=False``) and a step cut by costs may hold fewer.

        >>> sampler = UnevenBatchSampler(100, [3, 5], rank=1, world_size=2)
        >>> sampler.batch_size, sampler.global_batch_size
        (5, 8)
        """
        return self._sizes[self.rank]

    @property
    def global_batch_size(self) -> int:
        """Samples per full step over all ranks, ``sum(batch_sizes)``: the global batch."""
        return self._global

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: call it with the same value on every rank before iterating."""
        self.epoch = int(epoch)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """New per-rank sizes from the next step this sampler yields on; coverage stays exact.

        Call it on every rank at the same step with the same sizes (a speed balancer's split:
        ``SpeedBalancer(..., on_resplit=sampler.set_batch_sizes)``).
        With ``DataLoader(num_workers>0)`` the loader samples ``num_workers * prefetch_factor``
        batches ahead, so the change reaches the training loop that many steps later; it is
        the same step on every rank as long as all ranks use the same loader settings.

        >>> s = UnevenBatchSampler(10, [2, 2], rank=0, shuffle=False)
        >>> it = iter(s)
        >>> next(it)
        [0, 1]
        >>> s.set_batch_sizes([1, 5])
        >>> list(it), len(s)
        ([[4]], 2)
        """
        sizes = _validate_batch_sizes(batch_sizes, self.world_size)
        _validate_coverage(self.num_samples, sizes, self.drop_last)
        self._set_sizes(sizes)

    def samples_in_step(self, step: int) -> int:
        """Samples over all ranks in step ``step`` (0-based) of the epoch being iterated.

        The ``global_count`` for :func:`ddp_loss` when the loss is a per-sample sum, with no
        communication (every rank knows every rank's size): ``ddp_loss(s, len(y),
        sampler.samples_in_step(step))`` saves the count all-reduce. It is exact for the short
        last step and after :meth:`set_batch_sizes`. Counts of something else (non-ignored
        tokens) still need ``ddp_loss``'s all-reduce.

        >>> s = UnevenBatchSampler(10, [1, 3], rank=0)
        >>> [s.samples_in_step(step) for step, _ in enumerate(s)]
        [4, 4, 2]
        """
        return sum(self.sizes_in_step(step))

    def sizes_in_step(self, step: int) -> list[int]:
        """Every rank's sample count in step ``step`` (0-based) of the epoch being iterated.

        ``batch_sizes`` for full steps without ``costs``; with ``costs`` the cost-balanced
        counts (the same on every rank, computed without communication).

        >>> s = UnevenBatchSampler(8, [2, 2], rank=0, shuffle=False, costs=[5, 1, 1, 1, 1, 5, 5, 1])
        >>> [(batch, s.sizes_in_step(step)) for step, batch in enumerate(s)]
        [([0], [1, 3]), ([4, 7], [2, 2])]
        """
        self._check_sampled(step)
        return list(self._rows[step])

    def _permutation(self) -> list[int]:
        # One generator seeded identically on every rank: the same permutation everywhere.
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        if not self.shuffle:
            perm = list(range(self.num_samples))
        else:
            perm = torch.randperm(self.num_samples, generator=generator).tolist()
        if self.group_steps > 1:
            perm = self._grouped(perm, generator)
        return perm

    def _grouped(self, perm: list[int], generator: torch.Generator) -> list[int]:
        """Sort each window of ``group_steps`` steps by cost, cut it into steps, shuffle them.

        Steps of similar lengths pad little (as ``group_by_length`` in transformers); the
        full steps of a window are shuffled so lengths do not grow along the epoch, and the
        epoch's short last step stays last. Still a permutation: each index once per epoch.
        """
        costs, step, window = self.costs, self._global, self._global * self.group_steps
        assert costs is not None  # _validate_group_steps: grouping needs costs
        out: list[int] = []
        for start in range(0, len(perm), window):
            ranked = sorted(perm[start : start + window], key=lambda i: (costs[i], i))
            steps = [ranked[k : k + step] for k in range(0, len(ranked), step)]
            full = [s for s in steps if len(s) == step]
            order = torch.randperm(len(full), generator=generator).tolist()
            out += [i for k in order for i in full[k]]
            out += [i for s in steps if len(s) < step for i in s]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        perm = self._permutation()
        n = self.num_samples
        self._cursor = 0
        self._steps_done = 0
        self._rows, self._recent = [], collections.deque(maxlen=KEPT_LAYOUTS)
        # Sizes are re-read every step so set_batch_sizes takes effect at the next yield.
        while True:
            remaining = n - self._cursor
            if remaining <= 0 or (self.drop_last and remaining < self._global):
                break
            step_total = self._step_length(perm, remaining)
            step = perm[self._cursor : self._cursor + step_total]  # the same on every rank
            layout = self._layout(step)
            self._cursor += step_total
            self._steps_done += 1
            self._rows.append(layout.rank_rows)
            self._recent.append(layout)
            yield layout.rank_indices(self.rank)
        self._cursor = 0
        self._steps_done = 0

    def _step_length(self, perm: list[int], remaining: int) -> int:
        """Indices the next step takes: the global batch, or what the token budget holds."""
        if self.max_tokens is None:
            return min(remaining, self._global)
        assert self.costs is not None  # _validate_max_tokens: a budget needs costs
        return budget_step_length(self.costs, perm, self.max_tokens, self._cursor)

    def _budget_steps(self) -> int:
        """Steps in this epoch under the token budget (they do not depend on the sizes)."""
        if self._budget_cuts is None or self._budget_cuts[0] != self.epoch:
            assert self.costs is not None and self.max_tokens is not None
            perm, lengths, cursor = self._permutation(), [], 0
            while cursor < len(perm):
                lengths.append(budget_step_length(self.costs, perm, self.max_tokens, cursor))
                cursor += lengths[-1]
            self._budget_cuts = (self.epoch, lengths)
        return len(self._budget_cuts[1])

    def _layout(self, step: list[int]) -> StepLayout:
        """The step's layout over every rank (:func:`layout_step`), a cap it breaks named."""
        try:
            return layout_step(
                step, self._sizes, costs=self.costs, padded=self.padded, max_costs=self.max_costs
            )
        except EvendpError as err:
            raise EvendpError(
                f"step {self._steps_done} of epoch {self.epoch} does not fit max_costs: {err}"
            ) from None

    def __len__(self) -> int:
        if self.max_tokens is not None:
            return self._budget_steps()
        # Steps already yielded in a running epoch plus the rest at the sizes in force now.
        remaining = self.num_samples - self._cursor
        return self._steps_done + _steps(remaining, self._global, self.drop_last)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.num_samples}, batch_sizes={self._sizes}, "
            f"rank={self.rank})"
        )


# ---------------------------------------------------------------------------------------------
# Collating an empty batch


def _empty_like_batch(batch: Any) -> Any:
    """A collated one-sample batch with its batch dimension cut to zero."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({k: _empty_like_batch(v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        # A list of leaves (strings, objects) is itself the batch; otherwise it holds fields.
        if all(not isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            return type(batch)()
        fields = [_empty_like_batch(v) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*fields)
        return type(batch)(fields)
    return batch


class EmptySafeCollate:
    """Wrap a collate function so an empty index list gives a batch a model can run, not an error.

    ``torch.utils.data.default_collate([])`` raises ``IndexError``. A rank whose batch size is 0
    (or that gets nothing in the epoch's short last step) must still run forward and backward
    so DDP's all-reduce matches, so it needs a real batch. By default this collates the sample
    ``dataset[0]`` once and cuts every tensor to length 0 along dim 0, keeping dtype and the
    trailing shape. With ``stand_in=True`` it gives that one real sample instead, every tensor
    marked as a stand-in (see :func:`evendp.is_stand_in`): models that cannot forward 0 rows
    (GPT-2, BERT) run it, and evendp's loss helpers (:class:`evendp.StepMean`, the
    integrations) give it weight exactly 0. Non-empty batches go to ``collate_fn`` unchanged.
    Picklable, so it works with ``num_workers > 0``.

    >>> data = [(torch.ones(3), 1), (torch.zeros(3), 0)]
    >>> x, y = EmptySafeCollate(data)([])
    >>> x.shape, y.shape, y.dtype
    (torch.Size([0, 3]), torch.Size([0]), torch.int64)
    >>> from evendp import is_stand_in
    >>> x, y = EmptySafeCollate(data, stand_in=True)([])
    >>> x.shape, is_stand_in((x, y))
    (torch.Size([1, 3]), True)
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        stand_in: bool = False,
    ):
        self.dataset = dataset
        self.collate_fn: Callable[[list[Any]], Any] = (
            default_collate if collate_fn is None else collate_fn
        )
        self.stand_in = stand_in
        self._empty: Any = None

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._empty is None:
            one = self.collate_fn([self.dataset[0]])
            self._empty = stand_in_batch(one) if self.stand_in else _empty_like_batch(one)
        return self._empty
