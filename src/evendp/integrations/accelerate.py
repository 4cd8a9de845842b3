"""Per-rank batch sizes in a training loop written with Hugging Face Accelerate.

Accelerate shards a prepared loader's batches round robin, batch ``i`` to rank
``i % world_size``: a rank-aware sampler would be sharded twice. :func:`uneven_dataloader`
gives it every rank's batch of each step in rank order instead, which the round robin
de-interleaves. :class:`UnevenAccelerator` makes a standard loop exact as it is (the user's
mean loss, ``accumulate``, ``backward``, per-batch scheduler steps); with a plain
``Accelerator`` the loss is the user's (``global_count`` and ``ddp_loss``), and prepared
schedulers step once per optimizer step either way: the loader is already per rank.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

import evendp

from ._auto_sizes import auto_loader_sizes
from ._rows import gather_rows, no_rows
from ._samplers import InterleavedBatchSampler
from ._speed import batch_rows, resizable, resplitting
from .deepspeed import fill_auto_micro_batch

__all__ = ["UnevenAccelerator", "speed_balancer", "uneven_dataloader"]


def _one_step_schedulers(owner: weakref.ref[Accelerator]) -> None:
    """Make the accelerator's prepared LR schedulers step once per optimizer step.

    Accelerate's prepared scheduler steps ``num_processes`` times per call, meant for a loader
    it shards itself; the uneven loader is already per rank, so the schedule would run
    ``num_processes`` times too fast, in silence. Schedulers are prepared before or after
    the loader, but before an epoch starts: set then (the loader's ``on_epoch``).
    """
    for scheduler in getattr(owner(), "_schedulers", []):
        scheduler.split_batches = True  # one scheduler step per call


# UnevenAccelerator takes no count_fn: a batch it cannot count is weighed with StepMean's.
_NO_ROWS = "collate tensors, or use accelerate.Accelerator with evendp.StepMean(count_fn=...)"


class _WeighingLoader:
    """The prepared loader of :class:`UnevenAccelerator`: records each yielded batch's weight,
    ``samples * world_size / samples of its optimizer step over all ranks`` (the window of
    ``gradient_accumulation_steps`` batches ``accumulate`` syncs on)."""

    _is_accelerate_prepared = True  # preparing it again returns it

    def __init__(self, loader: Any, sampler: InterleavedBatchSampler, accelerator: Any) -> None:
        self.loader, self.sampler, self.accelerator = loader, sampler, accelerator

    def __iter__(self) -> Iterator[Any]:
        accum, world = self.accelerator.gradient_accumulation_steps, len(self.sampler.ranks)
        steps = len(self.sampler.ranks[0])
        accelerator = self.accelerator
        for i, batch in enumerate(self.loader):
            window = range(i - i % accum, min(i - i % accum + accum, steps))
            total = sum(self.sampler.samples_in_step(j) for j in window)
            stand_in = evendp.is_stand_in(batch)
            rows = 0 if stand_in else batch_rows(batch, _NO_ROWS)
            accelerator._evendp_weight = rows * world / total if total else 0.0
            accelerator._evendp_stand_in = stand_in
            yield batch
        accelerator._evendp_weight, accelerator._evendp_stand_in = None, False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # set_epoch, dataset, batch_sampler, device, ...
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class UnevenAccelerator(Accelerator):
    """An ``Accelerator`` whose ``backward`` and schedulers are exact with per-rank batch sizes.

    With the training loader from :func:`uneven_dataloader`, a standard loop (``accumulate``,
    the model's mean loss, ``backward``, ``scheduler.step()`` every batch) trains on the
    gradient and the schedule of one process on each step's samples. ``split_batches`` and
    ``dispatch_batches`` are refused (each rank loads its own batches).

    >>> accelerator = UnevenAccelerator(cpu=True)
    >>> data = torch.utils.data.TensorDataset(torch.arange(6.0))
    >>> loader = uneven_dataloader(accelerator, data, [4], shuffle=False)
    >>> model = accelerator.prepare(torch.nn.Linear(1, 1))
    >>> [len(x) for (x,) in loader]
    [4, 2]
    """

    # The batch an uneven loader yielded last: its weight (for backward), a stand-in?
    _evendp_weight: float | None = None
    _evendp_stand_in = False

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward`` of the last yielded batch's mean loss, weighted exactly."""
        weight = self._evendp_weight
        if weight is None:
            raise evendp.EvendpError(
                "UnevenAccelerator.backward weights the batch an uneven_dataloader(accelerator, "
                "...) loader yielded last, but no such loader is being iterated; build the "
                "training loader with uneven_dataloader, or use accelerate.Accelerator"
            )
        if self.distributed_type == DistributedType.DEEPSPEED:
            # The weight spans the step already: DeepSpeed's engine must not divide again.
            kwargs.setdefault("scale_wrt_gas", False)
            scale = weight
        else:  # Accelerator.backward divides by the accumulation steps: undone here.
            scale = weight * self.gradient_accumulation_steps
        super().backward(evendp.share_loss(loss, scale), **kwargs)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every rank's rows of what the batch an uneven loader yielded last gave, each once
        and in rank order (Accelerate's needs one shape on every rank); a stand-in's none.
        Outside such a loader, Accelerate's own."""
        if self._evendp_weight is None or use_gather_object:
            return super().gather_for_metrics(input_data, use_gather_object)
        if self._evendp_stand_in:
            input_data = no_rows(input_data)
        return gather_rows(self, input_data)

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.prepare``; under DeepSpeed a ``DummyScheduler``'s ``total_num_steps``
        is the run's number of steps (Accelerate divides it by ``num_processes``, for a loader
        it shards: the schedule would end half-way on 2 ranks, in silence, issue 36)."""
        if self.distributed_type != DistributedType.DEEPSPEED:
            return super().prepare(*args, **kwargs)
        from accelerate.utils import DummyScheduler

        # Each DummyScheduler's total_num_steps times the processes while Accelerate divides
        # it back (ceil(T * n / n) == T); restored after: the user's object is unchanged.
        dummies = [a for a in args if isinstance(a, DummyScheduler) and a.total_num_steps]
        given = [d.total_num_steps for d in dummies]
        for dummy in dummies:
            dummy.total_num_steps = dummy.total_num_steps * self.num_processes
        try:
            prepared = super().prepare(*args, **kwargs)
        finally:
            for dummy, steps in zip(dummies, given, strict=True):
                dummy.total_num_steps = steps
        return prepared

    def end_training(self) -> None:
        """``Accelerator.end_training``, with the process group settled before it is destroyed.

        Accelerate destroys the group while the user's prepared DDP model is alive, which
        frees it later from Python: under gloo a rank then hung after training (two ranks on
        one core). :func:`evendp.settle_group` first. Call it on every process.
        """
        if dist.is_available() and dist.is_initialized() and not self.state.fork_launched:
            evendp.settle_group()
        super().end_training()


def _validate(accelerator: object, batch_sizes: object) -> tuple[Accelerator, list[int]]:
    """The accelerator and the sizes as a list (the sampler checks their values)."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise evendp.EvendpError(
            f"batch_sizes must be a sequence of non-negative ints (one per process), got "
            f"{batch_sizes!r}; pass e.g. [1, 3], or evendp.batch_sizes_from_env()"
        )
    batch_sizes = list(batch_sizes)
    if not isinstance(accelerator, Accelerator):
        raise evendp.EvendpError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}; "
            "create one with Accelerator() before building the dataloader"
        )
    if len(batch_sizes) != accelerator.num_processes:
        raise evendp.EvendpError(
            f"got {len(batch_sizes)} batch sizes {batch_sizes!r} for "
            f"{accelerator.num_processes} processes; pass one batch size per process"
        )
    config = accelerator.dataloader_config
    if config.split_batches or config.dispatch_batches:
        raise evendp.EvendpError(
            "uneven_dataloader needs DataLoaderConfiguration(split_batches=False, "
            f"dispatch_batches=False), got split_batches={config.split_batches}, "
            f"dispatch_batches={config.dispatch_batches}: each rank loads its own batches"
        )
    return accelerator, batch_sizes


def uneven_dataloader(
    accelerator: Accelerator,
    dataset: Any,
    batch_sizes: Sequence[int] | Literal["auto"] | None = None,
    *,
    model: torch.nn.Module | None = None,
    memory: str | Sequence[Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    costs: Sequence[float] | Callable[[Any], float] | None = None,
    max_tokens: float | None = None,
    stand_in: bool | None = None,
    batch_size: int | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A dataloader already passed through ``accelerator.prepare``, ``batch_sizes[rank]`` a batch.

    Every rank yields the same number of batches; over all ranks each sample comes once per
    epoch (``drop_last=False``), in one permutation seeded by ``seed + epoch``.
    ``batch_sizes`` defaults to ``EVENDP_BATCH_SIZES`` (``evendp launch``), else
    ``batch_size`` on every rank; ``"auto"`` splits ``batch_size * world`` by each rank's
    memory (``memory=``, ``EVENDP_MEMORY``, else the GPU's free memory), planned for
    ``model`` on one collated sample. An empty share is a stand-in (one real sample of weight
    0) with an :class:`UnevenAccelerator`, else a zero-length batch (``stand_in`` chooses).
    ``costs`` and ``max_tokens`` are :class:`evendp.UnevenBatchSampler`'s; other keyword
    arguments go to ``torch.utils.data.DataLoader``.

    >>> import torch
    >>> from accelerate import Accelerator
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
    >>> loader = uneven_dataloader(Accelerator(cpu=True), data, [4], shuffle=False)
    >>> [batch[0].tolist() for batch in loader]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """
    if isinstance(accelerator, Accelerator):  # else refused below
        batch_sizes = auto_loader_sizes(
            dataset, model=model, batch_size=batch_size, world=accelerator.num_processes,
            memory=memory, collate_fn=collate_fn, batch_sizes=batch_sizes,
        )  # fmt: skip
    accelerator, sizes = _validate(accelerator, batch_sizes)
    weighing = isinstance(accelerator, UnevenAccelerator)
    if weighing and max_tokens is not None:
        raise evendp.EvendpError(
            "UnevenAccelerator weighs each batch by the samples of its step, known from the "
            "plan, but max_tokens makes the steps' sample counts data-dependent; use "
            "accelerate.Accelerator with evendp.StepMean (weigh each loss, finish before "
            "clipping) for a token budget"
        )
    sampler = InterleavedBatchSampler(
        dataset,
        sizes,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        costs=costs,
        max_tokens=max_tokens,
    )
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=evendp.EmptySafeCollate(
            dataset, collate_fn, stand_in=weighing if stand_in is None else stand_in
        ),
        **loader_kwargs,
    )
    fill_auto_micro_batch(accelerator, sizes)  # DeepSpeed reads it from batch_size: None here
    prepared: DataLoader = accelerator.prepare(loader)
    sampler.on_epoch = functools.partial(_one_step_schedulers, weakref.ref(accelerator))  # type: ignore[method-assign]
    if weighing:
        return _WeighingLoader(prepared, sampler, accelerator)  # type: ignore[return-value]
    return prepared


def speed_balancer(loader: DataLoader, **knobs: Any) -> evendp.SpeedBalancer:
    """A :class:`evendp.SpeedBalancer` that re-splits ``loader``'s steps by measured speed.

    ``loader`` comes from :func:`uneven_dataloader`. Time each forward pass with
    ``with balancer.measure(len(batch)):`` (the forward and the loss, not
    ``accelerator.backward``, which waits for the slowest rank) and call
    ``balancer.step()`` after every optimizer step on every rank: samples then move from
    slow ranks to fast ones; each step's samples, and the gradient, stay those of one
    process. ``knobs`` go to :class:`evendp.SpeedBalancer` (``caps``, ``warmup``, ...).

    >>> import torch
    >>> from accelerate import Accelerator
    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> balancer = speed_balancer(uneven_dataloader(Accelerator(cpu=True), data, [4]))
    >>> balancer.batch_sizes
    [4]
    """
    sampler = resizable(loader)
    if sampler is None:
        raise evendp.EvendpError(
            f"speed_balancer needs a loader from uneven_dataloader, got {type(loader).__name__}; "
            "build it with evendp.integrations.accelerate.uneven_dataloader(accelerator, ...)"
        )
    # The user's loop calls step(): the loader's split changes where it is decided.
    return resplitting(sampler, **knobs)
