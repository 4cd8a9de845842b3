"""Small helpers shared by test modules (import as ``from tests._helpers import ...``)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from evendp._planning._launch import _free_port
from tests._pool import RANKS


def require(*names: str) -> None:
    """Skip the calling test module when an optional stack is not installed, without
    importing it: both pytest workers collect every module, and lightning, deepspeed and trl
    take 2-3 s each to import; the tests import them where they run."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}", allow_module_level=True)


def free_port() -> int:
    """A TCP port nobody listens on right now (never a fixed 29500)."""
    return _free_port()


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full (unbuffered: nothing is left to
    flush at close)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (64 * 1024, 1):
            try:
                while True:
                    os.write(fd, bytes(chunk))
            except OSError:
                pass
    finally:
        os.close(fd)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class OomInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory for batches above ``limit``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, limit: int) -> torch.Tensor:
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if grad.shape[0] > ctx.limit:
            raise torch.OutOfMemoryError("injected OOM in backward")
        return grad, None


def run_ranks(
    worker: Callable[..., None], nprocs: int, out: Path, timeout_s: int, what: str
) -> list[Any]:
    """Run ``worker(rank, port, out)`` on ``nprocs`` ranks of the shared pool
    (:mod:`tests._pool`) and load each ``rankR.pt``.

    A rank that fails or hangs fails the test (after ``timeout_s``, with its stacks) instead of
    blocking the suite.
    """
    RANKS.run(worker, nprocs, (free_port(), str(out)), timeout_s, what)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def tiny_gpt2_config(**overrides: Any) -> Any:
    """A GPT-2 small enough for 2 cores (no download), dropout off so runs compare exactly.

    The tests' real-workload model: ``transformers.GPT2LMHeadModel(tiny_gpt2_config())``.
    """
    transformers = pytest.importorskip("transformers")
    settings: dict[str, Any] = {
        "vocab_size": 64,
        "n_positions": 32,
        "n_embd": 16,
        "n_layer": 1,
        "n_head": 2,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
    }
    settings.update(overrides)
    return transformers.GPT2Config(**settings)


def torchrun_env(rank: int, world_size: int, port: int) -> None:
    """Set what torchrun sets for ``rank`` of one node (in a spawned worker), offline, and one
    intra-op thread per rank (2 cores shared by every rank)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
