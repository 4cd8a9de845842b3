"""Calling a model on a batch the way models take it, and setting its mode for a block.

Shared by the planner's measuring, prediction, evaluation and the strategies: one rule for how
a dict, a tuple or a single tensor becomes a model's arguments.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from ._deprecation import REMOVAL

__all__ = ["DictBatch", "as_args", "as_batch", "call", "model_mode"]


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


class DictBatch(dict[str, Any]):
    """A dict batch as ``loss_fn`` and ``count_fn`` get it: the dict itself.

    Up to evendp 0.1 the Trainer handed them ``(batch,)``, a one-tuple around the dict; code
    that still reads ``batch[0]`` gets the dict back, with a ``DeprecationWarning``, until
    the release that drops the old spellings. (Why this and not a flag or a look at the
    function's signature: both spellings look the same in a signature, and the old form only
    ever read ``batch[0]``, an int key no dict batch of keywords holds.)

    >>> import warnings
    >>> batch = DictBatch({"x": 1})
    >>> batch["x"], isinstance(batch, dict)
    (1, True)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     batch[0]["x"]
    1
    >>> caught[0].category.__name__
    'DeprecationWarning'
    """

    def __missing__(self, key: Any) -> Any:
        if type(key) is int and key == 0:
            warnings.warn(
                "loss_fn/count_fn read batch[0], the old (dict,) form of a dict batch; the "
                f"batch is now the dict itself (batch['input_ids']), and batch[0] goes in "
                f"evendp {REMOVAL}",
                DeprecationWarning,
                stacklevel=2,
            )
            return self
        raise KeyError(key)


def as_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The batch as ``loss_fn`` and ``count_fn`` take it, from how a loss module was called.

    The strategies call it with :func:`as_args` (a dict batch as its one argument), the
    planner with :func:`call` (a dict as keywords): a dict comes back as a :class:`DictBatch`;
    a tuple batch as the tuple of its items, a tensor batch as ``(tensor,)`` as before.

    >>> as_batch(({"x": 1},), {}), as_batch((), {"x": 1}), as_batch((1, 2), {})
    ({'x': 1}, {'x': 1}, (1, 2))
    """
    if kwargs and not args:
        return DictBatch(kwargs)
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        return DictBatch(args[0])
    if kwargs:
        return (*args, DictBatch(kwargs))
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
