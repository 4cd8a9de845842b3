"""Per-rank batch sizes with the exact gradient in a Lightning ``Trainer`` (DDP, accumulation).

Two pieces, and ``Trainer(use_distributed_sampler=False)`` so Lightning keeps the batch sampler
instead of re-instantiating it around a ``DistributedSampler``:

* :func:`uneven_dataloader`, returned from ``train_dataloader()``: a ``DataLoader`` over
  :class:`evendp.UnevenBatchSampler` (rank from the process group, sizes from
  ``EVENDP_BATCH_SIZES`` by default) with :class:`evendp.EmptySafeCollate`. Lightning calls
  ``set_epoch`` only on ``batch_sampler.sampler``, so the loader puts a relay there.
* :class:`UnevenGradient`, a callback: ``training_step`` returns the loss SUMMED over its
  samples (or tokens); the callback counts them (``count_fn(batch)``) over every micro-batch of
  the optimizer step, sums the count over ranks (one all-reduce per optimizer step) and, before
  the optimizer step and gradient clipping, multiplies the gradients by
  ``accumulate_grad_batches * world_size / count``. That undoes Lightning's division of the
  loss by ``accumulate_grad_batches`` and DDP's by the world size, leaving the gradient of the
  mean over the whole global batch, for any split and for token counts known only after
  the forward pass. Automatic optimization only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import evendp

from .._balance import NoBalance, step_balancer
from ._epoch import RelayedBatchSampler

__all__ = ["SpeedBalance", "UnevenGradient", "count_samples", "uneven_dataloader"]


def count_samples(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (a tuple, list, dict or a tensor).

    >>> count_samples((torch.zeros(3, 4), torch.zeros(3)))
    3
    """
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, torch.Tensor):
        return int(values.shape[0])
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise evendp.EvendpError(
        f"cannot count the samples of a {type(batch).__name__} batch: no tensor with a batch "
        "dimension; pass count_fn=... to UnevenGradient"
    )


def uneven_dataloader(
    dataset: Any,
    batch_sizes: Sequence[int] | None = None,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    costs: Sequence[float] | Callable[[Any], float] | None = None,
    max_tokens: float | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` giving this rank ``batch_sizes[rank]`` samples a step (call it in a hook).

    ``batch_sizes`` defaults to ``EVENDP_BATCH_SIZES`` (``evendp launch`` sets it). The rank
    comes from the process group when there is one, else it is 0 with one batch size.
    ``costs`` (each sample's length, or a function of ``dataset[i]``) sends each step's
    samples to ranks by padded cost; ``max_tokens`` makes each step a token budget (see
    :class:`evendp.UnevenBatchSampler`); :class:`SpeedBalance` moves samples by speed.

    >>> data = torch.utils.data.TensorDataset(torch.arange(6.0))
    >>> [b[0].tolist() for b in uneven_dataloader(data, [4], shuffle=False)]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """
    sizes = evendp.batch_sizes_from_env() if batch_sizes is None else batch_sizes
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    sampler = evendp.UnevenBatchSampler(
        dataset,
        sizes,
        rank=None if distributed else 0,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        costs=costs,
        max_tokens=max_tokens,
    )
    return DataLoader(
        dataset,
        # Lightning calls set_epoch on batch_sampler.sampler only: the relay carries it.
        batch_sampler=RelayedBatchSampler(sampler),
        collate_fn=evendp.EmptySafeCollate(dataset, collate_fn),
        **loader_kwargs,
    )


class UnevenGradient(pl.Callback):
    """Make the accumulated, DDP-averaged gradient the mean over the step's global batch.

    ``training_step`` must return the loss summed over what ``count_fn(batch)`` counts
    (default :func:`count_samples`; for a language model, e.g. the non-ignored shifted labels).

    >>> UnevenGradient().count_fn((torch.zeros(5, 2),))
    5
    """

    def __init__(self, count_fn: Callable[[Any], int | torch.Tensor] | None = None) -> None:
        self.count_fn = count_samples if count_fn is None else count_fn
        self._local: int | torch.Tensor = 0  # items counted since the last optimizer step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise evendp.EvendpError(
                "UnevenGradient needs automatic optimization (it rescales gradients before "
                "Lightning's optimizer step); with manual optimization scale the loss with "
                "evendp.ddp_loss yourself"
            )
        self._local = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._local = self._local + self.count_fn(batch)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        total = float(evendp.global_count(self._local))
        self._local = 0
        # Lightning divided each micro-batch's loss by accumulate_grad_batches, DDP by world.
        scale = trainer.accumulate_grad_batches * trainer.world_size / total if total else 0.0
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(scale)


def _balanced_sampler(loader: Any) -> Any:
    """The sampler with ``set_batch_sizes`` inside a loader from :func:`uneven_dataloader`."""
    sampler = loader
    for _ in range(4):  # DataLoader -> RelayedBatchSampler -> UnevenBatchSampler
        sampler = getattr(sampler, "batch_sampler", None)
        if hasattr(sampler, "set_batch_sizes"):
            return sampler
    raise evendp.EvendpError(
        f"SpeedBalance needs the training loader from evendp's uneven_dataloader, got "
        f"{type(loader).__name__}; return uneven_dataloader(...) from train_dataloader() "
        "and pass Trainer(use_distributed_sampler=False)"
    )


class SpeedBalance(pl.Callback):
    """Move samples from slow ranks to fast ones at every optimizer step (Lightning DDP).

    Times each rank's ``training_step`` (the forward and the loss, up to Lightning's
    ``backward``, which waits for the slowest rank under DDP) and, before every optimizer
    step, lets :class:`evendp.SpeedBalancer` re-split the sampler of
    :func:`uneven_dataloader`: every rank applies the same split at the same step, each
    step's samples stay the same, so with :class:`UnevenGradient` the gradient is still the
    global batch's. ``knobs`` go to :class:`evendp.SpeedBalancer` (``caps``, ``warmup``, ...).

    >>> SpeedBalance(warmup=2).knobs
    {'warmup': 2}
    """

    def __init__(self, **knobs: Any) -> None:
        self.knobs = knobs
        self.balancer: Any = NoBalance()
        self._block: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = _balanced_sampler(trainer.train_dataloader)
        self.balancer = step_balancer(
            sampler, "speed", distributed=trainer.world_size > 1, **self.knobs
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._block = self.balancer.measure(count_samples(batch))
        self._block.__enter__()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._block is not None:
            self._block.__exit__(None, None, None)
            self._block = None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.balancer.step()
