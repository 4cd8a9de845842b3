"""The integrations' ``uneven_dataloader(batch_sizes=...)``: ``None``, and ``"auto"`` as
``TrainConfig`` and ``UnevenTrainer`` have it, planned on one collated sample of the data."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.data import default_collate

import evendp

__all__ = ["auto_loader_sizes"]


def auto_loader_sizes(
    dataset: Any,
    *,
    model: nn.Module | None,
    batch_size: int | None,
    world: int | None,
    memory: str | Sequence[Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    batch_sizes: Any = "auto",
) -> Any:
    """Every rank's share of ``batch_size * world`` samples, planned for ``model`` on
    ``collate_fn([dataset[0]])`` against each rank's memory (``memory``: declared, e.g.
    ``"24GiB"`` for this rank; ``None``: ``EVENDP_MEMORY``, else the GPU's free memory).
    Other ``batch_sizes``: ``None`` is ``EVENDP_BATCH_SIZES``, else ``batch_size`` on every
    rank; sizes are returned as given (checked where used)."""
    if batch_sizes is None:
        default = None if batch_size is None else [batch_size] * (world or 1)
        return evendp.batch_sizes_from_env(world, default=default)
    if not (isinstance(batch_sizes, str) and batch_sizes == "auto"):
        return batch_sizes
    if batch_size is None:
        raise evendp.EvendpError(
            "uneven_dataloader: batch_sizes='auto' splits batch_size * world samples by each "
            "rank's memory, but batch_size=None; pass batch_size= (each rank's mean share, as "
            "per_device_train_batch_size)"
        )
    if len(dataset) == 0:
        raise evendp.EvendpError(
            "uneven_dataloader: batch_sizes='auto' plans on a sample of the data, but it is empty"
        )
    collate = default_collate if collate_fn is None else collate_fn
    sizes, _ = evendp.planned_rank_sizes(
        model,
        lambda: collate([dataset[0]]),  # read only when planning
        batch_size * (world or 1),
        memory=memory,
        where="uneven_dataloader(batch_sizes='auto')",
    )
    return sizes
