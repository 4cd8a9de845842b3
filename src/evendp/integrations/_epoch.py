"""The ``set_epoch`` relay Accelerate and Lightning reach through ``batch_sampler.sampler``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["EpochRelay", "RelayedBatchSampler"]


class _HasEpoch(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


class EpochRelay:
    """Found as ``batch_sampler.sampler`` (where both libraries look): forwards ``set_epoch``.

    Neither Accelerate's ``DataLoaderShard`` nor Lightning calls ``set_epoch`` on a custom
    batch sampler itself; both call it on ``batch_sampler.sampler``. It has no ``generator``
    for Accelerate to replace and is not a ``RandomSampler`` for it to re-seed.
    """

    def __init__(self, owner: _HasEpoch) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class RelayedBatchSampler:
    """A batch sampler as it is, plus a ``sampler`` attribute that relays ``set_epoch`` to it.

    >>> import evendp
    >>> inner = evendp.UnevenBatchSampler(6, [2], rank=0)
    >>> RelayedBatchSampler(inner).sampler.set_epoch(3)
    >>> inner.epoch
    3
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = EpochRelay(batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler)
