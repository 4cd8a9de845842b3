"""Ranks as threads of this process, on torch's threaded process group.

For tests that check only collective arithmetic (counts, means, weights summed over ranks):
no process to start, so a property-based test can try a hundred world sizes and splits in the
time one spawned rank takes to import torch. torch's own distributed tests prefer this tier
("Prefer MultiThreadedTestCase for most tests", ``common_distributed.py``).

What it cannot run: anything that reads the rank from the environment (``RANK``: one process,
one environment), DDP/FSDP2 wrappers and gloo's own behaviour; those go to the rank pool
(:mod:`tests._pool`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_threads"]


def run_threads(fn: Callable[[int, int], Any], world_size: int, timeout_s: float = 60) -> list[Any]:
    """``fn(rank, world_size)`` on ``world_size`` threads, each a rank of one threaded process
    group; their results by rank. The first rank's exception is raised here; a hang fails after
    ``timeout_s``."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    world = _install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def rank_body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size)
        except BaseException as exc:  # reported to the test below
            errors.append((rank, exc))
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting in a collective
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    threads = [
        threading.Thread(target=rank_body, args=(r,), daemon=True) for r in range(world_size)
    ]
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a group registry per thread
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
    finally:
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()  # the real process-group world is back for the next test
    if errors:
        # The ranks woken from a collective by the failure end in SystemExit: report the cause.
        rank, exc = min(errors, key=lambda e: (isinstance(e[1], SystemExit), e[0]))
        raise AssertionError(f"rank {rank} of {world_size} failed: {exc!r}") from exc
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a rank of {world_size} did not finish within {timeout_s} s")
    return results
