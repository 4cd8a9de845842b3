"""Splitting nested inputs by per-device sizes along ``dim``, and gathering outputs back.

A *batch tensor* is any tensor with more than ``dim`` dimensions; all of them must agree on
their size along ``dim``. A *per-row list* is a list with no tensor inside and exactly one
entry per row of the batch (strings, ids: what ``default_collate`` makes of a string field):
it is cut with its rows. Everything else (0-dim tensors, numbers, strings, ``None``, a list
of another length, any tuple) is passed whole to every device: to send every device the same
list whatever its length, make it a tuple. Containers are rebuilt with their own type:
tuples, lists, dicts, namedtuples and dataclasses.

Every move is a differentiable ``narrow`` + ``to``, so gradients flow back to the original
tensors whatever the devices are.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._core._errors import EvendpError
from .._core._exact import combine_means

__all__ = [
    "row_count",
    "row_count_and_devices",
    "gather_outputs",
    "map_tensors",
    "per_row",
    "scatter",
    "to_device",
]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; asynchronous only towards a GPU.

    A host that read a tensor copied from a GPU asynchronously could see it before the copy
    lands, so copies to the CPU stay synchronous.
    """
    return t.to(device, non_blocking=device.type == "cuda")


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], Any],
    *,
    rows: int | None = None,
    row_fn: Callable[[list[Any]], Any] | None = None,
) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor inside it (containers keep their type).

    With ``rows`` and ``row_fn``, a per-row list (:func:`per_row`) becomes ``row_fn(list)``.

    >>> map_tensors({"x": torch.ones(2), "k": 3}, lambda t: t * 2)
    {'x': tensor([2., 2.]), 'k': 3}
    >>> map_tensors([torch.ones(2), ["a", "b"]], lambda t: t[:1], rows=2, row_fn=lambda v: v[:1])
    [tensor([1.]), ['a']]
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if row_fn is not None and per_row(obj, rows):
        return row_fn(obj)

    def again(value: Any) -> Any:
        return map_tensors(value, fn, rows=rows, row_fn=row_fn)

    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(again(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(again(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, again(v)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(obj, **{n: again(getattr(obj, n)) for n in fields})
    return obj


def per_row(obj: Any, rows: int | None) -> bool:
    """Whether ``obj`` is a per-row list: a ``list`` of ``rows`` entries with no tensor inside.

    >>> per_row(["a", "b", "c"], 3), per_row(["a", "b"], 3), per_row(("a", "b"), 2)
    (True, False, False)
    """
    return isinstance(obj, list) and len(obj) == rows and not _holds_tensor(obj)


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, in order (through what :func:`map_tensors` rebuilds)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                yield from _tensors_in(getattr(obj, f.name))


def row_count(obj: Any, dim: int = 0) -> int | None:
    """The common size along ``dim`` of every batch tensor in ``obj`` (None when there is none).

    >>> row_count(((torch.zeros(5, 2),), {"mask": torch.ones(5)}))
    5
    """
    return row_count_and_devices(obj, dim)[0]


def row_count_and_devices(obj: Any, dim: int = 0) -> tuple[int | None, set[torch.device]]:
    """:func:`row_count`, and the devices of every tensor in ``obj``, in one walk.

    >>> row_count_and_devices([torch.zeros(3), torch.tensor(1.0)])
    (3, {device(type='cpu')})
    """
    found: list[tuple[int, tuple[int, ...]]] = []
    devices: set[torch.device] = set()
    for t in _tensors_in(obj):
        devices.add(t.device)
        if t.dim() > dim:  # a batch tensor
            found.append((t.shape[dim], tuple(t.shape)))
    if not found:
        return None, devices
    first_size, first_shape = found[0]
    for size, shape in found[1:]:
        if size != first_size:
            raise EvendpError(
                f"batch tensors disagree along dim={dim}: one has shape {list(first_shape)} "
                f"(size {first_size}), another {list(shape)} (size {size}); every tensor "
                f"with a batch dimension must have the same size along dim={dim} — pass "
                "per-sample tensors only, or wrap shared tensors as non-batch values "
                "(e.g. a 0-dim tensor or a plain Python object)"
            )
    return first_size, devices


def scatter(
    obj: Any, sizes: Sequence[int], devices: Sequence[torch.device], dim: int = 0
) -> list[Any]:
    """One copy of ``obj`` per device, batch tensors cut into consecutive chunks of ``sizes``.

    >>> parts = scatter(torch.arange(5), [3, 2], [torch.device("cpu")] * 2)
    >>> [p.tolist() for p in parts]
    [[0, 1, 2], [3, 4]]
    >>> batch = {"x": torch.zeros(3, 2), "text": ["a", "b", "c"], "tag": ["every", "device"]}
    >>> [(p["text"], p["tag"]) for p in scatter(batch, [2, 1], [torch.device("cpu")] * 2)]
    [(['a', 'b'], ['every', 'device']), (['c'], ['every', 'device'])]
    """
    shards = []
    start = 0
    total = sum(sizes)
    for size, device in zip(sizes, devices, strict=True):
        cut = _chunk_mover(start, size, device, dim)
        rows = operator.itemgetter(slice(start, start + size))  # a per-row list's share
        shards.append(map_tensors(obj, cut, rows=total, row_fn=rows))
        start += size
    return shards


def _chunk_mover(
    start: int, size: int, device: torch.device, dim: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    def move(t: torch.Tensor) -> torch.Tensor:
        # A share that is the whole batch needs no narrow (and no NarrowBackward node).
        if t.dim() > dim and size != t.shape[dim]:  # a batch tensor
            t = t.narrow(dim, start, size)
        return to_device(t, device)

    return move


def gather_outputs(
    outputs: Sequence[Any],
    sizes: Sequence[int],
    device: torch.device,
    dim: int = 0,
    counts: Sequence[float] | None = None,
) -> Any:
    """Combine per-device outputs on ``device``.

    Tensors with dimensions are concatenated along ``dim``. A floating 0-dim tensor (a loss
    computed per device as a mean over its counted items) becomes ``sum_i c_i * out_i / C``
    with ``C = sum_i c_i``, which equals the mean over every item of the batch; ``c_i`` is
    ``counts[i]``, by default the samples ``sizes[i]``. A device with ``c_i = 0`` contributes
    nothing (its mean over no items is NaN, and 0 * NaN is NaN); when every count is zero the
    result is a zero. An integer 0-dim tensor (a count) is summed. Per-row lists (one entry
    per row of each device's share, no tensor inside) are joined in row order. Other values
    are returned once when every device agrees, else as a list.

    >>> gather_outputs([torch.tensor(0.25), torch.tensor(0.8)], [2, 1], torch.device("cpu"))
    tensor(0.4333)
    >>> nan = torch.tensor(float("nan"))  # a mean over a share with no counted items
    >>> gather_outputs([torch.tensor(0.5), nan], [2, 1], torch.device("cpu"), counts=[4, 0])
    tensor(0.5000)
    """
    weights = [float(c) for c in (sizes if counts is None else counts)]
    if len(outputs) == 1 and weights[0] > 0:
        # One device did the whole batch: its output is the answer.
        return map_tensors(outputs[0], lambda t: t.to(device))
    return _gather(list(outputs), weights, device, dim, list(sizes))


def _gather(
    outputs: list[Any], counts: list[float], device: torch.device, dim: int, sizes: list[int]
) -> Any:
    first = outputs[0]
    if all(per_row(o, n) for o, n in zip(outputs, sizes, strict=True)):
        return [value for o in outputs for value in o]  # one entry per row: rows in order
    if isinstance(first, torch.Tensor):
        return _gather_tensors(outputs, counts, device, dim)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*_gather_each(outputs, counts, device, dim, sizes))
    if isinstance(first, (list, tuple)):
        return type(first)(_gather_each(outputs, counts, device, dim, sizes))
    if isinstance(first, dict):
        return type(first)(
            (k, _gather([o[k] for o in outputs], counts, device, dim, sizes)) for k in first
        )
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        names = [f.name for f in dataclasses.fields(first) if f.init]
        values = {
            n: _gather([getattr(o, n) for o in outputs], counts, device, dim, sizes) for n in names
        }
        return dataclasses.replace(first, **values)
    if all(o == first for o in outputs[1:]):
        return first
    return outputs


def _gather_each(
    outputs: list[Any], counts: list[float], device: torch.device, dim: int, sizes: list[int]
) -> list[Any]:
    return [
        _gather(list(items), counts, device, dim, sizes) for items in zip(*outputs, strict=True)
    ]


def _gather_tensors(
    tensors: list[torch.Tensor], counts: list[float], device: torch.device, dim: int
) -> torch.Tensor:
    if tensors[0].dim() > 0:
        return torch.cat([t.to(device) for t in tensors], dim=dim)
    if not tensors[0].is_floating_point():
        return torch.stack([t.to(device) for t in tensors]).sum()
    return combine_means(tensors, counts, device)
