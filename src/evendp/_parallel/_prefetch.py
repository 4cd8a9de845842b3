"""Batches prepared ahead of the step: a background thread collates (and pins) the next ones.

Collation (indexing the dataset, stacking samples) runs on the host; done in the training
loop's own thread it leaves the devices idle between steps. :class:`Prefetcher` runs it in a
daemon thread, ``depth`` batches ahead, and pins the tensors when the batch will be copied to
a GPU so those copies run asynchronously.

Each item carries its ``(epoch, index)`` so the consumer records the position of the batch it
*trained on*, not of the one being prepared: a checkpoint taken while the next batches wait
in the queue still resumes exactly after the last trained one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._distributed._step_layout import StepLayout
from ._scatter import map_tensors

__all__ = ["Prefetcher", "Prepared", "pin", "wants_pinning"]


@dataclass
class Prepared:
    """One collated batch, where it comes from, and its step's layout over every rank.

    ``layout`` says each rank's and each device's rows (the batch holds this rank's, device
    by device); its ``samples`` (not a "count": counts are the items a loss is a mean over)
    are the step's global batch, known to every rank with no communication.
    """

    batch: Any
    epoch: int
    index: int
    layout: StepLayout
    counted: float | None = None  # the step's counted items over ranks, from Trainer(counts=)


class Prefetcher:
    """Iterate ``produce()``'s items, made ``depth`` ahead in a thread (``depth=0``: inline).

    >>> items = iter(range(3))
    >>> with Prefetcher(lambda: items, depth=2) as ahead:
    ...     list(ahead)
    [0, 1, 2]
    """

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int = 2) -> None:
        self._produce = produce
        self._depth = depth
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inline: Iterator[Any] | None = None

    def __enter__(self) -> Prefetcher:
        if self._depth == 0:
            self._inline = self._produce()
        else:
            self._thread = threading.Thread(target=self._run, name="evendp-prefetch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for item in self._produce():
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as error:  # handed to the consumer, raised in its thread
            self._put(("error", error))

    def _put(self, item: tuple[str, Any]) -> bool:
        """Queue ``item`` for the consumer; ``False`` once it has left (``__exit__``)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def items(self) -> Iterator[Any]:
        """The items: ``produce()``'s own iterator when inline (no hop per item), else this."""
        return self if self._inline is None else self._inline

    def __next__(self) -> Any:
        if self._inline is not None:
            return next(self._inline)
        kind, value = self._queue.get()
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise value
        return value

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def pin(batch: Any) -> Any:
    """``batch`` with every CPU tensor in page-locked memory (for asynchronous GPU copies)."""
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def wants_pinning(devices: list[torch.device]) -> bool:
    """Pin only when some device is a GPU that can use it (pinning costs host memory)."""
    return any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
