"""ZeRO stage 1 in torch's own engine: OOM-safe DDP's gradients, the optimizer's state sharded.

Every rank holds the whole model and, after OOM-safe DDP's all-reduce, the whole averaged
gradient (so clipping, the non-finite gate and the exactness are DDP's); torch's
``ZeroRedundancyOptimizer`` then keeps AdamW's moments for one slice of the parameters on each
rank, updates that slice and broadcasts it. The optimizer's memory falls by the number of ranks;
the update adds one broadcast per step. A checkpoint is still one ``ckpt.pt``: every rank sends
its slice of the state to rank 0 before it writes, and at a resume every rank reads the whole
state and keeps its slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..._core._errors import EvendpError
from .._checkpointer import WholeFile
from .._step import Stepper
from ._ddp import OomSafeDDP

__all__ = ["Zero1", "build"]


class ConsolidatedFile(WholeFile):
    """``ckpt.pt`` as :class:`WholeFile` writes it, the sharded optimizer state gathered on
    rank 0 first (a collective: every rank saves, as every rank agrees on errors anyway)."""

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        optimizer = parts.get("optimizer")
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().save(path, parts, rank=rank, extra=extra, keep_previous=keep_previous)
        optimizer.consolidate_state_dict(to=0)
        try:
            return super().save(path, parts, rank=rank, extra=extra, keep_previous=keep_previous)
        finally:  # rank 0 would hold every rank's slice until the next save: torch keeps
            # the consolidated list in this attribute (set at its construction, torch 2.x)
            optimizer._all_state_dicts = []  # type: ignore[attr-defined]


class Zero1(OomSafeDDP):
    """``strategy="zero1"``: OOM-safe DDP with AdamW's state sharded over the ranks."""

    name = "zero1"
    checkpoint_format = ConsolidatedFile()
    # The update broadcasts each rank's slice: it waits for the others (not a local part).
    local_parts = frozenset({"backward"})

    def wrap(self, loss_module: torch.nn.Module, optimizer: Any = None) -> None:
        if optimizer is not None:
            raise EvendpError(
                f"strategy='zero1' shards its own AdamW over the ranks, but optimizer="
                f"{type(optimizer).__name__} was given; pass optimizer=None (lr and "
                "weight_decay come from TrainConfig) or use strategy='ddp'"
            )
        super().wrap(loss_module)

    def build_stepper(
        self,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        config: Any,
        *,
        where: str = "",
    ) -> Stepper:
        if scheduler is not None:  # built on another optimizer: it would never reach this one
            raise EvendpError(
                "strategy='zero1' builds its own sharded AdamW, so a scheduler= (built on "
                "another optimizer) would never set its rate; pass warmup_steps= for a "
                "warmup, or use strategy='ddp' with your optimizer and scheduler"
            )
        sharded = ZeroRedundancyOptimizer(
            self.model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=config.lr,
            weight_decay=config.weight_decay,
        )
        return super().build_stepper(sharded, scheduler, config, where=where)


def build(model: Any, config: Any, device_ids: Any, weights: Any) -> Zero1:
    """The registry's ``"zero1"``."""
    return Zero1(model)
