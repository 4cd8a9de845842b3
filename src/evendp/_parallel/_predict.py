"""Inference over a dataset on uneven devices: outputs back in dataset order, whatever the split.

One process: the batches run through :class:`BalancedDataParallel` (each device takes its
weighted share; ``weights="auto"`` plans a forward-only step on the first batch). Under
``torchrun``: every rank runs its own uneven share of each step (``UnevenBatchSampler``
without shuffling) and returns its part, in order, with the dataset indices it covers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader, default_collate

from .._core._calls import call, model_mode
from .._core._errors import EvendpError
from .._core._validate import validate_bool, validate_callable, validate_int
from ._scatter import map_tensors

__all__ = ["Predictions", "predict"]

#: ``torch.inference_mode`` or ``torch.no_grad``: what predict's forwards run under.
NoGrad = Callable[[], AbstractContextManager[Any]]


class Predictions(NamedTuple):
    """What :func:`predict` returns: ``outputs`` (the model's outputs, concatenated along dim
    0, on the CPU) and ``indices`` (the dataset index of each output row, ascending).

    In one process ``indices`` is ``0..len(data)-1``; under ``torchrun`` each rank holds only
    the rows it computed. Gather them on every rank (or write each rank's part to a file)::

        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, tuple(pred))       # [(outputs, indices), ...]
        outputs = torch.cat([o for o, _ in parts])
        order = torch.cat([i for _, i in parts]).argsort()
        outputs = outputs[order]                          # dataset order
    """

    outputs: Any
    indices: torch.Tensor


def _concat(parts: list[Any]) -> Any:
    """Step outputs (same structure each step) -> one output, tensors joined along dim 0."""
    flat = [tree_flatten(p) for p in parts]
    leaves, spec = flat[0]
    joined = []
    for j, leaf in enumerate(leaves):
        column = [f[0][j] for f in flat]
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise EvendpError(
                    "predict joins the model's per-sample outputs along dim 0, but it returned "
                    "a scalar tensor; return per-sample outputs (e.g. features, logits), or "
                    "compute a dataset-wide metric with Trainer(eval_data=...)"
                )
            # Outside inference mode: the result is an ordinary tensor autograd accepts.
            joined.append(torch.cat(column))
        else:
            joined.append(leaf)  # a non-tensor (None, a config flag): the same every step
    return tree_unflatten(joined, spec)


def _validate_data(data: Any) -> int:
    try:
        n = len(data)
        if n > 0:
            data[0]  # a map-style dataset answers an index
    except Exception as exc:  # a generator, an iterable-style dataset, anything else
        raise EvendpError(
            f"data must be a map-style dataset (len() and data[i]) such as a TensorDataset "
            f"or a list of samples; got {type(data).__name__} ({type(exc).__name__}: {exc})"
        ) from None
    return n


def _rank_sizes(weights: Any, batch_size: int, world: int) -> list[int]:
    """This step's samples per rank: ``batch_size`` split by ``weights`` (default: the sizes
    ``evendp launch`` set in ``EVENDP_BATCH_SIZES``, scaled to ``batch_size``; else even)."""
    from .._core._split import split_sizes
    from .._distributed._batch_plan import batch_sizes_from_env

    if isinstance(weights, str):
        raise EvendpError(
            "weights='auto' plans one process's devices; under torchrun pass one weight per "
            "rank (e.g. the split of evendp.plan(..., mode='ddp', no_grad=True))"
        )
    if weights is None:
        weights = batch_sizes_from_env(world, default=[1] * world)
    if len(weights) != world:
        raise EvendpError(
            f"weights has {len(weights)} entries but there are {world} ranks; pass one per rank"
        )
    return split_sizes(batch_size, weights)


def _predict_ranks(
    model: nn.Module, data: Any, weights: Any, batch_size: int, collate: Callable[..., Any],
    no_grad: NoGrad,
) -> Predictions:  # fmt: skip
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from .._distributed._collate import EmptySafeCollate
    from .._distributed._sampler import UnevenBatchSampler

    world = dist.get_world_size()
    sizes = _rank_sizes(weights, batch_size, world)
    # Every rank gets the same number of steps (some shares empty), each index exactly once.
    steps = list(UnevenBatchSampler(data, sizes, rank=dist.get_rank(), shuffle=False))
    loader = DataLoader(data, batch_sampler=steps, collate_fn=EmptySafeCollate(data, collate))
    first = next(iter(model.parameters()), None)
    device = torch.device("cpu") if first is None else first.device
    # DDP and FSDP2 modules talk to the other ranks in forward: every rank calls them every
    # step, even with an empty share.
    talks = isinstance(model, (DistributedDataParallel, FSDPModule))
    outputs: list[Any] = []
    indices: list[int] = []
    for step_indices, batch in zip(steps, loader, strict=True):
        if not step_indices and not talks:
            continue  # an empty share and nobody waits for this rank: skip the forward
        with no_grad():
            out = call(model, map_tensors(batch, lambda t: t.to(device)))
            out = map_tensors(out, lambda t: t.detach().cpu())
        if step_indices:
            outputs.append(out)
            indices.extend(step_indices)
    if not outputs:
        return Predictions(None, torch.empty(0, dtype=torch.long))
    return Predictions(_concat(outputs), torch.tensor(indices, dtype=torch.long))


def _predict_devices(
    model: nn.Module, data: Any, device_ids: Any, weights: Any, batch_size: int,
    collate: Callable[..., Any], no_grad: NoGrad,
) -> Predictions:  # fmt: skip
    from ._dp import BalancedDataParallel

    if isinstance(model, BalancedDataParallel):
        if device_ids is not None or weights is not None:
            raise EvendpError(
                "model is already a BalancedDataParallel; set device_ids and weights on it, "
                "not in predict(...)"
            )
        wrapped = model
    else:
        wrapped = BalancedDataParallel(model, device_ids, weights=weights)
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collate)
    outputs = []
    for step, batch in enumerate(loader):
        with no_grad():
            if step == 0 and weights == "auto":  # planned forward-only, on the first batch
                call(wrapped.plan_weights, batch)
            # A scalar per device (a loss) has no rows to order; _concat names that below.
            out = map_tensors(call(wrapped, batch), lambda t: t.detach().cpu())
        outputs.append(out)
    n = len(data)
    return Predictions(_concat(outputs) if outputs else None, torch.arange(n))


def predict(
    model: nn.Module,
    data: Any,
    *,
    device_ids: Sequence[torch.device | int | str] | None = None,
    weights: Sequence[float] | str | None = None,
    batch_size: int = 64,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    inference_mode: bool = True,
) -> Predictions:
    """Run ``model`` over every sample of ``data`` on uneven devices; outputs in dataset order.

    Forward only, under ``torch.inference_mode`` (``inference_mode=False``: ``torch.no_grad``,
    for models that fail in inference mode, e.g. ones that later reuse a tensor created there
    in autograd), with the model in ``eval()`` mode for the run (its flags are restored after).
    Outputs are moved to the CPU step by step (so they may outgrow the devices) and joined
    along dim 0 into ordinary tensors. Each batch is ``collate_fn(samples)``
    (``default_collate``): a tensor is passed as ``model(batch)``, a tuple as
    ``model(*batch)``, a dict as ``model(**batch)`` -- so collate only the model's inputs.

    Two ways to run, chosen by whether a ``torch.distributed`` process group is initialized:

    - One process (no group, or ``device_ids`` given): each step of ``batch_size`` samples
      runs through :class:`BalancedDataParallel` over ``device_ids`` split by ``weights``
      (``"auto"``: planned forward-only on the first batch, for each device's memory as
      :class:`BalancedDataParallel` reads it; ``None``: even). Returns all
      outputs, ``indices`` = ``0..len(data)-1``.
    - Under ``torchrun``: each step's ``batch_size`` samples are split over the ranks by
      ``weights`` (one per rank; default ``EVENDP_BATCH_SIZES`` from ``evendp launch``, else
      even); the ranks take consecutive blocks of the dataset, so each returns only its
      rows, in ascending dataset order, with their ``indices`` (see :class:`Predictions` for
      gathering). Pass the plain module (on this rank's device) or a DDP/FSDP2 one: those
      are called on every step, even an empty share, so their collectives stay matched.

    For the largest batch that fits, plan it: ``p = evendp.plan(model, batch, mode=...,
    no_grad=True)`` and pass ``batch_size=p.global_batch, weights=p.split``.

    >>> net = nn.Linear(4, 2)
    >>> x = torch.randn(10, 4)
    >>> pred = predict(net, x, device_ids=["cpu"] * 3, weights=[2, 1, 1], batch_size=4)
    >>> torch.allclose(pred.outputs, net(x)), pred.indices.tolist() == list(range(10))
    (True, True)
    """
    if not isinstance(model, nn.Module):
        raise EvendpError(f"model must be an nn.Module, got {type(model).__name__}")
    n = _validate_data(data)
    validate_int("batch_size", batch_size, minimum=1, example="batch_size=64")
    validate_callable("collate_fn", collate_fn, "a function samples -> batch", allow_none=True)
    validate_bool("inference_mode", inference_mode)
    collate = default_collate if collate_fn is None else collate_fn
    no_grad: NoGrad = torch.inference_mode if inference_mode else torch.no_grad
    if n == 0:
        return Predictions(None, torch.empty(0, dtype=torch.long))
    with model_mode(model, False):  # dropout off, BatchNorm on its running statistics
        if dist.is_available() and dist.is_initialized() and device_ids is None:
            return _predict_ranks(model, data, weights, batch_size, collate, no_grad)
        return _predict_devices(model, data, device_ids, weights, batch_size, collate, no_grad)
