"""What every one-process-per-device strategy shares: ranks of a ``torchrun`` process group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._core._batchnorm import warn_if_batchnorm_split_unevenly
from ..._core._calls import as_args
from ..._distributed._group import comm_device
from ..._distributed._interrupt import StopNotice, group_store
from ..._distributed._step_count import StepWeight
from ..._parallel._scatter import map_tensors, to_device
from .._evaluate import EvalFn, evaluate_ranks
from ._base import Batch, Costs, Sampling, Strategy, agreed_signal, build_sampler, stop_votes
from ._placement import place_model

__all__ = ["RankStrategy"]


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place, on the communication device."""
    reduced = t.to(comm_device())
    dist.all_reduce(reduced)
    return reduced


class RankStrategy(Strategy):
    """One device per process: this rank runs its own share; collectives join the ranks.

    The sampler splits each step over the ranks (by cost when costs are given); each rank's
    loss total is its part of the step's mean, summed over ranks when read; an OOM is fatal
    (collectives inside backward would pair wrongly after a retry) unless a subclass agrees
    on it (:class:`~evendp._training._strategies.OomSafeDDP`).
    """

    name = "ddp"
    _launched = True
    # An OOM in one rank's backward would leave the others in its collectives.
    _survives_oom = False

    def __init__(self, model: nn.Module) -> None:
        if dist.get_backend() == "nccl":  # NCCL reduces on the rank's own GPU: the model too
            place_model(model, comm_device(), "this rank's GPU", say=dist.get_rank() == 0)
        super().__init__(model)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device_names = [f"rank{r}" for r in range(self.world)]
        self._notice: StopNotice | None = None
        self._done = 0  # steps done, as of the last agree_stop

    def wrap(self, loss_module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        for t in self.model.state_dict().values():  # start from rank 0's weights, as DDP does
            dist.broadcast(t, src=0)
        self.wrapped = loss_module

    def sampler(
        self,
        data: Any,
        config: Any,
        *,
        costs: Costs,
        max_costs: Sequence[float] | None,
        max_tokens: float | None,
        model: Callable[[], nn.Module],
        example: Callable[[], Any],
    ) -> Sampling:
        # The ranks split each step by cost: every rank computes the same plan.
        built = build_sampler(
            data, config, requested=config.batch_sizes, rank=self.rank, world=self.world,
            distributed=True, costs=costs, max_costs=max_costs, max_tokens=max_tokens,
            model=model, example=example,
        )  # fmt: skip
        if self.rank == 0:  # said once, as for one process's devices
            warn_if_batchnorm_split_unevenly(self.model, built[0].batch_sizes, "batch_sizes")
        return built

    def place(self, batch: Batch) -> Batch:
        """This rank's batch on its device (the copy runs ahead when the batch is pinned)."""
        return map_tensors(batch, lambda t: to_device(t, self.device))

    def shares(self, n: int) -> list[int]:
        return [n]

    def count_weight(self, local: torch.Tensor) -> StepWeight:
        # One all-reduce, started now and waited for after the first forward (it overlaps
        # the forward), read on no host.
        return StepWeight(self.world, local, self.device)

    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        summed = self.wrapped(*as_args(part))
        # A request received by now (before this micro-step's backward) stops every rank
        # after this very step: no rank can finish the step before this rank joins the
        # step's last gradient collective, which comes after the notice.
        self._post_stop()
        return summed

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        """Sum ``parts`` over ranks: one all-reduce for every step not read yet.

        The Trainer calls it only when someone reads the losses (the progress bar every step,
        a checkpoint, the report), so a step without logging adds no collective.
        """
        return _all_reduce(parts)

    def reduce_samples(self, samples: list[int]) -> list[int]:
        # Each rank counted only its own share.
        summed = _all_reduce(torch.tensor(samples, dtype=torch.float64))
        return [int(v) for v in summed.tolist()]

    def agree_stop(
        self,
        step: int,
        votes: tuple[float, float] | None = None,
        *,
        starting: bool = False,
        interrupted: KeyboardInterrupt | None = None,
    ) -> int | None:
        """Before the first step (``starting``): one tiny all-reduce of ``[SIGINT seen,
        SIGTERM seen]`` (SIGINT wins when both came), and this fit's stop notice. After a
        step: the store's stop notice, no collective and no read of a tensor
        (:class:`StopNotice`): every rank stops after the same step."""
        if interrupted is not None:
            raise interrupted  # the other ranks could not agree on it: it propagates
        self._done = step
        if starting:
            self._notice = StopNotice(group_store())  # one per fit: the same key on every rank
        if starting or self._notice is None:
            return self._vote_now()
        self._post_stop()  # received after the step's last backward: stop after the next one
        return self._notice.due(step)

    def _vote_now(self) -> int | None:
        """The ranks' stop votes in one all-reduce of their own."""
        return agreed_signal(_all_reduce(stop_votes(self._stop_source(), comm_device())))

    def _post_stop(self) -> None:
        mine = self._stop_source()
        if mine is not None and self._notice is not None:
            self._notice.post(mine, self._done)  # stop after the step following _done

    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        eval_fn: EvalFn,
        *,
        batch_sizes: list[int],
        collate: Callable[[list[int]], Batch],
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> dict[str, float]:
        return evaluate_ranks(
            model, data, eval_fn, batch_sizes=batch_sizes, collate=collate,
            device=self.device, autocast=autocast, every_step=self._forward_collectives,
        )  # fmt: skip

    #: Whether forward itself runs collectives (FSDP2's all-gathers): then evaluation runs a
    #: rank's empty shares too.
    _forward_collectives = False
