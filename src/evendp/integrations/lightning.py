"""Per-rank batch sizes with the exact gradient in a Lightning ``Trainer`` (DDP, accumulation).

Return :func:`uneven_dataloader` from ``train_dataloader()``, add the :class:`UnevenGradient`
callback, and pass ``Trainer(use_distributed_sampler=False)`` so Lightning keeps the batch
sampler. ``training_step`` returns its mean loss as Lightning users write it; the callback
weights it and rescales the gradients before the optimizer step. Automatic optimization only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import evendp

from ._auto_sizes import auto_loader_sizes
from ._samplers import DeferredBatchSampler
from ._speed import Unbalanced, batch_rows, resizable, resplitting

__all__ = [
    "SpeedBalance",
    "UnevenGradient",
    "count_samples",
    "logged_count",
    "uneven_dataloader",
]


def count_samples(batch: Any) -> int:
    """Samples in a batch (a tuple, list, dict or a tensor): its first tensor's rows (a dict's
    ``labels``' when it has them).

    >>> count_samples((torch.zeros(3, 4), torch.zeros(3)))
    3
    """
    return batch_rows(batch, "pass count_fn=... to UnevenGradient")


def logged_count(batch: Any, count_fn: Callable[[Any], int] | None = None) -> float:
    """What to pass as ``self.log(..., batch_size=)`` for a batch of an uneven loader: its
    items (default :func:`count_samples`), 0 for a stand-in, as a float.

    With ``sync_dist=True`` Lightning's epoch mean is then the mean over every item once
    (inferred, a stand-in counts 1). A float: Lightning averages an int sum over the ranks in
    integers (9 rows on 2 ranks became 4, the loss 9 / 8 of the true one).

    >>> logged_count((torch.zeros(3, 2),)), logged_count(evendp.EmptySafeCollate(
    ...     [(torch.zeros(2),)], stand_in=True)([]))
    (3.0, 0.0)
    """
    if evendp.is_stand_in(batch):
        return 0.0
    return float((count_samples if count_fn is None else count_fn)(batch))


def uneven_dataloader(
    dataset: Any,
    batch_sizes: Sequence[int] | Literal["auto"] | None = None,
    *,
    model: torch.nn.Module | None = None,
    memory: str | Sequence[Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    costs: Sequence[float] | Callable[[Any], float] | None = None,
    max_tokens: float | None = None,
    batch_size: int | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` giving this rank ``batch_sizes[rank]`` samples a step.

    ``batch_sizes``, ``"auto"``, ``costs`` and ``max_tokens`` as in the Accelerate
    ``uneven_dataloader``. The rank comes from the process group when the loader is used
    (a loader built in ``main()``, before ``fit``, too); :class:`SpeedBalance` moves
    samples by speed.

    >>> data = torch.utils.data.TensorDataset(torch.arange(6.0))
    >>> [b[0].tolist() for b in uneven_dataloader(data, [4], shuffle=False)]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """
    auto = isinstance(batch_sizes, str) and batch_sizes == "auto"

    def build(rank: int, world: int | None) -> evendp.UnevenBatchSampler:
        sizes = auto_loader_sizes(
            dataset, model=model, batch_size=batch_size, world=world, memory=memory,
            collate_fn=collate_fn, batch_sizes=batch_sizes,
        )  # fmt: skip
        return evendp.UnevenBatchSampler(
            dataset,
            sizes,
            rank=rank,
            world_size=world,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            costs=costs,
            max_tokens=max_tokens,
        )

    return DataLoader(
        dataset,
        # Built for the rank known now, again at first use under a process group that says
        # otherwise (a loader built in main(), before fit); Lightning calls set_epoch on
        # batch_sampler.sampler only: the deferred sampler relays it.
        batch_sampler=DeferredBatchSampler(build, regroup=auto),
        # An empty share (a size of 0, the short last step) is one real sample of weight 0.
        collate_fn=evendp.EmptySafeCollate(dataset, collate_fn, stand_in=True),
        **loader_kwargs,
    )


class UnevenGradient(pl.Callback):
    """Make the accumulated, DDP-averaged gradient the mean over the step's global batch.

    ``training_step`` returns a mean over what ``count_fn(batch)`` counts (default
    :func:`count_samples`), or its sum (``reduction="sum"``). Each micro-batch's loss is
    weighted by its count (a stand-in's by exactly 0); before the optimizer step one
    all-reduce sums the step's count and loss, the gradients are multiplied by
    ``accumulate_grad_batches * world_size / count``, and the global mean loss is logged as
    ``log_name`` (``None``: not).

    >>> UnevenGradient().count_fn((torch.zeros(5, 2),))
    5
    """

    def __init__(
        self,
        count_fn: Callable[[Any], int | torch.Tensor] | None = None,
        *,
        reduction: str = "mean",
        log_name: str | None = "loss",
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise evendp.EvendpError(
                f"reduction must be 'mean' or 'sum' (what training_step returns), got {reduction!r}"
            )
        self.count_fn = count_samples if count_fn is None else count_fn
        self.reduction = reduction
        self.log_name = log_name
        self._local: int | torch.Tensor = 0  # items counted since the last optimizer step
        self._batch: int | torch.Tensor = 0  # items of the current micro-batch
        self._sum: torch.Tensor | float = 0.0  # loss summed since the last optimizer step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise evendp.EvendpError(
                "UnevenGradient needs automatic optimization (it rescales gradients before "
                "Lightning's optimizer step); with manual optimization use evendp.StepMean"
            )
        self._local, self._sum = 0, 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = 0 if evendp.is_stand_in(batch) else self.count_fn(batch)
        self._local = self._local + self._batch

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # ``loss`` is training_step's value / accumulate_grad_batches (times the AMP scale),
        # a fresh tensor that Lightning backwards next: weighting it in place weights backward.
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16's GradScaler
        unscale = trainer.accumulate_grad_batches / (
            scaler.get_scale() if scaler is not None else 1.0
        )
        weight: int | torch.Tensor = self._batch if self.reduction == "mean" else 1
        if isinstance(self._batch, int) and self._batch == 0:
            weight = 0  # a stand-in (or empty) share: weight exactly 0
        # The exact core's weighting: a share with no counted item adds 0, never NaN x 0.
        with torch.no_grad():
            self._sum = self._sum + evendp.share_loss(loss.detach().double() * unscale, weight)
        loss.copy_(evendp.share_loss(loss, weight))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        device = pl_module.device  # the rank's own: its GPU under NCCL, gloo takes any
        pair = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(device) for v in (self._local, self._sum)]
        )  # (2,): count, loss sum; one all-reduce for both
        if trainer.world_size > 1:
            torch.distributed.all_reduce(pair)
        self._local, self._sum = 0, 0.0
        total = float(pair[0])
        # Lightning divided each micro-batch's loss by accumulate_grad_batches, DDP by world.
        scale = trainer.accumulate_grad_batches * trainer.world_size / total if total else 0.0
        for grad in [p.grad for g in optimizer.param_groups for p in g["params"]]:
            if grad is not None:
                grad.mul_(scale)
        if self.log_name is not None:
            mean = (pair[1] / pair[0]).float()  # the same on every rank: no sync_dist needed
            pl_module.log(self.log_name, mean, on_step=True, prog_bar=True)


class SpeedBalance(pl.Callback):
    """Move samples from slow ranks to fast ones at every optimizer step (Lightning DDP).

    Times ``training_step`` (up to ``backward``, which waits for the slowest rank) and the
    update; :class:`evendp.SpeedBalancer` (``knobs``) then re-splits the sampler of
    :func:`uneven_dataloader` alike on every rank: each step's samples stay the same.

    >>> SpeedBalance(warmup=2).knobs
    {'warmup': 2}
    """

    def __init__(self, **knobs: Any) -> None:
        self.knobs = knobs
        self.balancer: Any = Unbalanced()
        self._timed = contextlib.ExitStack()  # the forward's, then the update's timer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = resizable(loader := trainer.train_dataloader)
        if sampler is None:
            raise evendp.EvendpError(
                f"SpeedBalance needs the training loader from evendp's uneven_dataloader, got "
                f"{type(loader).__name__}; return uneven_dataloader(...) from train_dataloader() "
                "and pass Trainer(use_distributed_sampler=False)"
            )
        # One process has no ranks to balance; Lightning's loop: applied where decided.
        speed = trainer.world_size > 1
        self.balancer = resplitting(sampler, **self.knobs) if speed else Unbalanced()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._timed.enter_context(self.balancer.measure(count_samples(batch)))

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._timed.close()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.balancer.step()
        # The update that follows is this rank's own compute (the gradients were reduced in
        # backward): timed until the batch ends, so it counts in the next exchange.
        self._timed.enter_context(self.balancer.measure(0))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._timed.close()
