"""One error for all ranks: a fault one rank meets while saving or resuming is every rank's.

Else the other ranks wait in the next collective until gloo gives up ("Connection closed by
peer") and torchrun prints one traceback per rank. :func:`agreed` runs the action, the ranks
exchange what went wrong in one small collective, and every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .._core._errors import EvendpError

__all__ = ["agreed"]

T = TypeVar("T")


def agreed(action: Callable[[], T], distributed: bool) -> T:
    """``action()``; under ``distributed``, an :class:`EvendpError` on any rank raised on all.

    The first failing rank's error wins (lowest rank). One ``all_gather_object`` per call:
    only for saves and resumes, never per step.

    >>> agreed(lambda: 3, distributed=False)
    3
    """
    if not distributed:
        return action()
    import torch.distributed as dist

    result: T | None = None
    error: EvendpError | None = None
    try:
        result = action()
    except EvendpError as exc:
        error = exc
    gathered: list[tuple[type, str] | None] = [None] * dist.get_world_size()
    mine = None if error is None else (type(error), str(error))
    dist.all_gather_object(gathered, mine)
    first = next((g for g in gathered if g is not None), None)
    if first is not None:
        if error is None or (type(error), str(error)) != first:
            kind, message = first
            error = kind(message)
        error.every_rank = True  # a rank may end on it alone
        raise error
    return result  # type: ignore[return-value]
