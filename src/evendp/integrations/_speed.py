"""The speed balance as the integrations run it: a :class:`evendp.SpeedBalancer` that re-splits
their sampler, nothing in one process, and the rows it times (a batch's, a forward's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import evendp

__all__ = ["Unbalanced", "batch_rows", "resizable", "resplitting", "time_forward"]


class Unbalanced:
    """No speed balance (one process, or not asked): nothing timed, nothing moved."""

    active = False

    def __init__(self) -> None:
        self.history: list[tuple[int, list[int]]] = []

    def measure(self, samples: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self) -> bool:
        return False


def resizable(loader: Any) -> Any:
    """The sampler that takes ``set_batch_sizes`` inside a loader from an ``uneven_dataloader``
    (behind Accelerate's or evendp's wrapper), else ``None``."""
    sampler = loader
    for _ in range(4):  # DataLoaderShard -> BatchSamplerShard -> InterleavedBatchSampler
        sampler = getattr(sampler, "batch_sampler", None)
        if hasattr(sampler, "set_batch_sizes"):
            return sampler
    return None


def resplitting(sampler: Any, caps: Any = None, **knobs: Any) -> evendp.SpeedBalancer:
    """A :class:`evendp.SpeedBalancer` from ``sampler``'s sizes whose every new split goes to
    ``sampler.set_batch_sizes`` where it is decided, before a caller's own ``on_resplit``."""
    theirs = knobs.get("on_resplit")

    def resplit(sizes: list[int]) -> None:
        sampler.set_batch_sizes(sizes)
        if theirs is not None:
            theirs(sizes)

    if theirs is None or callable(theirs):  # else the balancer names the bad value
        knobs["on_resplit"] = resplit
    return evendp.SpeedBalancer(sampler.batch_sizes, caps, **knobs)


def time_forward(
    module: nn.Module, measure: Callable[[int], contextlib.AbstractContextManager[None]]
) -> list[Any]:
    """Time every training-mode forward of ``module`` as this rank's compute for a balancer.

    For loops whose forward cannot be wrapped in ``measure`` (a framework calls it): a
    pre-hook opens ``measure(rows)`` (a balancer's), a hook closes it. Only the forward is timed:
    under DDP the backward waits for the slowest rank, which would hide who is slow.
    Returns the hook handles (``.remove()`` them to stop).

    >>> net = nn.Linear(2, 2)
    >>> handles = time_forward(net, lambda n: print("measured", n) or contextlib.nullcontext())
    >>> _ = net(torch.zeros(3, 2))
    measured 3
    """
    open_blocks: list[contextlib.AbstractContextManager[None]] = []

    def start(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if mod.training and torch.is_grad_enabled():
            block = measure(batch_rows((*args, *kwargs.values())))
            block.__enter__()
            open_blocks.append(block)

    def stop(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if open_blocks:
            open_blocks.pop().__exit__(None, None, None)

    return [
        # First in, last out: the timer brackets the module's other hooks too.
        module.register_forward_pre_hook(start, with_kwargs=True, prepend=True),
        module.register_forward_hook(stop, with_kwargs=True),
    ]


def batch_rows(batch: Any, fix: str | None = None) -> int:
    """A batch's rows: a mapping's ``labels``', else its first tensor's with a batch
    dimension; when it has none, 0 or (``fix``) an error naming the batch and the fix.

    >>> batch_rows({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3)}), batch_rows([])
    (3, 0)
    """
    values = [batch] if isinstance(batch, torch.Tensor) else batch
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        values = [labels] if isinstance(labels, torch.Tensor) else batch.values()
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    if fix is None:
        return 0
    what = f"batch with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""
    raise evendp.EvendpError(
        f"cannot count the samples of a {what or f'{type(batch).__name__} batch'}: no tensor "
        f"with a batch dimension; {fix}"
    )
