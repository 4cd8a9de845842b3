"""What ``BalancedDataParallel(..., gather_output=False)`` returns: per-device outputs and
their split, and :func:`gather`, which joins them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._core._errors import EvendpError
from ._dp_checks import describe
from ._scatter import gather_outputs

__all__ = ["Scattered", "gather", "validate_scattered"]


@dataclass(frozen=True)
class Scattered:
    """Per-device outputs of ``BalancedDataParallel(..., gather_output=False)`` and their split.

    ``outputs[i]`` lives on ``devices[i]`` and covers ``sizes[i]`` consecutive samples of the
    batch; ``counts[i]`` is the number of items a scalar in it is a mean over (``None``: the
    samples). Hand it to :class:`ParallelCriterion`, or to :func:`gather` for the full output.
    """

    outputs: list[Any]
    sizes: list[int]
    devices: list[torch.device]
    dim: int
    output_device: torch.device
    counts: list[float] | None = None

    @property
    def batch_size(self) -> int:
        """The number of samples across all devices (N)."""
        return sum(self.sizes)


def gather(scattered: Scattered) -> Any:
    """The full output on ``scattered.output_device``: per-device outputs joined along ``dim``.

    >>> from torch import nn
    >>> from evendp import BalancedDataParallel
    >>> model = BalancedDataParallel(nn.Linear(3, 2), ["cpu", "cpu"], gather_output=False)
    >>> parts = model(torch.randn(5, 3))
    >>> parts.sizes, gather(parts).shape
    ([3, 2], torch.Size([5, 2]))
    """
    validate_scattered(scattered)
    return gather_outputs(
        scattered.outputs,
        scattered.sizes,
        scattered.output_device,
        scattered.dim,
        scattered.counts,
    )


def validate_scattered(value: Any) -> None:
    """``value`` is a :class:`Scattered` (kept beside it: the checks module cannot import it
    without a circle through :func:`gather`)."""
    if not isinstance(value, Scattered):
        raise EvendpError(
            "expected the Scattered returned by BalancedDataParallel(..., gather_output=False), "
            f"got {describe(value)}; for an already gathered output call the criterion directly"
        )
