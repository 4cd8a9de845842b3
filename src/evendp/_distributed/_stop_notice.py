"""Every rank stops after the same step, agreed through the process group's store, not a tensor.

A rank that received SIGINT or SIGTERM posts "stop after step ``s``" in the store torchrun's
ranks share (set once: the first poster wins); every rank looks for it after each step, a host
lookup that never waits for the device. ``s`` is the step in progress when the request is seen
before one of its backward passes, else the next. In time for all: the poster writes before
it joins step ``s``'s last gradient collective, which no rank can finish before that. Each
``fit`` has its own key, so an interrupted run's notice never stops the next.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

__all__ = ["StopNotice", "group_store"]

# Every rank runs the same fits in the same order: the n-th fit has the same key everywhere.
_FITS = itertools.count(1)


class StopNotice:
    """The stop request of one ``fit`` across ranks, in the process group's ``store``.

    >>> import signal
    >>> notice = StopNotice(dist.HashStore())
    >>> notice.due(step=3) is None
    True
    >>> notice.post(int(signal.SIGTERM), step=3)  # received during step 3: stop after 4
    >>> notice.post(int(signal.SIGINT), step=4)  # a later request changes nothing
    >>> notice.due(step=3), notice.due(step=4) == signal.SIGTERM
    (None, True)
    """

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._key = f"evendp/stop/{next(_FITS)}"
        self._posted = False
        self._notice: tuple[int, int] | None = None  # (stop after step, signal), once read

    def post(self, signum: int, step: int) -> None:
        """This rank received ``signum`` with ``step`` steps done: stop after the next one."""
        if self._posted:
            return
        self._posted = True
        # compare_set: set only when absent, so the first request is every rank's.
        self._store.compare_set(self._key, "", f"{step + 1}:{signum}")

    def due(self, step: int) -> int | None:
        """The agreed signal when every rank stops after ``step`` (steps done), else ``None``."""
        if self._notice is None and self._store.check([self._key]):
            at, signum = self._store.get(self._key).decode().split(":")
            self._notice = (int(at), int(signum))
        if self._notice is not None and step >= self._notice[0]:
            return self._notice[1]
        return None


def group_store() -> dist.Store:
    """The store of the default process group."""
    # A private accessor, stable since torch 1.x; the public API offers none.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
