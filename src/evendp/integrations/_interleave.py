"""Every rank's batches of a step in rank order (what Accelerate's round robin de-interleaves),
and the ``set_epoch`` relay Accelerate and Lightning reach through ``batch_sampler.sampler``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import evendp

__all__ = ["EpochRelay", "InterleavedBatchSampler"]


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
