"""The arithmetic of evendp's promise, in one place: the exact full-batch mean on any split.

A loss that is a mean over counted items (samples, non-ignored tokens) is split into shares:
devices, ranks, micro-batches, OOM re-splits. The full batch's mean is recovered by weighting
each share's mean by its count over the step's global count, never by 1 / (number of shares).
A share with no counted item contributes exactly 0 and never a NaN (its mean is 0 / 0).
Every path of the package calls these functions instead of writing the rule again:

- :func:`weighted_sum`: a share's mean times its count, an exact connected 0 for no items;
- :func:`zero_weight`: a loss that joins backward and its collectives with weight 0;
- :func:`combine_means`: per-share means -> the mean over all their items;
- :func:`step_count`: the step's global count (the samples need no communication);
- :func:`mean_scale`: ``numerator / global count``, 0 for no items anywhere.

Why a zero weight stays connected to the graph: under DDP and FSDP2 every rank must run
backward so its collectives pair with the other ranks', and a rank with nothing to add must
add an exact 0. ``torch.where`` picks the 0 in forward and sends a zero gradient to the mean,
so a NaN mean (0 / 0) never reaches a parameter. (A mean whose own backward divides a zero
gradient by a zero count would still make NaN; :func:`combine_means`, which need not stay
connected, leaves such shares out of the graph entirely.)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch

__all__ = ["Count", "combine_means", "mean_scale", "step_count", "weighted_sum", "zero_weight"]

#: A number of counted items: an int, a float or a 0-dim tensor.
Count = int | float | torch.Tensor


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def zero_weight(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` with weight exactly 0: a zero (at least fp32) whose gradient to ``loss`` is 0.

    For a share that must run backward (its collectives pair with other ranks') but adds
    nothing, e.g. a stand-in sample run in place of an empty share. Never NaN, even when
    ``loss`` is.

    >>> w = torch.tensor(2.0, requires_grad=True)
    >>> out = zero_weight(w * 3.0)
    >>> out.backward()
    >>> out, w.grad
    (tensor(0., grad_fn=<WhereBackward0>), tensor(0.))
    >>> zero_weight(torch.tensor(float("nan")))
    tensor(0.)
    """
    no = torch.zeros((), dtype=torch.bool, device=loss.device)
    return torch.where(no, loss.to(_at_least_fp32(loss)), 0.0)


def weighted_sum(mean: torch.Tensor, count: Count) -> torch.Tensor:
    """``mean * count``: a share's loss summed over its counted items, in at least fp32.

    With ``count == 0`` the result is exactly 0, connected to the graph with a zero gradient,
    even when ``mean`` is NaN (a mean over no items). A tensor ``count`` is never read on the
    host (no device sync).

    >>> weighted_sum(torch.tensor(0.5), 4)
    tensor(2.)
    >>> weighted_sum(torch.tensor(float("nan")), torch.tensor(0))
    tensor(0.)
    """
    dtype = _at_least_fp32(mean)
    if isinstance(count, torch.Tensor):
        count = count.to(mean.device)
        value = mean.to(dtype) * count.to(dtype)
        return torch.where(count > 0, value, torch.zeros((), dtype=dtype, device=mean.device))
    if count > 0:
        return mean.to(dtype) * count
    return zero_weight(mean)


def combine_means(
    means: Sequence[torch.Tensor], counts: Sequence[float], device: torch.device
) -> torch.Tensor:
    """``sum_i c_i * mean_i / sum_i c_i`` on ``device``, leaving out every ``c_i = 0``.

    Per-device means -> the mean over all items: weight c_i / C, never 1 / k. A mean with
    no items is left out of the graph entirely rather than multiplied by 0: its value is
    NaN, and so may be its backward (a masked mean divides by its zero count), and 0 * NaN is
    NaN. With no items anywhere the result is a zero, a leaf so that ``backward()`` still
    runs and leaves every gradient untouched.

    >>> combine_means([torch.tensor(1.0), torch.tensor(4.0)], [3, 1], torch.device("cpu"))
    tensor(1.7500)
    >>> combine_means([torch.tensor(2.0), torch.tensor(float("nan"))], [5, 0], "cpu")
    tensor(2.)
    """
    total = float(sum(counts))
    kept = [(m, c) for m, c in zip(means, counts, strict=True) if c > 0]
    if not kept:
        first = means[0]
        return torch.zeros((), dtype=first.dtype, device=device, requires_grad=first.requires_grad)
    combined = kept[0][0].to(device) * (kept[0][1] / total)
    for mean, count in kept[1:]:
        combined = combined + mean.to(device) * (count / total)
    return combined


def step_count(
    local: Count | None,
    *,
    samples: int | None = None,
    device: torch.device | str | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int | float | torch.Tensor:
    """The step's global count: the number the full batch's mean is over.

    ``local is None`` means the loss is a mean over samples: the step's ``samples`` over all
    processes is already known to every process (the sampler plans every rank's share), so it
    is returned as it is, with no communication. Otherwise ``local`` is this process's count
    (e.g. ``count_fn(batch)``), made a float64 tensor on ``device`` and summed over processes
    by ``all_reduce`` (one collective; ``None``: one process, nothing to sum). The result is
    never read on the host.

    >>> step_count(None, samples=12)
    12
    >>> step_count(7)
    tensor(7., dtype=torch.float64)
    >>> step_count(torch.tensor(3), all_reduce=lambda t: t * 2)  # as if two ranks had 3
    tensor(6., dtype=torch.float64)
    """
    if local is None:
        if samples is None:
            raise TypeError("step_count(None) needs samples=, the step's samples")
        return samples
    if isinstance(local, torch.Tensor):
        total = local.detach().to(device=device or local.device, dtype=torch.float64)
        total = total.reshape(()).clone()  # a fresh tensor: all-reduce works in place
    else:
        total = torch.tensor(float(local), dtype=torch.float64, device=device)
    return total if all_reduce is None else all_reduce(total)


def mean_scale(
    count: Count, numerator: float = 1.0, dtype: torch.dtype = torch.float32
) -> float | torch.Tensor:
    """``numerator / count``, the weight that turns a summed loss into the mean; 0 for no items.

    With no counted item anywhere every share's sum is 0 too, so the scale is 0 (a number)
    or the division is by 1 (a tensor, with no host sync) instead of by 0. A tensor count is
    divided in float64 and returned in ``dtype`` (the loss's), so a float64 count never
    promotes an fp32 loss. ``numerator`` is the world size under DDP's averaging over ranks.

    >>> mean_scale(4), mean_scale(0), mean_scale(8, numerator=2)
    (0.25, 0.0, 0.25)
    >>> mean_scale(torch.tensor(0.0))
    tensor(1.)
    """
    if isinstance(count, torch.Tensor):
        total = count.to(torch.float64)
        return (numerator / (total + (total == 0))).to(dtype)
    if isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise TypeError(f"count must be a number or a tensor, got {count!r}")
    return numerator / count if count > 0 else 0.0
