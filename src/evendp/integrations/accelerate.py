"""Per-rank batch sizes in a training loop written with Hugging Face Accelerate.

``accelerator.prepare`` wraps a dataloader's batch sampler in Accelerate's ``BatchSamplerShard``,
which hands the sampler's batch ``i`` to rank ``i % world_size``. A sampler that is already
rank-aware (:class:`evendp.UnevenBatchSampler`) is then sharded a second time and each rank
silently loses ``(W - 1) / W`` of its batches. :func:`uneven_dataloader` instead gives Accelerate
a *global* batch sampler: for every step it yields each rank's batch in rank order (rank 0's,
rank 1's, ...), so ``BatchSamplerShard``'s round robin de-interleaves it back into each rank's
own batches. It has no ``batch_size`` (Accelerate then accepts batches of any length) and no
``generator`` (Accelerate would overwrite it); its ``sampler`` attribute carries ``set_epoch``,
which is how Accelerate's ``DataLoaderShard`` reaches it at every epoch.

:class:`UnevenAccelerator` makes the rest of a standard loop exact as it is: the user's mean
loss, ``accelerator.accumulate`` and ``accelerator.backward``. Its ``backward`` weights the
loss of the batch the uneven loader yielded last by that batch's samples over the samples of
its whole optimizer step on all ranks (known from the plan, no communication), times the world
size (DDP averages over ranks) and the accumulation steps (which ``Accelerator.backward``
divides by); an empty share is a stand-in sample of weight exactly 0. Its prepared LR
schedulers step once per optimizer step: the loader is already per rank, so Accelerate's
``num_processes`` steps per call (meant for a loader it shards itself) would run the schedule
``num_processes`` times too fast.

With a plain ``Accelerator`` the loss is the user's (the recipe: sum the loss, count every
micro-batch of the optimizer step, one :func:`evendp.global_count`, :func:`evendp.ddp_loss`);
its prepared LR schedulers, too, step once per optimizer step from the uneven loader's first
epoch on (a schedule whose steps are scaled by ``num_processes``, as Accelerate's examples do
for even loaders, would then run that many times too slowly).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

import evendp

from .._distributed._group import settle_group
from .._distributed._step_mean import count_rows
from .._planning._balance import applied_by
from ._auto_sizes import auto_loader_sizes
from ._interleave import InterleavedBatchSampler
from ._rows import gather_rows, no_rows
from .deepspeed import fill_auto_micro_batch

__all__ = ["UnevenAccelerator", "speed_balancer", "uneven_dataloader"]


class _OneStepSchedulers:
    """Make ``accelerator``'s prepared LR schedulers step once per optimizer step.

    Accelerate's prepared scheduler steps ``num_processes`` times per call, meant for a loader
    it shards itself (each rank ``1 / num_processes`` of the batches). The uneven loader is
    already per rank: the schedule would run ``num_processes`` times too fast, in silence.
    Schedulers are prepared before or after the loader, but before an epoch starts: set then.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = weakref.ref(accelerator)

    def __call__(self) -> None:
        accelerator = self.accelerator()
        for scheduler in accelerator._schedulers if accelerator is not None else []:
            scheduler.split_batches = True  # one scheduler step per call


class _BatchWeights:
    """The weight of the batch an uneven loader yielded last (read by ``backward``), and
    whether it was a stand-in (read by ``gather_for_metrics``)."""

    def __init__(self) -> None:
        self.current: float | None = None
        self.stand_in = False


class _WeighingLoader:
    """The prepared loader of :class:`UnevenAccelerator`: records each yielded batch's weight.

    The weight is ``samples * world_size / samples of the optimizer step over all ranks``;
    the step is the window of ``gradient_accumulation_steps`` batches that
    ``accelerator.accumulate`` syncs on (the last one of an epoch shorter).
    """

    _is_accelerate_prepared = True  # preparing it again returns it

    def __init__(self, loader: Any, sampler: InterleavedBatchSampler, accelerator: Any) -> None:
        self.loader, self.sampler, self.accelerator = loader, sampler, accelerator

    def __iter__(self) -> Iterator[Any]:
        accum, world = self.accelerator.gradient_accumulation_steps, len(self.sampler.ranks)
        steps = len(self.sampler.ranks[0])
        weights = self.accelerator._evendp_weights
        for i, batch in enumerate(self.loader):
            window = range(i - i % accum, min(i - i % accum + accum, steps))
            total = sum(self.sampler.samples_in_step(j) for j in window)
            weights.current = count_rows(batch) * world / total if total else 0.0
            weights.stand_in = evendp.is_stand_in(batch)
            yield batch
        weights.current, weights.stand_in = None, False

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_sampler, device, ...
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


@contextlib.contextmanager
def _whole_step_counts(args: tuple[Any, ...], processes: int) -> Iterator[None]:
    """While Accelerate prepares ``args``: each ``DummyScheduler``'s ``total_num_steps``
    times ``processes``, which Accelerate divides back (``ceil(T * n / n) == T``); restored
    after, so the user's object is unchanged."""
    from accelerate.utils import DummyScheduler

    dummies = [a for a in args if isinstance(a, DummyScheduler) and a.total_num_steps]
    given = [d.total_num_steps for d in dummies]
    for dummy in dummies:
        dummy.total_num_steps = dummy.total_num_steps * processes
    try:
        yield
    finally:
        for dummy, steps in zip(dummies, given, strict=True):
            dummy.total_num_steps = steps


class UnevenAccelerator(Accelerator):
    """An ``Accelerator`` whose ``backward`` and schedulers are exact with per-rank batch sizes.

    Build the training loader with :func:`uneven_dataloader` (this accelerator first); then a
    standard loop (``accelerator.accumulate``, the model's mean loss, ``accelerator.backward``,
    ``scheduler.step()`` every batch) trains on the gradient of the mean over each optimizer
    step's samples on all ranks, with the learning-rate schedule of one process. Arguments are
    ``Accelerator``'s; ``split_batches`` and ``dispatch_batches`` are refused (each rank loads
    its own batches).

    >>> accelerator = UnevenAccelerator(cpu=True)
    >>> data = torch.utils.data.TensorDataset(torch.arange(6.0))
    >>> loader = uneven_dataloader(accelerator, data, [4], shuffle=False)
    >>> model = accelerator.prepare(torch.nn.Linear(1, 1))
    >>> [len(x) for (x,) in loader]
    [4, 2]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._evendp_weights = _BatchWeights()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward`` of the last yielded batch's mean loss, weighted exactly."""
        weight = self._evendp_weights.current
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
        and in rank order (dataset order with ``shuffle=False``); a stand-in's none. Outside
        such a loader, Accelerate's own.

        Accelerate's needs one shape on every rank and drops rows it padded at the end; the
        uneven loader pads nothing, and its ranks' rows differ.
        """
        if self._evendp_weights.current is None or use_gather_object:
            return super().gather_for_metrics(input_data, use_gather_object)
        if self._evendp_weights.stand_in:
            input_data = no_rows(input_data)
        return gather_rows(self, input_data)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Accelerate's scheduler, stepping once per optimizer step (the loader is per rank)."""
        prepared = super().prepare_scheduler(scheduler)
        prepared.split_batches = True  # one scheduler step per call, not num_processes
        return prepared

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.prepare``; under DeepSpeed its schedulers also step once per call,
        and a ``DummyScheduler``'s ``total_num_steps`` is the run's number of steps.

        Accelerate's DeepSpeed path wraps a torch scheduler itself, not through
        :meth:`prepare_scheduler`; and it fills a DeepSpeed config's ``"auto"`` scheduler
        fields with ``total_num_steps / num_processes``, for a loader it shards. The uneven
        loader is per rank already: its length is the run's steps, and the schedule would
        end half-way on 2 ranks, in silence (issue 36).
        """
        if self.distributed_type != DistributedType.DEEPSPEED:
            return super().prepare(*args, **kwargs)
        with _whole_step_counts(args, self.num_processes):
            prepared = super().prepare(*args, **kwargs)
        for scheduler in self._schedulers:
            scheduler.split_batches = True  # DeepSpeed's own wrapper never steps: harmless
        return prepared

    def end_training(self) -> None:
        """``Accelerator.end_training``, with the process group settled before it is destroyed.

        Accelerate destroys the group while the user's prepared DDP model is still alive; when
        that model goes (the end of ``main``), it frees the group from Python. Under gloo a
        worker thread still dropping the last collective then waits for the GIL that the
        freeing thread holds while it joins that worker: the rank hangs after training (seen
        with two ranks on one core). So, as :func:`evendp.finish_distributed` does: a barrier
        and a pause with the GIL released first. Call it on every process, as Accelerate asks.
        """
        if dist.is_available() and dist.is_initialized() and not self.state.fork_launched:
            settle_group()
        super().end_training()


def _validate_accelerator(accelerator: object, batch_sizes: list[int]) -> Accelerator:
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
    return accelerator


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
    epoch (``drop_last=False``), in one permutation seeded by ``seed + epoch`` (Accelerate's
    ``DataLoaderShard`` sets the epoch when it starts iterating). ``batch_sizes`` defaults to
    ``EVENDP_BATCH_SIZES`` (set by ``evendp launch``), else to ``batch_size`` on every rank;
    ``"auto"`` splits ``batch_size * world`` by each rank's memory (``memory=`` or
    ``EVENDP_MEMORY``, else the GPU's free memory), planned for ``model`` on one collated
    sample, as ``UnevenTrainer``. A rank may get an empty batch in the short last step
    (always when its size is 0):
    ``collate_fn`` is wrapped in :class:`evendp.EmptySafeCollate`; with an
    :class:`UnevenAccelerator` it is a stand-in (one real sample, weight exactly 0 in its
    ``backward``), else a real, zero-length batch (the ``ddp_loss`` recipe counts its 0
    samples); ``stand_in`` chooses (``None``: a stand-in with an ``UnevenAccelerator``).
    Preparing the returned loader again returns it unchanged (Accelerate marks it prepared).
    Other keyword arguments (``num_workers``, ``pin_memory``, ...) go to
    ``torch.utils.data.DataLoader``.
    ``costs`` (each sample's length, or a function of ``dataset[i]``) sends each step's
    samples to ranks by padded cost and ``max_tokens`` makes the step a token budget, as
    :class:`evendp.UnevenBatchSampler` does; :func:`speed_balancer` moves samples between
    ranks by measured speed.

    >>> import torch
    >>> from accelerate import Accelerator
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
    >>> loader = uneven_dataloader(Accelerator(cpu=True), data, [4], shuffle=False)
    >>> [batch[0].tolist() for batch in loader]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """
    auto = isinstance(batch_sizes, str) and batch_sizes == "auto"
    if auto and isinstance(accelerator, Accelerator):
        batch_sizes = auto_loader_sizes(
            dataset, model=model, batch_size=batch_size, world=accelerator.num_processes,
            memory=memory, collate_fn=collate_fn, where="uneven_dataloader",
        )  # fmt: skip
    if batch_sizes is None and isinstance(accelerator, Accelerator):
        world = accelerator.num_processes
        default = None if batch_size is None else [batch_size] * world
        batch_sizes = evendp.batch_sizes_from_env(world, default=default)
    sizes = _as_list(batch_sizes)
    accelerator = _validate_accelerator(accelerator, sizes)
    weighing = isinstance(accelerator, UnevenAccelerator)
    if weighing and max_tokens is not None:
        raise evendp.EvendpError(
            "UnevenAccelerator weighs each batch by the samples of its step, known from the "
            "plan, but max_tokens makes the steps' sample counts data-dependent; use "
            "accelerate.Accelerator with evendp.StepMean (weigh each loss, finish before "
            "clipping) for a token budget"
        )
    options = {"costs": costs, "max_tokens": max_tokens}
    sampler = InterleavedBatchSampler(dataset, sizes, shuffle, seed, drop_last, **options)
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
    sampler.on_epoch = _OneStepSchedulers(accelerator)  # type: ignore[method-assign]
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
    sampler: Any = loader
    for _ in range(4):  # DataLoaderShard -> BatchSamplerShard -> ours
        sampler = getattr(sampler, "batch_sampler", None)
        if isinstance(sampler, InterleavedBatchSampler):
            # The user's loop calls step(): the loader's split changes where it is decided.
            return evendp.SpeedBalancer(
                sampler.batch_sizes, **applied_by(sampler.set_batch_sizes, knobs)
            )
    raise evendp.EvendpError(
        f"speed_balancer needs a loader from uneven_dataloader, got {type(loader).__name__}; "
        "build it with evendp.integrations.accelerate.uneven_dataloader(accelerator, ...)"
    )


def _as_list(batch_sizes: object) -> list[int]:
    """The sizes as a list; the sampler checks the values (non-negative ints, one positive)."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise evendp.EvendpError(
            f"batch_sizes must be a sequence of non-negative ints (one per process), got "
            f"{batch_sizes!r}; pass e.g. [1, 3], or evendp.batch_sizes_from_env()"
        )
    return list(batch_sizes)
