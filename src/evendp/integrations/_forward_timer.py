"""Timing a framework's forward passes for the speed balance (``UnevenTrainer``): hooks
open the balancer's ``measure(rows)`` around each training-mode forward of the model."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["time_forward"]


def _rows_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The batch dimension of a forward call's first tensor (positional, else keyword)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def time_forward(module: nn.Module, balancer: Any) -> list[Any]:
    """Time every training-mode forward of ``module`` as this rank's compute for the balancer.

    For loops whose forward cannot be wrapped in ``measure`` (a framework calls it): a
    pre-hook opens ``balancer.measure(rows)``, a hook closes it. Only the forward is timed:
    under DDP the backward waits for the slowest rank, which would hide who is slow.
    Returns the hook handles (``.remove()`` them to stop).

    >>> import contextlib
    >>> class Log:
    ...     def measure(self, samples):
    ...         print("measured", samples)
    ...         return contextlib.nullcontext()
    >>> net = nn.Linear(2, 2)
    >>> handles = time_forward(net, Log())
    >>> _ = net(torch.zeros(3, 2))
    measured 3
    """
    open_blocks: list[contextlib.AbstractContextManager[None]] = []

    def start(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if mod.training and torch.is_grad_enabled():
            block = balancer.measure(_rows_of(args, kwargs))
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
