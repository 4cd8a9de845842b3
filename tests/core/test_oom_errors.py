"""Out-of-memory as real devices report it: by type, and as RuntimeErrors from CUDA libraries
and torch's CPU allocator."""

from __future__ import annotations

import pytest
import torch

from evendp._core._oom_errors import is_oom_error
from evendp._training._oom import OomResplit

# Messages as torch, cuBLAS, cuDNN, cuFFT, the CUDA runtime and NCCL word them.
OOM_MESSAGES = [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA "
    "function failed.\nLast error:\nCuda failure 'out of memory'",
]
OTHER_MESSAGES = [
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)",
    "CUDA error: device-side assert triggered",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
    "non-contiguous input.",
    "Expected all tensors to be on the same device",
]


def test_torch_out_of_memory_error_is_oom_by_type() -> None:
    assert is_oom_error(torch.OutOfMemoryError("anything at all"))


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_library_out_of_memory_runtime_errors_are_oom(message: str) -> None:
    assert is_oom_error(RuntimeError(message))


@pytest.mark.parametrize("message", OTHER_MESSAGES)
def test_other_runtime_errors_are_not(message: str) -> None:
    assert not is_oom_error(RuntimeError(message))


def test_other_exception_types_with_the_words_are_not() -> None:
    assert not is_oom_error(ValueError("out of memory"))
    assert not is_oom_error(MemoryError())  # the host's memory: nothing to re-split


def _run(error: BaseException) -> OomResplit:
    guard = OomResplit()

    def chunk_loss(start: int, stop: int) -> torch.Tensor:
        if stop - start > 2:
            raise error
        return torch.ones((), requires_grad=True)

    guard.run(8, chunk_loss, weight=1 / 8, zero_grad=lambda: None)
    return guard


@pytest.mark.parametrize("message", OOM_MESSAGES[:2])
def test_oom_resplit_resplits_on_a_library_oom(message: str) -> None:
    guard = _run(RuntimeError(message))
    assert guard.micro_batch_size == 2 and guard.resplits == 2 and guard.skipped == 0


def test_oom_resplit_lets_other_runtime_errors_through() -> None:
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _run(RuntimeError(OTHER_MESSAGES[0]))
