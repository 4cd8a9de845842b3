"""Calling a model on a batch the way models take it, and setting its mode for a block.

Shared by the planner's measuring, prediction, evaluation and the strategies: one rule for how
a dict, a tuple or a single tensor becomes a model's arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

__all__ = ["as_args", "as_batch", "call", "model_mode"]


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


def as_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The batch as ``loss_fn`` and ``count_fn`` take it, from how a loss module was called.

    The strategies call it with :func:`as_args` (a dict batch as its one argument), the
    planner with :func:`call` (a dict as keywords): a dict comes back as a plain ``dict``;
    a tuple batch as the tuple of its items, a tensor batch as ``(tensor,)``.

    >>> as_batch(({"x": 1},), {}), as_batch((), {"x": 1}), as_batch((1, 2), {})
    ({'x': 1}, {'x': 1}, (1, 2))
    """
    if kwargs and not args:
        return dict(kwargs)
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        return dict(args[0])
    if kwargs:
        return (*args, dict(kwargs))
    return args


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
