"""The run's state as named parts that save and restore themselves (``Stateful``, the shape of
``torch.distributed.checkpoint.stateful.Stateful``), adapters for the parts with no such
methods (:class:`OomCaps`, :class:`SamplerPosition`; :class:`RngState` is the checkpoint
files'), and :class:`PerRank`. ``load_state_dict`` may return a one-line note of what it could
not restore (a split saved for another number of ranks): the resume prints it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._core._validate import is_int, shown
from .._distributed._sampler import UnevenBatchSampler
from ._checkpoint import RngState
from ._oom import OomResplit
from ._recorder import TrainState

__all__ = ["OomCaps", "PerRank", "RngState", "SamplerPosition", "Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """A part of the run's state: ``state_dict()`` saves it, ``load_state_dict(sd)`` restores it.

    >>> import torch
    >>> isinstance(torch.nn.Linear(1, 1), Stateful), isinstance(object(), Stateful)
    (True, False)
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class PerRank:
    """``part``, saved by every rank into its own channel and restored by each from its own.

    >>> PerRank(RngState()).part.what
    'RNG state'
    """

    def __init__(self, part: Stateful) -> None:
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        return self.part.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        return self.part.load_state_dict(state_dict)


class OomCaps:
    """The OOM re-split's state: each device's micro-batch cap, the re-splits and skipped steps.

    Saved under the keys ``micro_batch_sizes``, ``resplits`` and ``skipped`` (the checkpoint's
    ``extra`` has held them since checkpoints had them). Caps saved for another number of
    devices are not applied, and a note says so.

    >>> guard = OomResplit(catch=True, devices=2)
    >>> OomCaps(guard).load_state_dict({"micro_batch_sizes": [None, 3], "resplits": 1})
    >>> guard.micro_batch_sizes, guard.resplits
    ([None, 3], 1)
    >>> OomCaps(guard).load_state_dict({"micro_batch_sizes": [2, 2, 2]})
    'the saved OOM micro-batch caps are per device: not applied here'
    """

    def __init__(self, guard: OomResplit) -> None:
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_sizes": list(self.guard.micro_batch_sizes),
            "resplits": self.guard.resplits,
            "skipped": self.guard.skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> str | None:
        # Its fields are counts: checked as the checkpoint was read (``_check_fields``).
        caps = state_dict.get("micro_batch_sizes")
        guard, note = self.guard, None
        if isinstance(caps, list) and len(caps) == len(guard.micro_batch_sizes):
            guard.micro_batch_sizes = [None if c is None else int(c) for c in caps]
        elif isinstance(caps, list) and any(c is not None for c in caps):
            note = "the saved OOM micro-batch caps are per device: not applied here"
        guard.resplits = state_dict.get("resplits", 0)
        guard.skipped = state_dict.get("skipped", 0)
        return note


class SamplerPosition:
    """This rank's place in the data: its rank, the epoch and the batches trained in it, the
    per-rank batch sizes in force; a per-rank part, as torchtitan keeps a data loader's state
    per data-parallel rank.

    The sampler is deterministic in (seed, epoch), so the position itself is the run's (the
    ``train`` part, restored first): each rank's own record must agree with it, else the
    checkpoint is torn (refused: the resume falls back); the sampler is set to its epoch, and
    a note says when the data is split otherwise now.

    >>> sampler, train = UnevenBatchSampler(8, [3, 1], rank=1), TrainState(devices=2, epoch=2)
    >>> saved = SamplerPosition(sampler, train).state_dict(); saved
    {'rank': 1, 'epoch': 2, 'batch_in_epoch': 0, 'batch_sizes': [3, 1]}
    >>> SamplerPosition(sampler, TrainState(devices=2, epoch=2)).load_state_dict(saved)
    >>> sampler.epoch
    2
    >>> SamplerPosition(sampler, TrainState(devices=2)).load_state_dict(saved)
    Traceback (most recent call last):
    ValueError: rank 1 saved epoch 2, batch 0, the run is at epoch 0, batch 0
    """

    def __init__(self, sampler: UnevenBatchSampler, train: TrainState) -> None:
        self.sampler, self.train = sampler, train

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.sampler.rank,
            "epoch": self.train.epoch,
            "batch_in_epoch": self.train.batch_in_epoch,
            "batch_sizes": list(self.sampler.batch_sizes),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> str | None:
        saved: list[Any] = [state_dict.get(k) for k in ("rank", "epoch", "batch_in_epoch")]
        if not all(is_int(v) and v >= 0 for v in saved):  # read from a file: checked
            raise ValueError(f"rank, epoch, batch_in_epoch: must be counts, got {shown(saved)}")
        rank, epoch, batch = (int(v) for v in saved)
        train, sampler = self.train, self.sampler
        if rank != sampler.rank:
            raise ValueError(f"rank {sampler.rank} holds rank {rank}'s record")
        if (epoch, batch) != (train.epoch, train.batch_in_epoch):
            raise ValueError(
                f"rank {rank} saved epoch {epoch}, batch {batch}, the run is at epoch "
                f"{train.epoch}, batch {train.batch_in_epoch}"
            )
        sampler.set_epoch(epoch)
        sizes = state_dict.get("batch_sizes")
        if sizes == list(sampler.batch_sizes):
            return None
        return (
            f"rank {rank}: the data was split {shown(sizes)} when saved, "
            f"{list(sampler.batch_sizes)} now: the remaining samples follow this run's split"
        )
