"""How one training step runs: one strategy object per way, so the Trainer's loop has no modes.

A strategy (:class:`Strategy`, the abstract contract) owns everything that differs between
running a step in one process on several devices and running it across ranks: wrapping,
this process's shares and their placement, gradient sync on the last micro-batch, the
step/skip consensus and the stop agreement, the gradient, loss and sample-count reductions,
evaluation, how the sampler splits by cost, and the checkpoint format.

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

:func:`pick_strategy` is the one place that chooses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._balanced_dp import BalancedDP
from ._base import Strategy
from ._ddp import DDP
from ._fsdp2 import FSDP2
from ._oom_safe_ddp import OomSafeDDP

__all__ = ["DDP", "FSDP2", "BalancedDP", "OomSafeDDP", "Strategy", "pick_strategy"]


def pick_strategy(
    model: nn.Module,
    *,
    strategy: str,
    oom_resplit: bool,
    accum: int,
    blocks: Callable[[], list[nn.Module]],
    device_ids: list[str | int | torch.device] | None,
    weights: list[float] | None,
) -> Strategy:
    """The way of running a step for this process: no process group means one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return BalancedDP(model, device_ids, weights)
    if strategy == "fsdp2":
        return FSDP2(model, accum, blocks)
    return OomSafeDDP(model) if oom_resplit else DDP(model)
