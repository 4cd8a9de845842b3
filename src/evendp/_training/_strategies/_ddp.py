"""torch's ``DistributedDataParallel``: the all-reduce overlapped with the last backward."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from torch import nn

from ._ranks import RankStrategy

if TYPE_CHECKING:
    from ._oom_safe_ddp import OomSafeDDP

__all__ = ["DDP", "build"]


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
    import inspect

    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def build(model: nn.Module, config: Any, device_ids: Any, weights: Any) -> DDP | OomSafeDDP:
    """The registry's ``"ddp"``: OOM-safe unless ``config.oom_resplit`` is off."""
    from ._oom_safe_ddp import OomSafeDDP

    return OomSafeDDP(model) if config.oom_resplit else DDP(model)
