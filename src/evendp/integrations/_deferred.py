"""A batch sampler for the rank the process has when the loader is used, not when it is built.

Lightning scripts build their loaders in ``main()``, before ``trainer.fit`` starts the
process group. So the sampler is built at once for the best rank known then (the group, else
``RANK``/``WORLD_SIZE``, else rank 0), which reports a bad argument where it was written, and
built again at first use under a group whose rank or size differs (Lightning's own launcher
sets no variables), or when ``batch_sizes="auto"`` was planned without the group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ._interleave import EpochRelay

__all__ = ["DeferredBatchSampler", "launch_rank"]


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

    Found as ``batch_sampler`` (the built sampler) and ``sampler`` (a relay of ``set_epoch``,
    where Lightning calls it).

    >>> import evendp
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
