"""``StepMean``: a hand-written DDP loop whose model returns a per-rank mean, made exact.

nanoGPT's shape (``logits, loss = model(X, Y)``, this rank's mean over its micro-batch) under
uneven batch sizes over-weights the samples of small ranks. Two calls fix it, with no count
needed before the first backward: ``step.weigh(loss, Y)`` per micro-batch (the rank's *sum*
over its counted items; a stand-in batch weighs 0), and ``step.finish(model)`` per optimizer
step, before clipping: one all-reduce of the step's count and loss sum, then the gradients
times ``world_size / count``. ``step.loss`` is then the global batch's mean on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core._counting import holds_ignored, uncounted_warning
from .._core._errors import EvendpError
from .._core._exact import is_stand_in, share_loss
from .._core._validate import validate_callable
from ._group import all_reduce_sum, comm_device, world_size

__all__ = ["StepMean", "validate_group"]


def validate_group(group: object) -> None:
    """An :class:`EvendpError` unless ``group`` is a ``ProcessGroup`` or ``None``.

    >>> validate_group(None)
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise EvendpError(
            f"group must be a torch.distributed ProcessGroup or None (the default group), "
            f"got {group!r}"
        )


def count_rows(batch: Any) -> int:
    """Rows of a batch (the length of its first tensor), 0 for a stand-in.

    A mapping with ``labels`` counts the labels' rows.

    >>> count_rows(torch.zeros(3, 5)), count_rows({"x": torch.zeros(2, 4), "labels": None})
    (3, 2)
    """
    if is_stand_in(batch):
        return 0
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, dict) and isinstance(batch.get("labels"), torch.Tensor):
        return count_rows(batch["labels"])
    values = batch.values() if hasattr(batch, "values") else batch
    for value in values if isinstance(values, Iterable) else ():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise EvendpError(
        f"cannot count the samples of a {type(batch).__name__} batch: no tensor with a batch "
        "dimension; pass count_fn=... (the items the loss is a mean over)"
    )


class StepMean:
    """Per-rank mean losses in, the gradient and loss of the global-batch mean out.

    ``count_fn(batch)``: the items the model's loss is a mean over (default
    :func:`count_rows`, warned once when the batch holds ``-100`` labels; for tokens
    :func:`evendp.count_tokens`, e.g. ``count_tokens(shift=True)``). A stand-in batch counts 0.

    >>> model = torch.nn.Linear(2, 1, bias=False)
    >>> step = StepMean()
    >>> for x in (torch.ones(1, 2), torch.ones(3, 2)):  # two micro-batches of 1 and 3 samples
    ...     step.weigh(model(x).pow(2).mean(), x).backward()
    >>> mean = step.finish(model)  # the gradient is now the one of the mean over 4 samples
    >>> float(mean) == float(model(torch.ones(4, 2)).pow(2).mean())
    True
    """

    def __init__(
        self,
        count_fn: Callable[[Any], int | float | torch.Tensor] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        validate_callable("count_fn", count_fn, "a function batch -> items", allow_none=True)
        validate_group(group)
        self.count_fn = count_rows if count_fn is None else count_fn
        # Counting rows of a batch with ignored labels is the usual mistake: warned once.
        self._count_checked = count_fn is not None
        self.group = group
        self.loss: torch.Tensor | None = None  # the last finished step's global mean loss
        self._reset()

    def _reset(self) -> None:
        self._count: torch.Tensor | float = 0.0
        self._sum: torch.Tensor | float = 0.0

    def weigh(self, loss: torch.Tensor, batch: Any) -> torch.Tensor:
        """``loss`` (a mean over ``count_fn(batch)`` items) as their sum: the tensor to backward.

        A stand-in batch or a count of 0 gives a connected zero (never NaN).
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise EvendpError(
                f"loss must be a 0-dim tensor (this micro-batch's mean loss), got {loss!r}"
            )
        if not self._count_checked and self.count_fn is count_rows:
            self._count_checked = True  # once: reads the batch on the host
            if holds_ignored(batch):
                uncounted_warning("StepMean(count_fn=None)", stacklevel=2)
        count = 0 if is_stand_in(batch) else self.count_fn(batch)
        self._count = self._count + (count.detach() if isinstance(count, torch.Tensor) else count)
        local_sum = share_loss(loss, count)
        self._sum = self._sum + local_sum.detach().to(torch.float64)
        return local_sum

    def finish(self, model: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
        """End the step: the gradients become the global mean's; returns the global mean loss.

        On every rank after the step's last backward, before clipping (one all-reduce). The
        result, kept as ``self.loss``, is the same on every rank (NaN when no rank had an item).
        """
        device = comm_device(self.group)
        pair = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(device) for v in (self._count, self._sum)]
        )  # (2,): count, loss sum
        world = world_size(self.group)
        if world > 1:
            pair = all_reduce_sum(pair, self.group)
        self._reset()
        count, total = pair[0], pair[1]
        # DDP/FSDP2 averaged the summed gradients over the ranks: times world / count.
        # A Python number: it multiplies plain and sharded (DTensor) gradients alike.
        scale = world / float(count) if float(count) > 0 else 0.0
        params = model.parameters() if isinstance(model, nn.Module) else model
        for param in params:
            if param.grad is not None:
                param.grad.mul_(scale)
        self.loss = (total / count).float()
        return self.loss
