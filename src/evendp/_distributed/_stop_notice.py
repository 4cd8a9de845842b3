"""Every rank stops after the same step, agreed through the process group's store, not a tensor.

A rank that received SIGINT or SIGTERM posts "stop after step ``s``" in the store that
torchrun's ranks already share (the key is set once: the first poster wins, so every rank reads
the same step and signal). Every rank looks for the notice after each step, a host-side store
lookup that never waits for the device.

Which ``s``: the step in progress when the request is seen before one of the step's backward
passes, else (seen after the step's last backward) the next one. Why every rank sees it in
time: the poster writes before it joins step ``s``'s last gradient collective (every strategy
runs at least one per step, empty shares included), and no rank can finish step ``s`` before
that. So every rank has seen the notice by the end of step ``s``, and none has passed it: they
stop after the same step.

Each ``fit`` gets its own key (every rank counts its fits alike), so a notice from an
interrupted run never stops the next one in the same process group.
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
    """The store of the default process group (torchrun's, or the one ``init_process_group``
    was given)."""
    # A private accessor, stable since torch 1.x; the public API offers none.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
