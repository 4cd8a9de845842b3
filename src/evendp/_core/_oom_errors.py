"""What an out-of-memory error is, and which device it came from.

Low layers (the threaded replicas, :class:`~evendp.BalancedDataParallel`) tag an error with
where it happened; the OOM re-split (:mod:`evendp._training._oom`) and the CLI read the tag.
The tags are attributes of the exception itself, so they survive a re-raise from a worker
thread; these helpers are the one place that names them.
"""

from __future__ import annotations

import re

import torch

__all__ = ["device_index_of", "is_oom_error", "replica_of", "tag_device_index", "tag_replica"]

# Out-of-memory reported as a plain RuntimeError by libraries that allocate on their own:
# cuBLAS/cuDNN/cuFFT/cuSOLVER/cuSPARSE workspaces ("CUBLAS_STATUS_ALLOC_FAILED",
# "CUDNN_STATUS_ALLOC_FAILED", "CUFFT_ALLOC_FAILED"), the CUDA runtime ("CUDA error: out of
# memory") and NCCL ("Cuda failure 'out of memory'"); and the host: torch's CPU allocator raises
# a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...").
_OOM_MESSAGE = re.compile(
    r"_ALLOC_FAILED|out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE
)

# The entry of the replica list that raised (set by parallel_apply), and the entry of
# BalancedDataParallel's device_ids it ran on (what a caller shrinks).
_REPLICA = "evendp_replica"
_DEVICE_INDEX = "evendp_device_index"


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` means a device ran out of memory: by type first, message as fallback.

    >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    True
    >>> is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    True
    >>> is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    True
    >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and _OOM_MESSAGE.search(str(error)) is not None


def tag_replica(error: BaseException, index: int) -> None:
    """Record that the ``index``-th replica of a parallel apply raised ``error``."""
    setattr(error, _REPLICA, index)


def replica_of(error: BaseException) -> int:
    """The replica that raised ``error`` (0 when untagged: a single replica)."""
    return int(getattr(error, _REPLICA, 0))


def tag_device_index(error: BaseException, index: int) -> None:
    """Record that ``error`` came from entry ``index`` of the wrapper's ``device_ids``.

    >>> error = torch.OutOfMemoryError("injected")
    >>> tag_device_index(error, 2)
    >>> device_index_of(error), error.evendp_device_index
    (2, 2)
    """
    setattr(error, _DEVICE_INDEX, index)


def device_index_of(error: BaseException) -> int | None:
    """The entry of ``device_ids`` that raised ``error``; ``None`` when no device is named."""
    index = getattr(error, _DEVICE_INDEX, None)
    return None if index is None else int(index)
