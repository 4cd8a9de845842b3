"""FSDP2: ``fully_shard`` per repeated block and the root; reduce-scatter on the last one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._core._errors import EvendpError
from .._checkpointer import CheckpointFormat, DcpShards
from ._ddp import RankStrategy

__all__ = ["FSDP2", "build", "refuse_prebuilt_optimizer"]


def refuse_prebuilt_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """FSDP2 shards the parameters: an optimizer built before would update stale tensors."""
    if optimizer is not None:
        raise EvendpError(
            "strategy='fsdp2' shards the parameters, so an optimizer built before would "
            "update stale tensors; pass optimizer=None (AdamW with config.lr is built "
            "after sharding)"
        )


class FSDP2(RankStrategy):
    """``fully_shard`` per repeated block and the root; reduce-scatter after the last micro-batch.

    FSDP2 all-gathers parameters inside forward and backward: a retry on one rank would pair
    its collectives with the wrong ones, so an OOM is fatal (micro-batching still works), and
    every rank runs as many micro-steps (and evaluation forwards) as the most any rank runs.
    Checkpoints are ``torch.distributed.checkpoint`` folders in which each rank writes its
    shards (:class:`~evendp._training._checkpointer.DcpShards`).
    """

    name = "fsdp2"
    checkpoint_format: CheckpointFormat = DcpShards()
    _forward_collectives = True

    def __init__(self, model: nn.Module, accum: int, blocks: Callable[[], list[nn.Module]]):
        super().__init__(model)
        self._min_micro_steps = accum  # the most micro-steps any share is cut into
        self._blocks = blocks

    def wrap(self, loss_module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        refuse_prebuilt_optimizer(optimizer)
        super().wrap(loss_module)
        from torch.distributed.fsdp import fully_shard

        # One FSDP2 unit per repeated block (their all-gathers overlap compute), then the root.
        for block in self._blocks():
            fully_shard(block)
        fully_shard(self.model)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()


def build(model: nn.Module, config: Any, device_ids: Any, weights: Any) -> FSDP2:
    """The registry's ``"fsdp2"``: one FSDP2 unit per repeated block, then the root."""
    from ..._core._blocks import repeated_blocks

    return FSDP2(model, config.accum, lambda: repeated_blocks(model))
