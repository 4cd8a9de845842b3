"""Per-rank batch sizes in a training loop written with Hugging Face Accelerate.

``accelerator.prepare`` wraps a dataloader's batch sampler in Accelerate's ``BatchSamplerShard``,
which hands the sampler's batch ``i`` to rank ``i % world_size``. A sampler that is already
rank-aware (:class:`evendp.UnevenBatchSampler`) is then sharded a second time and each rank
silently loses ``(W - 1) / W`` of its batches. :func:`uneven_dataloader` instead gives Accelerate
a *global* batch sampler: for every step it yields each rank's batch in rank order (rank 0's,
rank 1's, ...), so ``BatchSamplerShard``'s round robin de-interleaves it back into each rank's
own batches. It has no ``batch_size`` (Accelerate then accepts batches of any length) and no
``generator`` (Accelerate would overwrite it); its ``sampler`` attribute carries ``set_epoch``,
which is how Accelerate's ``DataLoaderShard`` reaches it at every epoch.

The loss: see :func:`evendp.ddp_loss` and docs/integrations.md (sum the loss, count every
micro-batch of the optimizer step, one :func:`evendp.global_count`, ``accelerator.no_sync``
on all but the last micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from accelerate import Accelerator
from torch.utils.data import DataLoader

import evendp

from ._epoch import EpochRelay

__all__ = ["speed_balancer", "uneven_dataloader"]


class _InterleavedBatchSampler:
    """Every rank's :class:`evendp.UnevenBatchSampler` batches, step by step, in rank order."""

    def __init__(
        self,
        data: object,
        batch_sizes: list[int],
        shuffle: bool,
        seed: int,
        drop_last: bool,
        **options: Any,  # costs=, max_tokens=: as UnevenBatchSampler takes them
    ) -> None:
        self.ranks = [
            evendp.UnevenBatchSampler(
                data,
                batch_sizes,
                rank=r,
                world_size=len(batch_sizes),
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
                **options,
            )
            for r in range(len(batch_sizes))
        ]
        self.drop_last = drop_last
        self.sampler = EpochRelay(self)  # where DataLoaderShard.set_epoch looks

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    @property
    def batch_sizes(self) -> list[int]:
        """The per-rank sizes in force (a speed balancer reads and sets them)."""
        return self.ranks[0].batch_sizes

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """New per-rank sizes from the next step on, for every rank's sampler alike."""
        for sampler in self.ranks:
            sampler.set_batch_sizes(batch_sizes)

    def __iter__(self) -> Iterator[list[int]]:
        for step in zip(*self.ranks, strict=True):
            yield from step

    def __len__(self) -> int:
        return len(self.ranks[0]) * len(self.ranks)


def _validate_accelerator(accelerator: object, batch_sizes: list[int]) -> Accelerator:
    if not isinstance(accelerator, Accelerator):
        raise evendp.EvendpError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}; "
            "create one with Accelerator() before building the dataloader"
        )
    if len(batch_sizes) != accelerator.num_processes:
        raise evendp.EvendpError(
            f"got {len(batch_sizes)} batch sizes {batch_sizes!r} for "
            f"{accelerator.num_processes} processes; pass one batch size per process"
        )
    config = accelerator.dataloader_config
    if config.split_batches or config.dispatch_batches:
        raise evendp.EvendpError(
            "uneven_dataloader needs DataLoaderConfiguration(split_batches=False, "
            f"dispatch_batches=False), got split_batches={config.split_batches}, "
            f"dispatch_batches={config.dispatch_batches}: each rank loads its own batches"
        )
    return accelerator


def uneven_dataloader(
    accelerator: Accelerator,
    dataset: Any,
    batch_sizes: Sequence[int],
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    costs: Sequence[float] | Callable[[Any], float] | None = None,
    max_tokens: float | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A dataloader already passed through ``accelerator.prepare``, ``batch_sizes[rank]`` a batch.

    Every rank yields the same number of batches; over all ranks each sample comes once per
    epoch (``drop_last=False``), in one permutation seeded by ``seed + epoch`` (Accelerate's
    ``DataLoaderShard`` sets the epoch when it starts iterating). A rank may get an empty
    batch in the short last step (always when its size is 0): ``collate_fn`` is wrapped in
    :class:`evendp.EmptySafeCollate` so it is a real, zero-length batch. Preparing the
    returned loader again returns it unchanged (Accelerate marks it prepared). Other keyword
    arguments (``num_workers``, ``pin_memory``, ...) go to ``torch.utils.data.DataLoader``.
    ``costs`` (each sample's length, or a function of ``dataset[i]``) sends each step's
    samples to ranks by padded cost and ``max_tokens`` makes the step a token budget, as
    :class:`evendp.UnevenBatchSampler` does; :func:`speed_balancer` moves samples between
    ranks by measured speed.

    >>> import torch
    >>> from accelerate import Accelerator
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
    >>> loader = uneven_dataloader(Accelerator(cpu=True), data, [4], shuffle=False)
    >>> [batch[0].tolist() for batch in loader]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """
    sizes = _as_list(batch_sizes)
    accelerator = _validate_accelerator(accelerator, sizes)
    options = {"costs": costs, "max_tokens": max_tokens}
    sampler = _InterleavedBatchSampler(dataset, sizes, shuffle, seed, drop_last, **options)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=evendp.EmptySafeCollate(dataset, collate_fn),
        **loader_kwargs,
    )
    prepared: DataLoader = accelerator.prepare(loader)
    return prepared


def speed_balancer(loader: DataLoader, **knobs: Any) -> evendp.SpeedBalancer:
    """A :class:`evendp.SpeedBalancer` that re-splits ``loader``'s steps by measured speed.

    ``loader`` comes from :func:`uneven_dataloader`. Time each forward pass with
    ``with balancer.measure(len(batch)):`` (the forward and the loss, not
    ``accelerator.backward``, which waits for the slowest rank) and call
    ``balancer.step()`` after every optimizer step on every rank: samples then move from
    slow ranks to fast ones; each step's samples, and the gradient, stay those of one
    process. ``knobs`` go to :class:`evendp.SpeedBalancer` (``caps``, ``warmup``, ...).

    >>> import torch
    >>> from accelerate import Accelerator
    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> balancer = speed_balancer(uneven_dataloader(Accelerator(cpu=True), data, [4]))
    >>> balancer.sampler.batch_sizes
    [4]
    """
    sampler: Any = loader
    for _ in range(4):  # DataLoaderShard -> BatchSamplerShard -> ours
        sampler = getattr(sampler, "batch_sampler", None)
        if isinstance(sampler, _InterleavedBatchSampler):
            return evendp.SpeedBalancer(sampler, **knobs)
    raise evendp.EvendpError(
        f"speed_balancer needs a loader from uneven_dataloader, got {type(loader).__name__}; "
        "build it with evendp.integrations.accelerate.uneven_dataloader(accelerator, ...)"
    )


def _as_list(batch_sizes: object) -> list[int]:
    """The sizes as a list; the sampler checks the values (non-negative ints, one positive)."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise evendp.EvendpError(
            f"batch_sizes must be a sequence of non-negative ints (one per process), got "
            f"{batch_sizes!r}; pass e.g. [1, 3], or evendp.batch_sizes_from_env()"
        )
    return list(batch_sizes)
