"""One pool of rank processes for the whole pytest run.

Starting a rank (spawning Python, importing torch, evendp and often transformers) costs far
more on 2 cores than the multi-rank test body it runs. So, like torch's own
``MultiProcContinuousTest``, the ranks are started once and fed the test bodies as tasks:
``RANKS.run(worker, nprocs, args, ...)`` calls ``worker(rank, *args)`` on ranks ``0..nprocs-1``
of the pool, which grows to the largest ``nprocs`` asked for.

Each task makes and destroys its own process group (a fresh port each time), and whatever a
task changes in the process is put back when it ends: the environment, the working
directory, signal handlers, warning filters, torch's thread count and default dtype, any
process group left open, and Accelerate's singleton state. A task that fails or hangs takes
the pool down with it (the other ranks may be stuck in a collective); the next task starts a
fresh one.

Tests of a process's own life (teardown, stalls, exit codes, signals from outside) keep their
own processes: the pool runs only bodies that return normally.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests._gc import freeze_survivors

__all__ = ["RANKS", "RankPool", "close_pool"]

_CTX = mp.get_context("spawn")
# Signals a task may take over (the Trainer's stop handlers, a test's own).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
# After one rank failed, how long the others get to report before the pool is taken down.
_GRACE_S = 10.0
# How long a new rank may take to start and import torch (a loaded 2-core machine).
_START_S = 180.0
_LOG_TAIL = 4000


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """Put back what a task may change in its process."""
    import torch.distributed as dist

    env = dict(os.environ)
    cwd = os.getcwd()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        _forget_framework_singletons()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(deterministic)


def _forget_framework_singletons() -> None:
    """Accelerate (under the HF Trainer too) keeps its distributed state in class-level
    singletons that outlive the process group a task destroyed: the next task's Accelerator
    would believe the group started and never start one."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _save_coverage() -> None:
    """Under ``make coverage``: what this rank ran so far is saved after every task, so a pool
    taken down by a failure (its ranks killed) keeps the coverage of its earlier tasks."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.save()


def _serve(conn: Connection, log: str) -> None:
    """A pool rank: run tasks until told to stop (``None``); answer each with its outcome."""
    stream = open(log, "a", buffering=1)  # noqa: SIM115 - the rank's stdout/stderr for life
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)  # stacks on demand
    # Python's own start: pytest run as a background job of a script inherits SIGINT ignored,
    # and a task that checks the handlers it leaves behind expects the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)  # 2 cores shared by every rank
    freeze_survivors()
    conn.send(("ready", None))  # started and imported: a task's time counts from here
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        try:
            fn, rank, args = task
            print(f"--- task {getattr(fn, '__qualname__', fn)} rank {rank}", flush=True)
            with _process_state_restored():
                fn(rank, *args)
            reply: tuple[str, str | None] = ("ok", None)
        except BaseException:
            reply = ("error", traceback.format_exc())
        _save_coverage()
        freeze_survivors()  # what the task imported, out of later collections (tests/_gc.py)
        conn.send(reply)


def _said_ready(conn: Connection) -> bool:
    try:
        return conn.poll(_START_S) and conn.recv()[0] == "ready"
    except (EOFError, OSError):  # died while starting
        return False


class _Rank:
    def __init__(self, index: int, folder: Path) -> None:
        self.log = folder / f"rank{index}.log"
        self.conn, child = _CTX.Pipe()
        self.process = _CTX.Process(
            target=_serve, args=(child, str(self.log)), name=f"pool-rank{index}", daemon=True
        )
        self.process.start()
        child.close()

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            return ""


class RankPool:
    """Rank processes started once and reused by every multi-rank test body."""

    def __init__(self, grace_s: float = _GRACE_S) -> None:
        self.grace_s = grace_s  # after one rank failed, how long the others get to report
        self._ranks: list[_Rank] = []
        self._folder: Path | None = None
        self.started = 0  # processes started over the pool's life (a test checks reuse)

    def run(
        self,
        worker: Callable[..., None],
        nprocs: int,
        args: Sequence[Any] = (),
        timeout_s: float = 300,
        what: str = "the ranks",
    ) -> None:
        """Call ``worker(rank, *args)`` on ranks ``0..nprocs-1``; fail the test (with each
        rank's traceback or, after ``timeout_s``, its stacks) when any rank does not return."""
        import pytest

        ranks = self._ranks_for(nprocs)
        try:
            for rank, member in enumerate(ranks):
                member.conn.send((worker, rank, tuple(args)))
            problem = self._collect(ranks, timeout_s)
        except BaseException:  # pytest-timeout or Ctrl-C mid-task: no rank is left busy
            self.close(force=True)
            raise
        if problem is not None:
            self.close(force=True)
            pytest.fail(f"{what}: {problem}", pytrace=False)

    def close(self, force: bool = False) -> None:
        """Stop the ranks: asked to return (their coverage data is saved), or killed."""
        for member in self._ranks:
            if not force:
                with contextlib.suppress(OSError):
                    member.conn.send(None)
        for member in self._ranks:
            member.process.join(timeout=0 if force else 30)
            if member.process.is_alive():
                member.process.kill()
                member.process.join()
            member.conn.close()
        self._ranks = []

    def remove_logs(self) -> None:
        """Remove the ranks' log folder (once they are stopped)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _ranks_for(self, nprocs: int) -> list[_Rank]:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="evendp-rank-pool-"))
        for member in self._ranks:
            if not member.process.is_alive():  # a rank that died between tasks: start afresh
                self.close(force=True)
                break
        new = [_Rank(i, self._folder) for i in range(len(self._ranks), nprocs)]
        self._ranks += new
        self.started += len(new)
        for member in new:  # started together, waited for together
            if not _said_ready(member.conn):
                tail = member.log_tail()
                self.close(force=True)
                raise RuntimeError(f"a pool rank did not start in {_START_S:.0f} s:\n{tail}")
        return self._ranks[:nprocs]

    def _collect(self, ranks: list[_Rank], timeout_s: float) -> str | None:
        """None when every rank returned; otherwise what went wrong, with the evidence."""
        deadline = time.monotonic() + timeout_s
        waiting = dict(enumerate(ranks))
        errors: dict[int, str] = {}
        while waiting and time.monotonic() < deadline:
            for rank, member in list(waiting.items()):
                if member.conn.poll(0.05):
                    try:
                        status, detail = member.conn.recv()
                    except (EOFError, OSError):
                        status, detail = "error", "the process died:\n" + member.log_tail()
                    del waiting[rank]
                    if status != "ok":
                        errors[rank] = detail
                elif not member.process.is_alive():
                    del waiting[rank]
                    errors[rank] = "the process died:\n" + member.log_tail()
            if errors:  # the others may wait on the failed rank in a collective
                deadline = min(deadline, time.monotonic() + self.grace_s)
        if errors:
            return "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items()))
        if not waiting:
            return None
        for member in waiting.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.process.pid, signal.SIGUSR1)
        time.sleep(1.0)  # let faulthandler write the stacks
        stacks = "\n".join(f"rank {r}:\n{m.log_tail()}" for r, m in waiting.items())
        return f"did not finish within {timeout_s:.0f} s (a rank hung); their stacks:\n{stacks}"


#: The pytest run's pool (closed by tests/conftest.py at the end of the session).
RANKS = RankPool()


def close_pool() -> None:
    """End of the session: stop the ranks so they exit normally, and remove their logs."""
    RANKS.close()
    RANKS.remove_logs()
