"""Gathering per-row outputs whose row count differs by rank (uneven batches; a stand-in
batch, an empty share, gives none): Accelerate's ``gather`` needs one shape on every rank."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import recursively_apply

__all__ = ["RowsGather", "gather_rows", "no_rows"]


class RowsGather:
    """``accelerator.gather`` for tensors whose first dimension differs by rank (TRL's
    ``DPOTrainer`` gathers per-sample rewards). Every call gathers the row counts first (so
    every rank runs the same collectives), pads to the longest, and keeps each rank's rows."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.gather = type(accelerator).gather.__get__(accelerator)

    def __call__(self, tensor: Any) -> Any:
        one = self.accelerator.num_processes == 1
        if one or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return self.gather(tensor)
        rows = self.gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        if len(set(rows)) == 1:
            return self.gather(tensor)
        padded = self.accelerator.pad_across_processes(tensor, dim=0)
        gathered, longest = self.gather(padded), max(rows)
        return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(rows)])


def no_rows(data: Any) -> Any:
    """``data`` (a tensor or nested tensors) with no rows: what a stand-in gives back.

    >>> no_rows((torch.ones(2, 3), None))[0].shape
    torch.Size([0, 3])
    """
    if data is None:
        return None
    return recursively_apply(lambda t: t[:0], data)


def gather_rows(accelerator: Any, data: Any) -> Any:
    """Every rank's rows of ``data`` (nested tensors), in rank order, whatever each holds."""
    return recursively_apply(RowsGather(accelerator), data)
