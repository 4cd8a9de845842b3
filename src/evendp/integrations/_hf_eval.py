"""Exact evaluation for :class:`~evendp.integrations.transformers.UnevenTrainer`.

One process's batches of ``per_device_eval_batch_size`` rows, in dataset order, each split
over the ranks as a training step is (:func:`evendp.layout_step`; an empty piece runs a
stand-in), its loss taken over all ranks and weighted as one process's loop weighs it; the
rows come back in dataset order, each once. (Batches of ``B * world_size`` rows gave a tiny
Marian 5.44997 where one process gives 5.53057.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

import evendp

__all__ = ["EvalMeans", "EvalPieces"]


class EvalPieces:
    """A batch sampler: this rank's rows of each evaluation batch of ``batch`` rows.

    >>> [list(EvalPieces(7, 4, [1, 3], rank)) for rank in (0, 1)]
    [[[0], [4]], [[1, 2, 3], [5, 6]]]
    >>> list(EvalPieces(5, 4, [0, 2], 0)), EvalPieces(5, 4, [0, 2], 0).batch_rows
    ([[], []], [4, 1])
    """

    def __init__(self, rows: int, batch: int, sizes: Sequence[int], rank: int) -> None:
        self.batch, self.sizes, self.rank = batch, list(sizes), rank
        #: The rows of each evaluation batch, over all ranks (the last may be short).
        self.batch_rows = [min(batch, rows - start) for start in range(0, rows, batch)]

    def __iter__(self) -> Iterator[list[int]]:
        for k, rows in enumerate(self.batch_rows):
            # Rows to ranks as a training step's are (the one layout), in dataset order.
            step = range(k * self.batch, k * self.batch + rows)
            yield evendp.layout_step(step, self.sizes).rank_indices(self.rank)

    def __len__(self) -> int:
        return len(self.batch_rows)


class EvalMeans:
    """Each evaluation batch's loss over all ranks, and the run's ``eval_loss`` from them."""

    def __init__(self, pieces: EvalPieces, *, by_rows: bool = True) -> None:
        self.pieces = pieces
        self.by_rows = by_rows  # a short last batch weighs its rows, else a full batch's
        self.means: list[float] = []

    def add(
        self, loss: torch.Tensor, count: int | torch.Tensor, *, summed: bool = False
    ) -> torch.Tensor:
        """This batch's loss over all ranks (a collective, once per batch): ``loss`` is the
        mean over this rank's ``count`` items or, ``summed``, its part of the batch's loss."""
        part = loss.detach().float()
        if summed:
            mean = part
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(mean)  # on the loss's device: the rank's GPU under NCCL
        else:
            mean = evendp.global_mean(evendp.share_loss(part, count), count)
        self.means.append(float(mean))
        return mean.to(loss.dtype)

    def value(self, drop_nonfinite: bool) -> float:
        """The batches' mean loss weighted as one process's loop weighs them (by rows, else
        alike); ``drop_nonfinite`` (``logging_nan_inf_filter``) leaves non-finite ones out.

        >>> means = EvalMeans(EvalPieces(5, 4, [1], 0))
        >>> means.means = [1.0, 2.0]  # batches of 4 rows and 1
        >>> means.value(True)
        1.2
        """
        rows = self.pieces.batch_rows[: len(self.means)]
        if not self.by_rows:
            rows = [self.pieces.batch] * len(rows)
        kept = list(zip(rows, self.means, strict=True))
        if drop_nonfinite and any(math.isfinite(m) for _, m in kept):
            kept = [(r, m) for r, m in kept if math.isfinite(m)]
        return sum(r * m for r, m in kept) / sum(r for r, _ in kept)
