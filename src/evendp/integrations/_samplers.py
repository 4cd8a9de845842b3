"""The batch samplers the adapters hand their frameworks, over :class:`evendp.UnevenBatchSampler`.

Accelerate's loader gets every rank's batches of a step in rank order, which its round robin
de-interleaves (:class:`InterleavedBatchSampler`). Lightning's gets the rank the process has
when the loader is used, not when it is built (:class:`DeferredBatchSampler`): scripts build
their loaders in ``main()``, before ``trainer.fit`` starts the process group. Neither
framework calls ``set_epoch`` on a custom batch sampler: both reach it through
``batch_sampler.sampler`` (:class:`EpochRelay`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

import evendp

__all__ = ["DeferredBatchSampler", "EpochRelay", "InterleavedBatchSampler", "launch_rank"]


def launch_rank(environ: Any = None) -> tuple[int, int | None, bool]:
    """(rank, world size or ``None`` when unknown, whether a process group gave them).

    >>> launch_rank({"RANK": "1", "WORLD_SIZE": "2"}), launch_rank({})
    ((1, 2, False), (0, None, False))
    """
    if environ is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    env = os.environ if environ is None else environ
    rank, world = env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip()
    if rank.isdigit() and world.isdigit():
        return int(rank), int(world), False
    return 0, None, False


class DeferredBatchSampler:
    """``build(rank, world)``'s batch sampler, rebuilt at first use for the group's rank.

    Built at once for the best rank known then (the group, else ``RANK``/``WORLD_SIZE``, else
    rank 0), which reports a bad argument where it was written; built again at first use under
    a group whose rank or size differs (Lightning's own launcher sets no variables), or when
    ``regroup`` (``batch_sizes="auto"`` planned without the group). Found as
    ``batch_sampler`` (the built sampler) and ``sampler`` (a relay of ``set_epoch``).

    >>> deferred = DeferredBatchSampler(
    ...     lambda rank, world: evendp.UnevenBatchSampler(6, [2, 1], rank=rank, shuffle=False))
    >>> list(deferred), deferred.batch_sampler.rank
    ([[0, 1], [3, 4]], 0)
    """

    def __init__(self, build: Callable[[int, int | None], Any], *, regroup: bool = False) -> None:
        self._build = build
        self._regroup = regroup  # built without a group: build again under one
        self._epoch: int | None = None
        self.sampler = EpochRelay(self)
        self._key = launch_rank()
        self._built = build(*self._key[:2])

    @property
    def batch_sampler(self) -> Any:
        """The sampler for this process's rank now."""
        key = launch_rank()
        if key[2] and (key[:2] != self._key[:2] or (self._regroup and not self._key[2])):
            self._key, self._built = key, self._build(*key[:2])
            if self._epoch is not None:
                self._built.set_epoch(self._epoch)
        return self._built

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._built.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler)


class EpochRelay:
    """Forwards ``set_epoch``, found as ``batch_sampler.sampler`` (neither Accelerate nor
    Lightning calls it on a custom batch sampler). No ``generator`` for Accelerate to replace,
    not a ``RandomSampler`` for it to re-seed."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner  # has set_epoch

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class InterleavedBatchSampler:
    """Every rank's :class:`evendp.UnevenBatchSampler` batches, step by step, in rank order."""

    def __init__(self, data: object, batch_sizes: list[int], **options: Any) -> None:
        # options: UnevenBatchSampler's (shuffle, seed, drop_last, costs, max_tokens).
        world = len(batch_sizes)
        self.ranks = [
            evendp.UnevenBatchSampler(data, batch_sizes, rank=r, world_size=world, **options)
            for r in range(world)
        ]
        self.drop_last = bool(options.get("drop_last", False))
        self.sampler = EpochRelay(self)  # where DataLoaderShard.set_epoch looks

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    @property
    def batch_sizes(self) -> list[int]:
        """The per-rank sizes in force (a speed balancer starts from them)."""
        return self.ranks[0].batch_sizes

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """New per-rank sizes from the next step on, for every rank's sampler alike."""
        for sampler in self.ranks:
            sampler.set_batch_sizes(batch_sizes)

    def __iter__(self) -> Iterator[list[int]]:
        self.on_epoch()
        for step in zip(*self.ranks, strict=True):
            yield from step

    def on_epoch(self) -> None:
        """Set by :func:`uneven_dataloader`: run as each epoch's iteration starts."""

    def __len__(self) -> int:
        return len(self.ranks[0]) * len(self.ranks)

    def samples_in_step(self, step: int) -> int:
        """Samples over all ranks in step ``step`` of an epoch (steps are full but the last)."""
        first = self.ranks[0]
        full = first.global_batch_size
        return full if step < len(first) - 1 or self.drop_last else first.num_samples - full * step
