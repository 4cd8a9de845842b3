"""``EngineMean``: a hand-written DeepSpeed engine loop whose model returns a per-rank mean.

Under ZeRO the gradients never sit in ``param.grad`` where :class:`evendp.StepMean` could
rescale them, so the loss carries the weight before ``engine.backward``: the micro-batch's sum
times ``world_size * accumulation / count of the whole step`` (``_exact.averaged_scale``). So
:meth:`EngineMean.steps` counts each step's micro-batches first (one all-reduce per step) and
sets the engine's boundary on its last: an epoch's short last step never borrows the next's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._core._errors import EvendpError
from .._core._exact import averaged_scale, is_stand_in, share_loss
from .._core._validate import validate_callable, validate_numbers
from ._group import global_count, world_size
from ._step_mean import count_rows, validate_group

__all__ = ["EngineMean", "config_micro_batch"]


class EngineMean:
    """Per-micro-batch mean losses in, the loss for DeepSpeed's ``engine.backward`` out.

    ``engine``: what ``deepspeed.initialize`` returned (any ZeRO stage). ``count_fn(batch)``:
    the items the model's loss is a mean over (default: the batch's rows; for tokens e.g.
    ``lambda b: (b["labels"] != -100).sum()``); a stand-in batch counts 0. The ranks must each
    yield the same number of batches (:class:`evendp.UnevenBatchSampler` does).

    ``for batches in mean.steps(loader)`` yields one optimizer step's micro-batches; for each,
    ``engine.backward(mean.weigh(loss, batch))`` then ``engine.step()``. DeepSpeed's clipping
    then clips the gradient of the mean over the step's samples, as one process would.

    >>> class Engine:  # what the helper reads of a DeepSpeed engine: one process here
    ...     def gradient_accumulation_steps(self): return 2
    ...     def set_gradient_accumulation_boundary(self, is_boundary): self.boundary = is_boundary
    >>> engine, w = Engine(), torch.tensor(1.0, requires_grad=True)
    >>> mean = EngineMean(engine)
    >>> for batches in mean.steps([torch.ones(1), torch.ones(3)]):  # micro-batches of 1 and 3
    ...     for x in batches:
    ...         loss = mean.weigh((w * x).mean(), x)  # engine.backward divides it by 2
    ...         print(float(loss) / 2, engine.boundary)
    0.25 False
    0.75 True
    """

    def __init__(
        self,
        engine: Any,
        count_fn: Callable[[Any], int | float | torch.Tensor] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not callable(getattr(engine, "gradient_accumulation_steps", None)):
            raise EvendpError(
                f"engine must be the DeepSpeed engine deepspeed.initialize returned, got "
                f"{type(engine).__name__} (no gradient_accumulation_steps()); pass engine, not "
                "engine.module"
            )
        validate_callable("count_fn", count_fn, "a function batch -> items", allow_none=True)
        validate_group(group)
        self.engine = engine
        self.count_fn = count_rows if count_fn is None else count_fn
        self.group = group
        self._total: torch.Tensor | None = None  # the current step's count over all ranks
        self._left = 0  # micro-batches of the current step not weighed yet

    def _count(self, batch: Any) -> int | float | torch.Tensor:
        return 0 if is_stand_in(batch) else self.count_fn(batch)

    def steps(self, loader: Iterable[Any]) -> Iterator[list[Any]]:
        """``loader``'s batches, one optimizer step's micro-batches at a time, counted.

        ``gradient_accumulation_steps()`` of them (the loader's last step fewer), counted on
        all ranks by one all-reduce.
        """
        accumulation = int(self.engine.gradient_accumulation_steps())
        batches = iter(loader)
        while window := list(itertools.islice(batches, accumulation)):
            local = sum((self._count(batch) for batch in window), start=0)
            self._total = global_count(local, group=self.group)
            self._left = len(window)
            yield window
        self._total = None

    def weigh(self, loss: torch.Tensor, batch: Any) -> torch.Tensor:
        """``loss`` (a mean over ``count_fn(batch)`` items) as the tensor for ``engine.backward``.

        Once DeepSpeed divided it by the accumulation steps and averaged it over the ranks,
        its gradient is this micro-batch's share of the step's global mean (a stand-in batch
        or a count of 0: a connected zero). Once per micro-batch of :meth:`steps`, in order.
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise EvendpError(
                f"loss must be a 0-dim tensor (this micro-batch's mean loss), got {loss!r}"
            )
        if self._total is None or self._left <= 0:
            raise EvendpError(
                "EngineMean.weigh weighs a micro-batch of the step that "
                "`for batches in mean.steps(loader)` yielded, once each; call it inside that "
                "loop, for every micro-batch of the step"
            )
        self._left -= 1
        # DeepSpeed steps on the boundary: the last micro-batch of this step, short or not.
        self.engine.set_gradient_accumulation_boundary(self._left == 0)
        local_sum = share_loss(loss, self._count(batch))
        ranks = world_size(self.group)
        scale = averaged_scale(
            self._total,
            ranks=ranks,
            divided_by=int(self.engine.gradient_accumulation_steps()),
            dtype=local_sum.dtype,
        )
        return local_sum * scale.to(local_sum.device)  # type: ignore[union-attr]


def config_micro_batch(batch_sizes: Sequence[int]) -> int:
    """The ``train_micro_batch_size_per_gpu`` to give DeepSpeed for per-rank ``batch_sizes``.

    DeepSpeed takes one for every rank, only for its throughput log and sample counter: the
    mean per rank, rounded up, keeps that log close.

    >>> config_micro_batch([1, 3]), config_micro_batch([0, 5])
    (2, 3)
    """
    validate_numbers("batch_sizes", batch_sizes, integral=True, example="batch_sizes=[1, 3]")
    return max(1, math.ceil(sum(batch_sizes) / max(1, len(batch_sizes))))
