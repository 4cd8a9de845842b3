"""The strategies of ranks under ``torchrun``, one process per device: DDP, OOM-safe DDP.

:class:`RankStrategy` is what every one-process-per-device strategy shares (FSDP2, ZeRO-1 and
DeepSpeed build on it): this rank's share on its device, the losses and samples summed over
ranks when read, the stop agreement. :class:`DDP` is torch's ``DistributedDataParallel``
(``oom_resplit=False``). :class:`OomSafeDDP`, the default, survives an OOM on any rank.

Why not DDP's own reducer for the default: DDP launches a bucket's all-reduce from inside
backward, and if one rank runs out of memory half-way through its last backward, the buckets
it launched pair with the other ranks' while the rest never come; the others block in DDP's
reducer with no way to learn about the OOM. Here every rank runs the same collectives whatever
happens (:class:`~evendp._distributed._grad_buckets.GradientBuckets`: every bucket once, in one
order, then the step's flags): during the last backward each bucket goes as soon as it is
ready, so the reduction overlaps backward as DDP's does; a rank that failed launches the rest
at the end of its step, and the flags say whether the result is used, reduced again (a rank's
launched copy was stale: it retried after an OOM) or dropped (an OOM with nothing left to
try). One call ends a step, :meth:`OomSafeDDP.finish_step`, and returns what was agreed.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..._core._batchnorm import warn_if_batchnorm_split_unevenly
from ..._core._calls import as_args
from ..._distributed._grad_buckets import GradientBuckets
from ..._distributed._group import BUCKET_BYTES, comm_device
from ..._distributed._interrupt import StopNotice, group_store
from ..._parallel._scatter import map_tensors, to_device
from .._evaluate import EvalRun, evaluate_ranks
from .._step import StepWeight
from ._base import Batch, SamplerInputs, Sampling, StepEnd, Strategy, build_sampler, place_model

__all__ = ["DDP", "OomSafeDDP", "RankStrategy", "build", "signal_of", "stop_votes"]


def _all_reduce(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` summed over the ranks, in place, on the communication ``device``."""
    reduced = t.to(device)
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
        #: Where a tensor must sit to be communicated (read once: the group's, for the run).
        self.comm = comm_device()
        if dist.get_backend() == "nccl":  # NCCL reduces on the rank's own GPU: the model too
            place_model(model, self.comm, "this rank's GPU", say=dist.get_rank() == 0)
        super().__init__(model)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device_names = [f"rank{r}" for r in range(self.world)]
        self._notice: StopNotice | None = None
        self._done = 0  # steps done, as of the last agree_stop

    def wrap(self, loss_module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        for t in self.model.state_dict().values():  # start from rank 0's weights, as DDP does
            dist.broadcast(t, src=0)
        self.wrapped = loss_module

    def sampler(self, inputs: SamplerInputs) -> Sampling:
        # The ranks split each step by cost: every rank computes the same plan.
        built = build_sampler(
            inputs, requested=inputs.config.batch_sizes, rank=self.rank, world=self.world,
            distributed=True,
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
        return StepWeight(self.world, local, self.device, self.comm)

    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        summed = self.wrapped(*as_args(part))
        # A request received by now (before this micro-step's backward) stops every rank
        # after this very step: no rank can finish the step before this rank joins the
        # step's last gradient collective, which comes after the notice.
        self._post_stop()
        return summed

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        """Sum ``parts`` over ranks: one all-reduce for every step not read yet (only when
        the losses are read: a step without logging adds no collective)."""
        return _all_reduce(parts, self.comm)

    def reduce_samples(self, samples: list[int]) -> list[int]:
        # Each rank counted only its own share.
        summed = _all_reduce(torch.tensor(samples, dtype=torch.float64), self.comm)
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
        votes = _all_reduce(stop_votes(self._stop.signum, self.comm), self.comm)
        return signal_of(*(float(v) for v in votes.tolist()))

    def _post_stop(self) -> None:
        mine = self._stop.signum
        if mine is not None and self._notice is not None:
            self._notice.post(mine, self._done)  # stop after the step following _done

    def evaluate(self, run: EvalRun) -> dict[str, float]:
        return evaluate_ranks(run, device=self.device, every_step=self._forward_collectives)

    #: Whether forward itself runs collectives (FSDP2's all-gathers): then evaluation runs a
    #: rank's empty shares too.
    _forward_collectives = False


class DDP(RankStrategy):
    """``oom_resplit=False``: torch's DistributedDataParallel, with its overlap of all-reduce
    and backward (``no_sync`` until the last micro-batch); an OOM on one rank is fatal, as in
    torch. Every rank runs at least one synced backward, even with no samples."""

    # Its backward all-reduces in buckets (it waits for the slowest rank); the optimizer
    # step, on gradients already averaged, is this rank's own.
    local_parts = frozenset({"optimizer"})
    _min_micro_steps = 1  # DDP's reducer waits for every rank's backward

    def wrap(self, loss_module: nn.Module, optimizer: Any = None) -> None:
        self.wrapped = nn.parallel.DistributedDataParallel(loss_module, **_no_buffer_sync())

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        ddp = self.wrapped
        if last or not isinstance(ddp, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return ddp.no_sync()


def _no_buffer_sync() -> dict[str, Any]:
    """DDP's switch for "no buffer broadcast before each forward", in this torch's spelling:
    ``forward_sync_buffers`` since torch 2.13 (``broadcast_buffers`` warns there), else
    ``broadcast_buffers``. The new one still syncs buffers once at construction, where every
    rank holds the same freshly built (or resumed) model."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class OomSafeDDP(RankStrategy):
    """The default under torchrun: every micro-batch accumulates locally; the last one's
    backward launches each ~25 MiB gradient bucket's all-reduce once it is ready (DDP's
    overlap); the ranks' ``[OOM flag, loss, SIGINT, SIGTERM, stale]`` ride in the last bucket
    (in an all-reduce of their own when the gradients are not float32 on the communication
    device), the step's one host read. When any rank failed, all drop the
    result and skip: the reduction was wasted, never wrong."""

    _buckets: GradientBuckets | None = None
    #: Bytes per gradient bucket (DDP's 25 MiB).
    bucket_bytes = BUCKET_BYTES
    # No collective waited for in backward (its buckets' all-reduces run beside it) or in
    # the optimizer step: both are this rank's own compute.
    local_parts = frozenset({"backward", "optimizer"})
    _survives_oom = True

    def _gradient_buckets(self, *, recheck: bool = False) -> GradientBuckets:
        """The buckets of the parameters being trained: built at first use (the model is
        final after wrap), and again between steps (``recheck``, at the last micro-step or
        the step's end, which every rank reaches, empty share or not) when that set changed
        (layers unfrozen, on every rank alike, as their optimizers are)."""
        current = self._buckets
        fresh = current is not None and not current._launched  # not mid-step
        if current is None or (recheck and fresh and not current.holds(self.model.parameters())):
            if current is not None:
                current.remove()
            current = GradientBuckets(self.model.parameters(), bucket_bytes=self.bucket_bytes)
            self._buckets = current
        return current

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if not last or self.world == 1:  # only the last micro-step's gradients are final
            return contextlib.nullcontext()
        return self._gradient_buckets(recheck=True).overlapping()  # each bucket goes once ready

    def finish_step(self, failed: bool, total: torch.Tensor | None) -> StepEnd:
        """The buckets backward did not launch, then the step's flags ``[OOM, loss total,
        SIGINT, SIGTERM, stale]`` riding in the last one (the same collectives on every rank,
        whatever failed; one rank has nothing to reduce: its flags are the sums), read once
        (:func:`agree_step`)."""
        buckets = self._gradient_buckets(recheck=True) if self.world > 1 else None
        where = self.comm
        mine = torch.zeros((), device=where) if total is None else total.to(where).float()
        stale = buckets is not None and buckets.stale
        failed_stale = torch.tensor([float(failed), float(stale)], device=where)
        votes = stop_votes(self._stop.signum, where)
        flags = torch.cat([failed_stale[:1], mine.reshape(1), votes, failed_stale[1:]])
        if buckets is not None:
            buckets.finish(flags, failed=failed)
        return agree_step(flags, buckets)

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        return parts  # already summed over ranks in the step's own all-reduce

    def agree_stop(
        self,
        step: int,
        votes: tuple[float, float] | None = None,
        *,
        starting: bool = False,
        interrupted: KeyboardInterrupt | None = None,
    ) -> int | None:
        if starting or interrupted is not None:
            return super().agree_stop(step, starting=starting, interrupted=interrupted)
        if votes is None:  # no step agreed since the last call: a collective of its own
            self._done = step
            return self._vote_now()
        return signal_of(*votes)


def agree_step(flags: torch.Tensor, buckets: GradientBuckets | None) -> StepEnd:
    """The flags that rode with the gradients, summed: skip on every rank when any failed
    (the reduction dropped), else the reduced buckets into ``.grad`` or, where some rank's
    launched copy was stale (agreed in the flags, so on every rank alike), one more
    all-reduce of ``.grad``; the step's total over every rank and the stop votes."""
    # The one host read of a step, the flags together: whether a rank failed decides the
    # retry arithmetic's next plan and the skipped count, which the host keeps; a stale copy
    # anywhere makes every rank reduce again (data every rank has).
    failed_anywhere, _, sigint, sigterm, stale_anywhere = flags.tolist()
    if failed_anywhere:
        if buckets is not None:
            buckets.discard()  # host bookkeeping only: nothing to wait for
        return StepEnd(None, (sigint, sigterm))
    if buckets is not None:
        if stale_anywhere:
            buckets.reduce_again()
        else:
            buckets.apply()
    return StepEnd(flags[1], (sigint, sigterm))


def stop_votes(signum: int | None, device: torch.device) -> torch.Tensor:
    """``[this rank saw SIGINT, this rank saw SIGTERM]``: summed over ranks, never ambiguous."""
    return torch.tensor(
        [float(signum == signal.SIGINT), float(signum == signal.SIGTERM)], device=device
    )


def signal_of(sigint: float, sigterm: float) -> int | None:
    """The signal of summed votes already read (SIGINT wins when both came).

    >>> signal_of(0.0, 2.0) == signal.SIGTERM, signal_of(0.0, 0.0)
    (True, None)
    """
    if sigint > 0:
        return int(signal.SIGINT)
    return int(signal.SIGTERM) if sigterm > 0 else None


def build(model: nn.Module, config: Any, device_ids: Any, weights: Any) -> DDP | OomSafeDDP:
    """The registry's ``"ddp"``: OOM-safe unless ``config.oom_resplit`` is off."""
    return OomSafeDDP(model) if config.oom_resplit else DDP(model)
