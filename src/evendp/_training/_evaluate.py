"""Evaluation over a whole dataset on uneven devices or ranks, exact as one device's.

Every metric is a ``(sum, count)`` pair: each device or rank adds up its own sums and counts,
and the metric is ``total sum / total count``: the value one device computes over the whole
evaluation set, whatever the split. The data are covered in order, every sample exactly once
(``UnevenBatchSampler`` without shuffling: no padding duplicates, unlike
``DistributedSampler``), and forward runs under ``torch.no_grad`` with the model in eval mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._core._calls import as_args, as_batch, model_mode
from .._core._errors import EvendpError
from .._core._exact import share_loss
from .._parallel._scatter import map_tensors, row_count

__all__ = ["EvalFn", "EvalRun", "evaluate_devices", "evaluate_ranks", "loss_eval_fn"]

Batch = Any
SumCount = tuple[Any, Any]
EvalFn = Callable[[nn.Module, Batch], Mapping[str, SumCount]]


@dataclass(frozen=True)
class EvalRun:
    """What an evaluation reads: the model, the data, ``eval_fn``, the samples of each step
    per process (one process: their sum, split over its devices), the collate of a list of
    sample indices, and autocast's context."""

    model: nn.Module
    data: Any
    eval_fn: EvalFn
    batch_sizes: Sequence[int]
    collate: Callable[[list[int]], Batch]
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def loss_eval_fn(
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    count_fn: Callable[[Batch], Any] | None = None,
) -> EvalFn:
    """The default ``eval_fn``: ``{"loss": (mean loss x count, count)}``, where the count is
    ``count_fn(batch)`` (e.g. non-ignored tokens) or the samples: the loss weighted as
    training weights it, so the result is one device's mean over the whole set.

    >>> fn = loss_eval_fn(lambda model, batch: model(batch[0]).mean())
    >>> s, n = fn(nn.Identity(), (torch.tensor([1.0, 3.0]),))["loss"]
    >>> float(s), n
    (4.0, 2)
    """

    def eval_fn(model: nn.Module, batch: Batch) -> dict[str, SumCount]:
        count = count_fn(batch) if count_fn is not None else row_count(batch) or 0
        loss = loss_fn(model, batch)
        # An empty share's mean is NaN (0/0): it counts nothing and adds exactly nothing.
        return {"loss": (share_loss(loss.detach().double(), count), count)}

    return eval_fn


def _validate_metrics(value: Any) -> dict[str, tuple[float, float]]:
    """``eval_fn``'s answer as plain float64 ``{name: (sum, count)}``."""
    if not isinstance(value, Mapping):
        raise EvendpError(
            f"eval_fn must return {{name: (sum, count)}}, got {type(value).__name__}; e.g. "
            "return {'accuracy': ((logits.argmax(-1) == y).sum(), y.numel())}"
        )
    out: dict[str, tuple[float, float]] = {}
    for name, pair in value.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise EvendpError(
                f"eval_fn's metric {name!r} must be a (sum, count) pair, got {pair!r}; a mean "
                "over the batch loses its weight: return (mean * count, count)"
            )
        total, count = (
            float(v.detach().double()) if torch.is_tensor(v) else float(v) for v in pair
        )
        if count < 0:
            raise EvendpError(f"eval_fn's metric {name!r} has a negative count {count}")
        out[str(name)] = (total if count > 0 else 0.0, count)
    return out


def _add(into: dict[str, list[float]], metrics: Mapping[str, tuple[float, float]]) -> None:
    for name, (total, count) in metrics.items():
        acc = into.setdefault(name, [0.0, 0.0])
        acc[0] += total
        acc[1] += count


def _means(sums: Mapping[str, Sequence[float]]) -> dict[str, float]:
    return {name: (s / c if c > 0 else float("nan")) for name, (s, c) in sums.items()}


class _EvalShard(nn.Module):
    """Runs ``eval_fn`` inside ``forward``: each device returns its own sums and counts."""

    def __init__(self, model: nn.Module, eval_fn: EvalFn) -> None:
        super().__init__()
        self.model = model
        self.eval_fn = eval_fn

    def forward(self, *args: Any, **kwargs: Any) -> Mapping[str, SumCount]:
        return self.eval_fn(self.model, as_batch(args, kwargs))  # as the Trainer's loss_fn


def evaluate_devices(
    run: EvalRun, *, device_ids: Sequence[Any] | None, weights: Sequence[float] | None
) -> dict[str, float]:
    """One process: ``sum(run.batch_sizes)`` samples per step, split over ``device_ids`` by
    ``weights`` (:class:`BalancedDataParallel` without gathering), every sample once, in order.

    >>> net = nn.Linear(3, 1)
    >>> x, y = torch.randn(7, 3), torch.randn(7, 1)
    >>> mse = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()
    >>> run = EvalRun(net, list(zip(x, y)), loss_eval_fn(mse), [3], lambda i: (x[i], y[i]))
    >>> got = evaluate_devices(run, device_ids=["cpu"] * 3, weights=[2, 0, 1])
    >>> abs(got["loss"] - mse(net, (x, y)).item()) < 1e-6
    True
    """
    from .._parallel._dp import BalancedDataParallel

    model, batch_size = run.model, sum(run.batch_sizes)
    shards = BalancedDataParallel(
        _EvalShard(model, run.eval_fn), device_ids, weights=weights, gather_output=False
    )
    sums: dict[str, list[float]] = {}
    n = len(run.data)
    with model_mode(model, False), torch.no_grad():
        for start in range(0, n, batch_size):
            batch = run.collate(list(range(start, min(start + batch_size, n))))
            with run.autocast():
                out = shards(*batch) if isinstance(batch, (tuple, list)) else shards(batch)
            for per_device in out.outputs:
                _add(sums, _validate_metrics(per_device))
    return _means(sums)


def evaluate_ranks(
    run: EvalRun, *, device: torch.device, every_step: bool = False
) -> dict[str, float]:
    """Under ``torchrun``: rank ``r`` evaluates ``run.batch_sizes[r]`` samples of each step
    (consecutive blocks, every sample once over all ranks), then the ranks add up their sums
    and counts. ``every_step=True`` (FSDP2: its forward all-gathers) runs the forward on an
    empty share too (on a stand-in sample), and counts nothing from it. Call it on every
    rank."""
    from .._distributed._sampler import UnevenBatchSampler

    rank, world, model = dist.get_rank(), dist.get_world_size(), run.model
    sampler = UnevenBatchSampler(
        run.data, run.batch_sizes, rank=rank, world_size=world, shuffle=False
    )
    steps = list(sampler)
    sums: dict[str, list[float]] = {}
    with model_mode(model, False), torch.no_grad():
        for indices in steps:
            if not indices and not every_step:
                continue
            # An empty share that must still run (FSDP2) runs one real sample, as training's
            # stand-in does (models may reject an empty batch), and counts none of it.
            batch = map_tensors(run.collate(list(indices) or [0]), lambda t: t.to(device))
            # As the Trainer calls loss_fn: the batch as a tuple of what was collated.
            args = as_batch(as_args(batch), {})
            with run.autocast():
                metrics = _validate_metrics(run.eval_fn(model, args))
            if indices:
                _add(sums, metrics)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, sums)  # names may differ where a rank ran nothing
    total: dict[str, list[float]] = {}
    for part in parts:  # rank order: the same float64 sum on every rank
        _add(total, {k: (v[0], v[1]) for k, v in part.items()})
    return _means(total)
