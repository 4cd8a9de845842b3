"""How one training step runs: one strategy object per way, so the Trainer's loop has no modes.

A strategy owns what differs between running a step in one process on several devices and
running it across ranks:

- wrapping the model (:meth:`Strategy.wrap`) and where a batch goes (:meth:`Strategy.place`);
- this process's shares of a step (:meth:`Strategy.shares`) and running one micro-step on
  given per-device rows (:meth:`Strategy.forward`), with the gradient sync on the last one;
- the global count of counted items (:meth:`Strategy.global_count`), the gradient reduction
  after backward (:meth:`Strategy.reduce_gradients`) and the loss reduction, deferred until
  the losses are read (:meth:`Strategy.reduce_losses`);
- peak memory, device names for the report, and whether its state can be checkpointed.

=============================  ===========================================================
:class:`BalancedDP`            one process, :class:`BalancedDataParallel` over its devices
:class:`DDP`                   ``oom_resplit=False``: torch's DistributedDataParallel, with
                               its overlap of all-reduce and backward (``no_sync`` until the
                               last micro-batch); an OOM on one rank is fatal, as in torch
:class:`OomSafeDDP`            the default under torchrun: local backward, then the
                               gradients all-reduced in place in buckets with the OOM flag
                               and the loss riding in the last one, so an OOM on any rank
                               never hangs another
:class:`FSDP2`                 ``fully_shard``; reduce-scatter on the last micro-batch only
=============================  ===========================================================

Why :class:`OomSafeDDP` gives up the overlap even on the last micro-batch: DDP launches a
bucket's all-reduce from inside backward as soon as its gradients are ready. If one rank runs
out of memory half-way through its last backward, the buckets it already launched pair with
the other ranks' while the rest never come; the others block in DDP's reducer with no way to
learn about the OOM. No micro-batch can be proven OOM-free in advance (fragmentation and
other processes change what fits), so every backward stays local and the gradients are
reduced after the ranks agreed to step. The bucketed reduction keeps two buckets in flight,
so it costs about one gradient all-reduce's time, not two copies of memory.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._distributed import comm_device
from ._dp import BalancedDataParallel
from ._oom import all_reduce_gradients
from ._scatter import map_tensors, to_device

__all__ = ["DDP", "FSDP2", "BalancedDP", "OomSafeDDP", "Strategy"]

Batch = Any


def _call(module: nn.Module, part: Batch) -> torch.Tensor:
    out = module(*part) if isinstance(part, (tuple, list)) else module(part)
    return out


class Strategy:
    """The one-device-per-process base: shares, forward and reduction of a rank's step."""

    #: The report's ``mode``.
    name = "ddp"
    #: Micro-steps every process must run even with no samples (collectives inside them).
    min_micro_steps = 0
    #: Whether an OOM may be caught and re-split (no collective inside forward/backward).
    catch_oom = True
    #: Whether :meth:`OomResplit.run_shares` all-reduces the step's total with its flag.
    guard_reduces_total = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device_names = [f"rank{r}" for r in range(self.world)]
        self.wrapped: nn.Module = model

    @property
    def devices(self) -> list[torch.device]:
        """The devices this process runs on (one under torchrun)."""
        return [self.device]

    def wrap(self, loss_module: nn.Module) -> None:
        """Prepare ``loss_module`` (the model with its loss inside forward) for this strategy."""
        for t in self.model.state_dict().values():  # start from rank 0's weights, as DDP does
            dist.broadcast(t, src=0)
        self.wrapped = loss_module

    def place(self, batch: Batch) -> Batch:
        """This rank's batch on its device (the copy runs ahead when the batch is pinned)."""
        return map_tensors(batch, lambda t: to_device(t, self.device))

    def shares(self, n: int) -> list[int]:
        """This process's per-device shares of a step of ``n`` local samples."""
        return [n]

    def ran(self, rows: list[int]) -> list[int]:
        """Per device of the report, the samples a micro-step of ``rows`` ran."""
        return [rows[0] if r == self.rank else 0 for r in range(self.world)]

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-step's forward and backward (gradient sync on ``last``)."""
        return contextlib.nullcontext()

    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        """The wrapped module on ``part`` (``rows[i]`` of its rows for device i)."""
        return _call(self.wrapped, part)

    def global_count(self, local: torch.Tensor) -> torch.Tensor:
        """The step's counted items over all ranks: one all-reduce, read on no host."""
        total = local.to(comm_device(), torch.float64)
        dist.all_reduce(total)
        return total.to(self.device)

    #: Whether a step's loss total is this rank's part only (summed by :meth:`reduce_losses`).
    losses_local = True
    #: ``OomResplit``'s ``agree``: how the step/skip flag is all-reduced (``None``: its own).
    agree: Callable[[torch.Tensor], None] | None = None

    def reduce_gradients(self) -> None:
        """After the step's backward: make the gradients the step's (DDP/FSDP2 already did)."""

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        """Sum ``parts`` ((steps,) this rank's loss parts) over ranks: one all-reduce for all.

        The Trainer calls it only when someone reads the losses (the progress bar's display
        steps, a checkpoint, the report), so a step without logging adds no collective.
        """
        reduced = parts.to(comm_device())
        dist.all_reduce(reduced)
        return reduced

    def peak_memory(self) -> list[int | None]:
        """Per device of the report, the peak allocated bytes (``None``: not a GPU here)."""
        mine = (
            int(torch.cuda.max_memory_allocated(self.device))
            if self.device.type == "cuda"
            else None
        )
        return [mine if r == self.rank else None for r in range(self.world)]

    #: The checkpoint's name in ``out_dir``; ``sharded``: a DCP folder every rank writes.
    checkpoint_name = "ckpt.pt"
    sharded_checkpoint = False

    #: This process's pending stop request (a signal number or ``None``); the Trainer sets it.
    stop_source: Callable[[], int | None] = staticmethod(lambda: None)

    def agree_stop(self) -> int | None:
        """After a step: the stop signal any rank received, the same answer on every rank.

        One tiny all-reduce of ``[SIGINT seen, SIGTERM seen]``, so every rank stops after the
        same step (SIGINT wins when both came).
        """
        votes = _stop_votes(self.stop_source(), comm_device())
        dist.all_reduce(votes)
        return _agreed_signal(votes)


def _stop_votes(signum: int | None, device: torch.device) -> torch.Tensor:
    """``[this rank saw SIGINT, this rank saw SIGTERM]``: summed over ranks, never ambiguous."""
    return torch.tensor(
        [float(signum == signal.SIGINT), float(signum == signal.SIGTERM)], device=device
    )


def _agreed_signal(votes: torch.Tensor) -> int | None:
    sigint, sigterm = (float(v) for v in votes.tolist())
    if sigint > 0:
        return int(signal.SIGINT)
    return int(signal.SIGTERM) if sigterm > 0 else None


class BalancedDP(Strategy):
    """One process: :class:`BalancedDataParallel` splits each micro-step over ``device_ids``.

    The batch stays on the host (pinned when a device is a GPU) and each device's rows are
    copied straight to it by the scatter: nothing is staged on ``device_ids[0]`` first.
    """

    name = "dp"

    def __init__(
        self,
        model: nn.Module,
        device_ids: list[str | int | torch.device] | None,
        weights: list[float] | None,
    ) -> None:
        super().__init__(model)
        self._device_ids = device_ids
        self._weights = weights
        self.dp: BalancedDataParallel | None = None

    def wrap(self, loss_module: nn.Module) -> None:
        self.dp = BalancedDataParallel(loss_module, self._device_ids, weights=self._weights)
        self.wrapped = self.dp
        self.device_names = [
            f"{d}:{i}" if d.index is None else str(d) for i, d in enumerate(self.dp.device_ids)
        ]

    @property
    def devices(self) -> list[torch.device]:
        return list(self._dp.device_ids)

    @property
    def _dp(self) -> BalancedDataParallel:
        if self.dp is None:
            raise RuntimeError("BalancedDP.wrap() was not called")
        return self.dp

    def place(self, batch: Batch) -> Batch:
        return batch

    def shares(self, n: int) -> list[int]:
        return self._dp.split(n)

    def ran(self, rows: list[int]) -> list[int]:
        return list(rows)

    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        with self._dp.fixed_sizes(rows):
            return _call(self._dp, part)

    def global_count(self, local: torch.Tensor) -> torch.Tensor:
        return local.to(self._dp.output_device, torch.float64)

    losses_local = False  # one process: the total is the step's

    def agree_stop(self) -> int | None:
        return self.stop_source()  # one process: nothing to agree on

    def peak_memory(self) -> list[int | None]:
        return [
            int(torch.cuda.max_memory_allocated(d)) if d.type == "cuda" else None
            for d in self._dp.device_ids
        ]


class DDP(Strategy):
    """torch's ``DistributedDataParallel``: all-reduce overlapped with the last backward."""

    min_micro_steps = 1  # one synced backward, even on a rank with no samples
    catch_oom = False  # an OOM in one rank's backward would leave the others in the reducer

    def wrap(self, loss_module: nn.Module) -> None:
        self.wrapped = nn.parallel.DistributedDataParallel(loss_module, **_no_buffer_sync())

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        ddp = self.wrapped
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
        return contextlib.nullcontext() if last else ddp.no_sync()


class OomSafeDDP(Strategy):
    """DDP that survives an OOM on any rank: local backward, then agree, then reduce.

    Every micro-batch accumulates locally (no collective inside forward or backward); then the
    gradients are averaged in place in ~25 MiB buckets (:func:`all_reduce_gradients`) with the
    ranks' ``[OOM flag, loss]`` summed in the last bucket: no collective of its own, and one
    host read (the flag) per step. A rank that failed sends zeros; when any rank failed, all
    zero the result and skip. See the module docstring for why backward is not overlapped.
    """

    guard_reduces_total = True
    losses_local = False  # summed over ranks in the same all-reduce as the step/skip flag
    _votes: torch.Tensor | None = None

    def agree(self, status: torch.Tensor) -> None:
        # The ranks' [OOM flag, loss, SIGINT, SIGTERM] ride in the last gradient bucket: the
        # gradients are averaged and the flags summed in the same collectives, and the one
        # host read (the OOM flag) follows them. A rank that failed sends zeros; if any
        # failed, all skip. The stop votes are read by agree_stop, after that same sync.
        fused = torch.cat([status, _stop_votes(self.stop_source(), status.device)])
        all_reduce_gradients(self.model.parameters(), extra=fused)
        status.copy_(fused[: status.numel()])
        self._votes = fused[status.numel() :]

    def agree_stop(self) -> int | None:
        votes, self._votes = self._votes, None
        if votes is None:  # no step agreed since the last call: a collective of its own
            return super().agree_stop()
        return _agreed_signal(votes)


class FSDP2(Strategy):
    """``fully_shard`` per repeated block and the root; reduce-scatter after the last micro-batch.

    FSDP2 all-gathers parameters inside forward and backward: a retry on one rank would pair
    its collectives with the wrong ones, so an OOM is fatal (micro-batching still works).
    """

    name = "fsdp2"
    catch_oom = False
    checkpoint_name = "ckpt.dcp"
    sharded_checkpoint = True  # torch.distributed.checkpoint: each rank its shards

    def __init__(self, model: nn.Module, accum: int, blocks: Callable[[], list[nn.Module]]):
        super().__init__(model)
        self.min_micro_steps = accum  # the most micro-steps any share is cut into
        self._blocks = blocks

    def wrap(self, loss_module: nn.Module) -> None:
        super().wrap(loss_module)
        from torch.distributed.fsdp import fully_shard

        # One FSDP2 unit per repeated block (their all-gathers overlap compute), then the root.
        for block in self._blocks():
            fully_shard(block)
        fully_shard(self.model)

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()


def _no_buffer_sync() -> dict[str, Any]:
    """DDP's switch for "no buffer broadcast before each forward", in this torch's spelling:
    ``forward_sync_buffers`` since torch 2.13 (``broadcast_buffers`` warns there), else
    ``broadcast_buffers``. The new one still syncs buffers once at construction, where every
    rank holds the same freshly built (or resumed) model."""
    import inspect

    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
