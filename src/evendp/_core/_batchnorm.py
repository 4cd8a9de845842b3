"""The one warning for BatchNorm under an uneven split, for every surface that splits a step
(``BalancedDataParallel``'s devices, the Trainer's ranks)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["warn_if_batchnorm_split_unevenly"]


def warn_if_batchnorm_split_unevenly(
    module: nn.Module, shares: Sequence[float] | None, named: str
) -> None:
    """Warn when BatchNorm statistics will differ from one device's: whenever ``shares`` (the
    devices' weights or the ranks' batch sizes, ``named`` so) split a step unevenly, whoever
    chose them (the caller, ``"auto"``, a rehearsal, a planned run).

    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     warn_if_batchnorm_split_unevenly(nn.BatchNorm1d(4), [3, 1], "batch_sizes")
    >>> "batch_sizes=[3, 1] split each step unevenly" in str(seen[0].message)
    True
    """
    if shares is None or len(shares) < 2:
        return
    if len({float(w) for w in shares if float(w) > 0}) < 2:
        return  # an even split over the active devices, as nn.DataParallel does
    name = next(
        (n for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training), None
    )
    if name is None:
        return
    warnings.warn(
        f"BatchNorm layer {name or type(module).__name__!r} is in training mode and "
        f"{named}={list(shares)!r} split each step unevenly: every device normalizes its share "
        "with that share's own statistics, so the loss and gradient are not those of one "
        "device on the whole batch. For exactness use GroupNorm or LayerNorm, or put the "
        "BatchNorm layers in eval() mode; under DDP on GPUs, "
        "nn.SyncBatchNorm.convert_sync_batchnorm(model) normalizes over all ranks",
        UserWarning,
        stacklevel=3,
    )
