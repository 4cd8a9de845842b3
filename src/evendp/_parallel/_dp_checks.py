"""The checks of :class:`BalancedDataParallel`'s and :class:`ParallelCriterion`'s input.

Each check raises one :class:`~evendp.EvendpError` that names the value, what was expected
and the fix. (A check of one value against the batch in hand, such as ``fixed_sizes`` against
its rows, sits where the batch is.)
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._core._errors import EvendpError
from .._core._validate import is_int

__all__ = [
    "Count",
    "DeviceLike",
    "describe",
    "to_device",
    "validate_auto",
    "validate_batch_rows",
    "validate_callable",
    "validate_counts",
    "validate_devices",
    "validate_example",
    "validate_fixed_sizes",
    "validate_losses",
    "validate_module",
    "validate_placement",
    "validate_reduction",
]

DeviceLike = int | str | torch.device
#: What a count function may return: a number of items, as an int or a 0-dim tensor.
Count = int | float | torch.Tensor


def to_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device`` (an int is a CUDA index); a CUDA one must exist here."""
    if isinstance(device, bool):
        raise EvendpError(
            f"device {device!r} is not a device; pass an int, a string or torch.device"
        )
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EvendpError(
            f"device {device!r} is not a device; pass an int (a CUDA index), a string such as "
            "'cuda:1' or 'cpu', or a torch.device"
        ) from exc
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise EvendpError(
            f"device {resolved} was requested but CUDA is not available here; run on virtual "
            "devices instead, e.g. device_ids=['cpu', 'cpu', 'cpu']"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise EvendpError(
            f"device cuda:{index} does not exist: this process sees {count} CUDA device(s), "
            "numbered 0.. in CUDA_VISIBLE_DEVICES order "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use logical "
            "indices, "
            "e.g. CUDA_VISIBLE_DEVICES=2,3 makes physical GPUs 2 and 3 cuda:0 and cuda:1"
        )
    return torch.device("cuda", index)


def validate_devices(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    if device_ids is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(device_ids, (str, torch.device, int)) or not isinstance(device_ids, Sequence):
        raise EvendpError(
            f"device_ids must be a list of devices, got {device_ids!r}; "
            f"wrap it in a list: device_ids=[{device_ids!r}]"
        )
    devices = [to_device(d) for d in device_ids]
    if not devices:
        raise EvendpError("device_ids is empty; pass at least one device, e.g. ['cpu']")
    return devices


def validate_auto(value: str) -> None:
    if value != "auto":
        raise EvendpError(
            f"weights={value!r} is not understood; pass None (even split), 'auto' "
            "(planned from free memory), or one non-negative weight per device"
        )


def validate_placement(*groups: Iterable[torch.Tensor | None], home: torch.device) -> None:
    for tensor in itertools.chain(*groups):
        if tensor is not None and not _same_device(tensor.device, home):
            raise EvendpError(
                f"the module's tensors must sit on device_ids[0]={home}, but one is on "
                f"{tensor.device}; call module.to({str(home)!r}) before wrapping it, or put "
                f"its device first in device_ids. Note: CUDA_VISIBLE_DEVICES renumbers GPUs "
                "(with CUDA_VISIBLE_DEVICES=2,3 physical GPU 2 is cuda:0); "
                "evendp.select_devices sets it for you before CUDA starts"
            )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or a.index == b.index


def validate_module(module: Any, device_ids: Any) -> None:
    if isinstance(module, nn.Module):
        return
    if isinstance(device_ids, nn.Module):
        raise EvendpError(
            f"BalancedDataParallel got {module!r} before the module: that is the old "
            "BalancedDataParallel(gpu0_bsz, model, dim=0) call. evendp takes the module first "
            "and one weight per device: BalancedDataParallel(model, device_ids, "
            f"weights=[gpu0_bsz, bsz, ...]), e.g. weights=[{module!r}, bsz, bsz] for three "
            "GPUs where GPU 0 takes fewer samples than the others"
        )
    raise EvendpError(
        f"BalancedDataParallel's first argument must be the nn.Module to wrap, got "
        f"{describe(module)}; call BalancedDataParallel(model, device_ids, weights=[...])"
    )


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


def validate_fixed_sizes(sizes: Any, num_devices: int) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise EvendpError(
            f"fixed_sizes takes one non-negative int per device, got {sizes!r}; pass e.g. [3, 1, 0]"
        )
    values = list(sizes)
    if len(values) != num_devices:
        raise EvendpError(
            f"fixed_sizes({values}) has {len(values)} sizes for {num_devices} devices; pass "
            f"exactly one per entry of device_ids ({num_devices} ints, 0 for an idle device)"
        )
    for i, n in enumerate(values):
        if not is_int(n) or n < 0:
            raise EvendpError(
                f"fixed_sizes({values}): size {n!r} at position {i} is not a non-negative "
                "int; use 0 to give a device no samples"
            )
    return values


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def validate_batch_rows(total: int | None, dim: int) -> int:
    """The batch's row count, or raise when no input tensor has a batch dimension."""
    if total is None:
        raise EvendpError(
            "BalancedDataParallel got no tensor with a batch dimension "
            f"(dim={dim}) among its inputs; pass the batch as a tensor, or call "
            "the module directly when there is nothing to split"
        )
    return total


def validate_example(example: Any, auto: bool) -> None:
    """``example=`` is one batch as ``forward`` takes it, and only ``weights="auto"`` uses it."""
    if example is None:
        return
    if not auto:
        raise EvendpError(
            "example= is the batch weights='auto' plans on, but the weights are not 'auto'; "
            "drop example=, or pass weights='auto' with it"
        )
    if not isinstance(example, (tuple, list, dict, torch.Tensor)):
        raise EvendpError(
            f"example= must be one batch as forward takes it, got {describe(example)}; pass "
            "a tuple of positional inputs, e.g. example=(x,), or a dict of keyword inputs, "
            "e.g. example={'input_ids': ids, 'labels': labels}"
        )


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
