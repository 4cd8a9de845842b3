"""Calling a model on a batch the way models take it, and setting its mode for a block.

Shared by the planner's measuring, prediction, evaluation and the strategies: one rule for how
a dict, a tuple or a single tensor becomes a model's arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["as_args", "call", "model_mode"]


def call(module: Callable[..., Any], inputs: Any) -> Any:
    """``module`` on ``inputs`` as a model takes them: a dict as keywords, a tuple or list as
    positional arguments, anything else as the one argument.

    >>> call(lambda a, b=0: a + b, {"a": 1, "b": 2}), call(max, (1, 3)), call(abs, -4)
    (3, 3, 4)
    """
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*as_args(inputs))


def as_args(batch: Any) -> tuple[Any, ...]:
    """``batch`` as positional arguments: its items for a tuple or list, else itself alone.

    The Trainer's loss modules take a batch this way and rebuild it as a tuple, so a dict
    batch reaches ``loss_fn`` whole.

    >>> as_args((1, 2)), as_args({"x": 1})
    ((1, 2), ({'x': 1},))
    """
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


@contextlib.contextmanager
def model_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Set every submodule's ``training`` flag for the block, then give back the old flags."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, flag in modes.items():
            m.training = flag
