"""A batch for a rank with no samples: :class:`EmptySafeCollate`.

A rank whose batch is empty (its size is 0, or the epoch's short last step left it nothing)
still runs forward and backward so the all-reduce matches; ``default_collate([])`` raises, so
the collate gives it a real batch of 0 rows, or one stand-in row weighed exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

from .._core._exact import stand_in_batch

__all__ = ["EmptySafeCollate"]


def _empty_like_batch(batch: Any) -> Any:
    """A collated one-sample batch with its batch dimension cut to zero."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({k: _empty_like_batch(v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        # A list of leaves (strings, objects) is itself the batch; otherwise it holds fields.
        if all(not isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            return type(batch)()
        fields = [_empty_like_batch(v) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*fields)
        return type(batch)(fields)
    return batch


class EmptySafeCollate:
    """Wrap a collate function so an empty index list gives a batch a model can run, not an error.

    ``torch.utils.data.default_collate([])`` raises ``IndexError``. A rank whose batch size is 0
    (or that gets nothing in the epoch's short last step) must still run forward and backward
    so DDP's all-reduce matches, so it needs a real batch. By default this collates the sample
    ``dataset[0]`` once and cuts every tensor to length 0 along dim 0, keeping dtype and the
    trailing shape. With ``stand_in=True`` it gives that one real sample instead, every tensor
    marked as a stand-in (see :func:`evendp.is_stand_in`): models that cannot forward 0 rows
    (GPT-2, BERT) run it, and evendp's loss helpers (:class:`evendp.StepMean`, the
    integrations) give it weight exactly 0. Non-empty batches go to ``collate_fn`` unchanged.
    Picklable, so it works with ``num_workers > 0``.

    >>> data = [(torch.ones(3), 1), (torch.zeros(3), 0)]
    >>> x, y = EmptySafeCollate(data)([])
    >>> x.shape, y.shape, y.dtype
    (torch.Size([0, 3]), torch.Size([0]), torch.int64)
    >>> from evendp import is_stand_in
    >>> x, y = EmptySafeCollate(data, stand_in=True)([])
    >>> x.shape, is_stand_in((x, y))
    (torch.Size([1, 3]), True)
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        stand_in: bool = False,
    ):
        self.dataset = dataset
        self.collate_fn: Callable[[list[Any]], Any] = (
            default_collate if collate_fn is None else collate_fn
        )
        self.stand_in = stand_in
        self._empty: Any = None

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._empty is None:
            one = self.collate_fn([self.dataset[0]])
            self._empty = stand_in_batch(one) if self.stand_in else _empty_like_batch(one)
        return self._empty
