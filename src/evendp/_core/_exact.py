"""The arithmetic of evendp's promise, in one place: the exact full-batch mean on any split.

A loss that is a mean over counted items (samples, non-ignored tokens) is split into shares:
devices, ranks, micro-batches, OOM re-splits. The full batch's mean is recovered by weighting
each share's mean by its count over the step's global count, never by 1 / (number of shares).
A share with no counted item contributes exactly 0 and never a NaN (its mean is 0 / 0).
Every path of the package calls these functions instead of writing the rule again:

- :func:`share_loss`: the weighting every surface calls, a share's mean times its count
  times one over the global count, an exact connected 0 for a stand-in or no items;
- :func:`weighted_sum`: a share's mean times its count, an exact connected 0 for no items;
- :func:`zero_weight`: a loss that joins backward and its collectives with weight 0;
- :func:`combine_means`: per-share means -> the mean over all their items;
- :func:`sum_on`: per-share sums -> the sum over all their items;
- :func:`step_count`: the step's global count (the samples need no communication);
- :func:`mean_scale`: ``numerator / global count``, 0 for no items anywhere;
- :func:`averaged_scale`: the same for a framework that averages gradients over ranks and
  divides the loss by its accumulation steps itself (DeepSpeed's ``engine.backward``);
- :func:`stand_in_batch` / :func:`is_stand_in`: the one-real-sample batch that runs an empty
  share (see "The stand-in batch" below).

Why a zero weight stays connected to the graph: under DDP and FSDP2 every rank must run
backward so its collectives pair with the other ranks', and a rank with nothing to add must
add an exact 0. ``torch.where`` picks the 0 in forward and sends a zero gradient to the mean,
so a NaN mean (0 / 0) never reaches a parameter. (A mean whose own backward divides a zero
gradient by a zero count would still make NaN; :func:`combine_means`, which need not stay
connected, leaves such shares out of the graph entirely.)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._errors import EvendpError
from ._validate import shown, validate_bool

__all__ = [
    "Count",
    "StandInTensor",
    "averaged_scale",
    "combine_means",
    "is_stand_in",
    "mean_scale",
    "share_loss",
    "stand_in_batch",
    "step_count",
    "sum_on",
    "weighted_sum",
    "zero_weight",
]

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


def share_loss(
    mean: torch.Tensor, count: Count, scale: Count = 1, *, stand_in: bool = False
) -> torch.Tensor:
    """A share's part of the whole batch's mean: ``mean * count * scale``, the one weighting
    every surface of evendp calls (the Trainer, the OOM re-split, ``StepMean``, ``EngineMean``,
    evaluation and each integration).

    ``mean`` is the share's mean over its ``count`` counted items (samples, non-ignored
    tokens); ``scale`` is one over the step's global count, times the ranks where the
    framework averages gradients over them (1 where a later step divides, as
    :meth:`evendp.StepMean.finish` does). A stand-in share (``stand_in=True``, see
    :func:`evendp.is_stand_in`) or one with no items gives an exact 0 connected to the graph,
    never NaN. A tensor ``count`` or ``scale`` is never read on the host.

    >>> share_loss(torch.tensor(0.5), 4, 1 / 8)  # 4 of the step's 8 items, at mean 0.5
    tensor(0.2500)
    >>> share_loss(torch.tensor(float("nan")), 0), share_loss(torch.tensor(3.0), 1, stand_in=True)
    (tensor(0.), tensor(0.))
    """
    # The common case is checked inline (a Trainer's micro-steps call no check); any other
    # value goes through the full check, which names what is wrong.
    common = isinstance(count, torch.Tensor) or (type(count) is int and count >= 0)
    if (
        not (common and type(stand_in) is bool and type(scale) is int and scale == 1)
        or not isinstance(mean, torch.Tensor)
        or mean.numel() != 1
    ):
        _validate_share(mean, count, scale, stand_in)
    if stand_in:
        return zero_weight(mean)
    part = weighted_sum(mean, count)
    if isinstance(scale, numbers.Number) and scale == 1:
        return part
    return part * scale


def _validate_share(mean: Any, count: Any, scale: Any, stand_in: Any) -> None:
    """``share_loss``'s arguments: a one-value tensor, counts and scale >= 0 (a tensor is
    taken as is: reading it would wait for the device)."""
    if not isinstance(mean, torch.Tensor) or mean.numel() != 1:
        raise EvendpError(
            f"share_loss: mean must be a one-value tensor (the share's mean loss), got "
            f"{shown(mean)}"
        )
    for name, value in (("count", count), ("scale", scale)):
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            ok = False
        else:
            ok = math.isfinite(float(value)) and float(value) >= 0
        if not ok:
            raise EvendpError(
                f"share_loss: {name} must be a finite number >= 0 or a tensor, got "
                f"{shown(value)}; e.g. share_loss(loss, 4, 1 / 8)"
            )
    validate_bool("stand_in", stand_in)


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


def sum_on(sums: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Per-share sums (each from :func:`weighted_sum`) added up on ``device``.

    Sums need no weights: the sum over all items is the sum of the shares' sums, and a share
    with no item adds its exact 0.

    >>> sum_on([torch.tensor(2.0), torch.tensor(0.0), torch.tensor(3.5)], "cpu")
    tensor(5.5000)
    """
    total = sums[0].to(device)
    for part in sums[1:]:
        total = total + part.to(device)
    return total


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
    (e.g. ``count_fn(batch)``), made a fresh tensor on ``device`` (int64 for whole numbers,
    else float64: counted exactly) and summed over processes by ``all_reduce`` (one
    collective; ``None``: one process, nothing to sum). The result is never read on the host.

    >>> step_count(None, samples=12)
    12
    >>> step_count(7)
    tensor(7)
    >>> step_count(torch.tensor(3), all_reduce=lambda t: t * 2)  # as if two ranks had 3
    tensor(6)
    """
    if local is None:
        if samples is None:
            raise TypeError("step_count(None) needs samples=, the step's samples")
        return samples
    if isinstance(local, torch.Tensor):
        t = local.detach().to(device=device or local.device)
        exact = torch.float64 if t.is_floating_point() or t.is_complex() else torch.int64
        total = t.to(dtype=exact, copy=True)  # a fresh tensor: all-reduce works in place
    else:
        exact = torch.int64 if isinstance(local, numbers.Integral) else torch.float64
        total = torch.tensor(local, dtype=exact, device=device)
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


def averaged_scale(
    count: Count, *, ranks: int, divided_by: int = 1, dtype: torch.dtype = torch.float32
) -> float | torch.Tensor:
    """The weight of a rank's summed loss when the framework averages and divides by itself.

    DDP, FSDP and DeepSpeed ZeRO (1, 2 and 3: ZeRO-3 pre-divides in its reduce-scatter, the
    same mean) average the ranks' gradients, a division by ``ranks``; DeepSpeed's
    ``engine.backward(loss)`` also divides the loss by its accumulation steps
    (``divided_by``; 1 with ``scale_wrt_gas=False``). A rank's summed loss times this weight
    is the loss whose gradient, after both divisions, is the one of the mean over the step's
    ``count`` items on all ranks and micro-batches: ``ranks * divided_by / count``, 0 for no
    items (see :func:`mean_scale`).

    >>> averaged_scale(8, ranks=2, divided_by=2)  # 2 ranks, 2 micro-batches, 8 items
    0.5
    >>> averaged_scale(torch.tensor(0), ranks=2)
    tensor(2.)
    """
    return mean_scale(count, numerator=ranks * divided_by, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The stand-in batch: one real sample that runs an empty share's forward with weight exactly 0
#
# A rank (or device) whose share of a step is empty must still run forward and backward, so that
# the collectives of DDP/FSDP2 match on every rank. A batch of 0 rows would do for a linear
# layer, but many real models cannot forward one (GPT-2: "cannot reshape tensor of 0
# elements"; BERT's attention mask), so the collate gives one *real* sample instead, marked as a
# stand-in. The loss side recognises the mark and gives that sample weight exactly 0 (its count
# is 0, its loss a connected zero), so the gradient and the logged loss are those of the real
# samples alone.
#
# The mark must survive what the frameworks do to a batch between the collate and the loss:
# Hugging Face ``Trainer._prepare_inputs``, Accelerate's ``send_to_device``, Lightning's
# ``move_data_to_device``, DDP's input moves, ``pin_memory`` and worker processes (pickling)
# all rebuild containers and call ``Tensor.to``. So the mark sits on every tensor of the batch:
# each is a :class:`StandInTensor`, a ``torch.Tensor`` subclass that stays one through moves and
# copies (``to``, ``cuda``, ``cpu``, ``pin_memory``, ``clone``, ``detach``, ``contiguous``,
# pickling) and through nothing else: any computation on it returns a plain tensor, so the model
# itself never sees the subclass past its first operation.
#
# Users of the mark: EmptySafeCollate(stand_in=True) makes the batch; StepMean, UnevenTrainer,
# UnevenAccelerator and Lightning's UnevenGradient count it 0 and weigh its loss with
# zero_weight.


class StandInTensor(torch.Tensor):
    """A tensor of a stand-in batch; moves and copies keep the mark, computations drop it.

    >>> t = torch.ones(1, 3).as_subclass(StandInTensor)
    >>> type(t.to(torch.float64)).__name__, type(t * 2).__name__, type(t[:, 1:]).__name__
    ('StandInTensor', 'Tensor', 'Tensor')
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _MOVES and isinstance(out, torch.Tensor):
            return out.as_subclass(cls)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> StandInTensor:
        copied = memo.get(id(self))
        if copied is None:
            copied = memo[id(self)] = self.clone()
        return copied  # type: ignore[return-value]


# The operations that move or copy a batch without computing on it: the mark goes along.
_MOVES = {
    torch.Tensor.to,
    torch.Tensor.cuda,
    torch.Tensor.cpu,
    torch.Tensor.pin_memory,
    torch.Tensor.clone,
    torch.Tensor.detach,
    torch.Tensor.contiguous,
    torch.Tensor.share_memory_,
}


def stand_in_batch(batch: Any) -> Any:
    """``batch`` (a collated batch of one real sample) with every tensor marked as a stand-in.

    Containers keep their type (dicts, ``BatchEncoding``-like mappings, lists, tuples,
    namedtuples); non-tensor leaves stay as they are.

    >>> x, y = stand_in_batch((torch.ones(1, 3), torch.tensor([2])))
    >>> is_stand_in(x), is_stand_in(y), x.shape
    (True, True, torch.Size([1, 3]))
    """
    if isinstance(batch, torch.Tensor):
        return batch.as_subclass(StandInTensor)
    if isinstance(batch, Mapping):
        items = {k: stand_in_batch(v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(stand_in_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(stand_in_batch(v) for v in batch)
    return batch


def is_stand_in(batch: Any) -> bool:
    """Whether ``batch`` (a tensor or a nested batch) is a stand-in: its first tensor is marked.

    >>> is_stand_in({"input_ids": torch.ones(2, 4)}), is_stand_in([None, 3])
    (False, False)
    """
    tensor = _first_tensor(batch)
    return isinstance(tensor, StandInTensor)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for value in values:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None
