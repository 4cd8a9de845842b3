"""``ParallelCriterion``: a loss on every device from a :class:`Scattered` (what
``BalancedDataParallel(..., gather_output=False)`` returns: per-device outputs and their split;
:func:`gather` joins them), combined exactly.

Each device scores its own outputs against its share of the targets (no gather on one device);
the per-device means are weighted by what each one counts, so the loss, and its gradient, equal
one device's on the whole batch. The checks of a count and of a callable live here, for
``BalancedDataParallel`` too; each names the value, what was expected and the fix.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .._core._counting import holds_ignored, uncounted_warning
from .._core._errors import EvendpError
from .._core._exact import combine_means
from ._replicate import parallel_apply, replicate
from ._scatter import gather_outputs, row_count, scatter

__all__ = [
    "Count",
    "ParallelCriterion",
    "Scattered",
    "describe",
    "gather",
    "validate_callable",
    "validate_counts",
]

#: What a count function may return: a number of items, as an int or a 0-dim tensor.
Count = int | float | torch.Tensor


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def validate_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise EvendpError(
            f"{name} must be callable (a function, a lambda, functools.partial or an "
            f"nn.Module), got {describe(value)}"
        )
    return value


def validate_counts(raw: list[Any] | None, sizes: list[int], where: list[str]) -> list[float]:
    """Each share's count as a float: ``raw[k]``, what ``count_fn`` returned for share ``k``
    (on the device ``where[k]`` names), or without a count function its samples."""
    if raw is None:
        return [float(n) for n in sizes]
    counts = []
    for k, (value, samples) in enumerate(zip(raw, sizes, strict=True)):
        number: float | None = None
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
                number = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        if number is None or not math.isfinite(number) or number < 0:
            shown = describe(value) if isinstance(value, torch.Tensor) and value.dim() else value
            raise EvendpError(
                f"count_fn returned {shown!r} for the share of {samples} sample(s) on "
                f"{where[k]}; it must return how many items that share's mean is over, a "
                "non-negative int or 0-dim tensor, e.g. (labels != -100).sum()"
            )
        counts.append(number)
    return counts


def validate_reduction(reduction: Any, has_count_fn: bool) -> None:
    """``ParallelCriterion``'s ``reduction``: ``"mean"``, or ``"sum"`` without a count."""
    if reduction not in ("mean", "sum"):
        raise EvendpError(
            f"reduction={reduction!r} is not supported; use 'mean' when the criterion "
            "returns a per-device mean, 'sum' when it returns a per-device sum"
        )
    if has_count_fn and reduction == "sum":
        raise EvendpError(
            "count_fn weights per-device means, but reduction='sum' adds per-device sums; "
            "use reduction='mean' with count_fn, or divide the summed loss by your global "
            "count yourself"
        )


def validate_losses(losses: list[Any]) -> None:
    """Every device's criterion returned a scalar tensor."""
    for loss in losses:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise EvendpError(
                f"the criterion returned {describe(loss)} on a device; ParallelCriterion "
                "needs a scalar per device: use reduction='mean' or 'sum' in the criterion"
            )


@dataclass(frozen=True)
class Scattered:
    """Per-device outputs of ``BalancedDataParallel(..., gather_output=False)`` and their split.

    ``outputs[i]`` lives on ``devices[i]`` and covers ``sizes[i]`` consecutive samples of the
    batch; ``counts[i]`` is the number of items a scalar in it is a mean over (``None``: the
    samples). Hand it to :class:`ParallelCriterion`, or to :func:`gather` for the full output.
    """

    outputs: list[Any]
    sizes: list[int]
    devices: list[torch.device]
    dim: int
    output_device: torch.device
    counts: list[float] | None = None

    @property
    def batch_size(self) -> int:
        """The number of samples across all devices (N)."""
        return sum(self.sizes)


def gather(scattered: Scattered) -> Any:
    """The full output on ``scattered.output_device``: per-device outputs joined along ``dim``.

    >>> from evendp import BalancedDataParallel
    >>> model = BalancedDataParallel(nn.Linear(3, 2), ["cpu", "cpu"], gather_output=False)
    >>> parts = model(torch.randn(5, 3))
    >>> parts.sizes, gather(parts).shape
    ([3, 2], torch.Size([5, 2]))
    """
    _validate_scattered(scattered)
    s = scattered
    return gather_outputs(s.outputs, s.sizes, s.output_device, s.dim, s.counts)


def _validate_scattered(value: Any) -> None:
    if not isinstance(value, Scattered):
        raise EvendpError(
            "expected the Scattered returned by BalancedDataParallel(..., gather_output=False), "
            f"got {describe(value)}; for an already gathered output call the criterion directly"
        )


class ParallelCriterion(nn.Module):
    """Compute a loss on every device from a :class:`Scattered` and combine it exactly.

    Targets are scattered with the same sizes as the outputs. ``criterion`` is any callable
    ``criterion(output, *targets, **kwargs)``: a function, a lambda, ``functools.partial`` or
    an ``nn.Module`` (copied to each device only when it has parameters or buffers).

    With ``reduction="mean"`` (the criterion returns a per-device mean) the result is
    ``sum_i c_i * loss_i / sum_i c_i``, where ``c_i = count_fn(output_i, *targets_i,
    **kwargs_i)`` is the number of items device ``i``'s mean is over. Default count: the
    samples, except for ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with ``reduction="mean"``,
    whose own denominator is used (targets not equal to ``ignore_index``, weighted by
    ``weight``); any other criterion whose targets hold ``-100`` (ignored labels) is
    weighted by samples with a warning, once, naming ``count_fn``
    (:func:`evendp.count_tokens`). A device whose count is 0 contributes nothing (never its
    NaN). With ``reduction="sum"`` (the criterion returns a per-device sum) the result is the
    plain sum.

    Language-model logits (N, L, V) with -100 on padding, split [2, 1] over two devices:

    >>> from evendp import BalancedDataParallel
    >>> torch.manual_seed(0) and None
    >>> lm_head = nn.Linear(8, 11)                      # hidden (N, L, 8) -> logits (N, L, 11)
    >>> model = BalancedDataParallel(lm_head, ["cpu", "cpu"], weights=[2, 1],
    ...                              gather_output=False)
    >>> hidden, labels = torch.randn(3, 5, 8), torch.randint(0, 11, (3, 5))
    >>> labels[0, 2:] = -100                            # padding: row 0 has 2 real tokens
    >>> def token_loss(logits, labels):                 # the mean over real tokens
    ...     return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    >>> criterion = ParallelCriterion(token_loss, count_fn=lambda out, y: (y != -100).sum())
    >>> loss = criterion(model(hidden), labels)
    >>> torch.allclose(loss, token_loss(lm_head(hidden), labels))
    True
    """

    def __init__(
        self,
        criterion: Callable[..., torch.Tensor],
        reduction: Literal["mean", "sum"] = "mean",
        count_fn: Callable[..., Count] | None = None,
    ) -> None:
        super().__init__()
        validate_reduction(reduction, has_count_fn=count_fn is not None)
        self.criterion = validate_callable("criterion", criterion)
        self.reduction = reduction
        self.count_fn = validate_callable("count_fn", count_fn)
        self._count_checked = False  # targets with ignored labels and no count: warned once

    def forward(self, scattered: Scattered, *targets: Any, **kwargs: Any) -> torch.Tensor:
        _validate_scattered(scattered)
        target_total = row_count((targets, kwargs), scattered.dim)
        if target_total is not None and target_total != scattered.batch_size:
            raise EvendpError(
                f"targets have {target_total} samples along dim={scattered.dim} but the outputs "
                f"have {scattered.batch_size} (split {scattered.sizes}); pass the targets of the "
                "same batch"
            )
        # Each device's ((output, *targets), kwargs): the targets scattered as the outputs.
        parts = scatter((targets, kwargs), scattered.sizes, scattered.devices, scattered.dim)
        shards = [((out, *t), kw) for out, (t, kw) in zip(scattered.outputs, parts, strict=True)]
        count_fn = self.count_fn or _builtin_count_fn(self.criterion)
        uncounted = count_fn is None and self.reduction == "mean" and len(scattered.sizes) > 1
        if uncounted and not self._count_checked:  # once (a host read): ignored labels
            self._count_checked = True
            if holds_ignored((targets, kwargs)):
                uncounted_warning("ParallelCriterion", self.criterion, stacklevel=4)
        with torch.no_grad():  # counted before the losses run (None: weigh by samples)
            raw_counts = None if count_fn is None else [count_fn(*a, **kw) for a, kw in shards]
        losses = parallel_apply(self._criteria(scattered.devices), shards, scattered.devices)
        validate_losses(losses)
        if self.reduction == "sum":
            return torch.stack([loss.to(scattered.output_device) for loss in losses]).sum()
        where = [f"device {d} (output {k})" for k, d in enumerate(scattered.devices)]
        counts = validate_counts(raw_counts, scattered.sizes, where)
        return combine_means(losses, counts, scattered.output_device)

    def _criteria(self, devices: list[torch.device]) -> list[nn.Module]:
        criterion = self.criterion
        if isinstance(criterion, nn.Module) and any(
            True for _ in itertools.chain(criterion.parameters(), criterion.buffers())
        ):
            return replicate(criterion, devices, not torch.is_grad_enabled())
        # A function, or a module with nothing to copy: the same callable on every device.
        return cast(list[nn.Module], [criterion] * len(devices))


def _builtin_count_fn(criterion: Callable[..., Any]) -> Callable[..., Count] | None:
    """The denominator of a built-in criterion's mean, where it is not the samples."""
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and criterion.reduction == "mean":
        return functools.partial(_class_loss_count, criterion)
    return None


def _class_loss_count(
    criterion: nn.CrossEntropyLoss | nn.NLLLoss, output: Any, *targets: Any, **kwargs: Any
) -> Count:
    """What ``CrossEntropyLoss``/``NLLLoss`` divide by: the weight of non-ignored targets."""
    target = targets[0] if targets else kwargs.get("target")
    if not isinstance(target, torch.Tensor):
        return 1  # nothing to read: one share, one mean (the criterion will complain itself)
    if target.is_floating_point():  # class probabilities: the mean is over positions
        return target.numel() // target.shape[1] if target.dim() > 1 else 1
    valid = target != criterion.ignore_index
    weight = criterion.weight
    if weight is None:
        return valid.sum()
    return (weight.to(target.device)[target.masked_fill(~valid, 0)] * valid).sum()
