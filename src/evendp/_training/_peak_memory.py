"""The measured memory of a run on a GPU: the CUDA caching allocator's peak *reserved* bytes.

A GPU runs out of what its allocator reserves (segments, rounding, workspaces), not of what
tensors allocate: the figure the plan's peak is set beside, one per physical device (replicas
sharing a GPU share its allocator). :func:`reserved_peak` and :func:`reset_reserved_peak` are
the report's only reads of the allocator (tests without a GPU replace them through this module).
"""

from __future__ import annotations

import torch

__all__ = ["device_peaks", "reserved_peak", "reset_peaks", "reset_reserved_peak"]


def reserved_peak(device: torch.device) -> int | None:
    """The allocator's peak reserved bytes on ``device`` since the last reset; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_reserved(device))  # GPU only


def reset_reserved_peak(device: torch.device) -> None:
    """Start ``device``'s peak afresh (a run's peak is its own, not the process's so far)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # GPU only


def device_peaks(devices: list[torch.device]) -> list[int | None]:
    """Per entry of ``devices`` (repeats included), its device's peak reserved bytes (``None``
    off CUDA).

    >>> device_peaks([torch.device("cpu")] * 2)
    [None, None]
    """
    read = {d: reserved_peak(d) for d in dict.fromkeys(devices)}  # one read per device
    return [read[d] for d in devices]


def reset_peaks(devices: list[torch.device]) -> None:
    """:func:`reset_reserved_peak` once for each device of ``devices``."""
    for device in dict.fromkeys(devices):
        reset_reserved_peak(device)
