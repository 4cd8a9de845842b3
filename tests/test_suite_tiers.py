"""The suite's own machinery (docs/testing.md): the rank pool reuses its ranks and puts back
what a task changed, a failing or hung rank fails its test with the evidence, and a hung test
fails within the per-test timeout with every thread's stack."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._helpers import free_port
from tests._pool import RankPool


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """A pool of this module's own (the shared one is not taken down by the failures here)."""
    own = RankPool(grace_s=2.0)
    yield own
    own.close()
    own.remove_logs()


def _leave_traces(rank: int, out: str) -> None:
    """A task that changes its process and reports what it found on arrival."""
    seen = {"env": os.environ.get("EVENDP_POOL_PROBE"), "cwd": os.getcwd(), "pid": os.getpid()}
    Path(out, f"seen{rank}").write_text(repr(seen))
    os.environ["EVENDP_POOL_PROBE"] = "left behind"
    os.chdir("/")


def _fail_on_rank_1(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone


def _start_accelerate(rank: int, port: int, out: str) -> None:
    """An Accelerator on a gloo pair (as the HF Trainer makes one), left as a test leaves it."""
    from accelerate import Accelerator
    from accelerate.state import PartialState

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    Accelerator(cpu=True)
    Path(out, f"state{rank}").write_text(str(PartialState._shared_state != {}))


def _accelerate_state(rank: int, out: str) -> None:
    from accelerate.state import PartialState

    Path(out, f"after{rank}").write_text(str(PartialState._shared_state != {}))


def _hang(rank: int) -> None:
    time.sleep(3600)


@pytest.mark.multiprocess
def test_the_pool_reuses_its_ranks_and_puts_back_what_a_task_changed(
    pool: RankPool, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    started = pool.started
    pool.run(_leave_traces, 2, (str(first),), 60, "first")
    pool.run(_leave_traces, 2, (str(second),), 60, "second")
    assert pool.started - started <= 2  # at most the two ranks, started once
    for rank in range(2):
        before = eval((first / f"seen{rank}").read_text())
        after = eval((second / f"seen{rank}").read_text())
        assert after["pid"] == before["pid"]  # the same process ran both
        assert after["env"] is None and after["cwd"] == before["cwd"]  # put back


@pytest.mark.multiprocess
def test_the_next_task_finds_no_accelerate_state_of_the_last(
    pool: RankPool, tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")
    pool.run(_start_accelerate, 2, (free_port(), str(tmp_path)), 120, "an Accelerator")
    pool.run(_accelerate_state, 2, (str(tmp_path),), 60, "the next task")
    for rank in range(2):
        assert (tmp_path / f"state{rank}").read_text() == "True"  # the first task had one
        assert (tmp_path / f"after{rank}").read_text() == "False"  # the next starts afresh


@pytest.mark.multiprocess
def test_a_failing_rank_fails_the_test_with_its_traceback_and_the_pool_starts_afresh(
    pool: RankPool,
) -> None:
    pool.run(_noop, 2, (), 60, "before")
    started = pool.started
    with pytest.raises(pytest.fail.Exception) as failed:
        pool.run(_fail_on_rank_1, 2, (free_port(),), 60, "the failing pair")
    said = str(failed.value)
    assert "rank 1 failed" in said and "rank 1 fails on purpose" in said, said
    pool.run(_noop, 2, (), 60, "after")
    assert pool.started == started + 2  # the failed pair (rank 0 stuck in a collective) replaced


def _noop(rank: int) -> None:
    pass


@pytest.mark.multiprocess
def test_a_hung_rank_fails_after_its_timeout_with_its_stack(pool: RankPool) -> None:
    pool.run(_noop, 1, (), 60, "warm")  # the rank started: the task's time counts from here
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        pool.run(_hang, 1, (), 3, "the hanging rank")
    assert time.monotonic() - start < 30
    said = str(failed.value)
    assert "did not finish within 3 s" in said and "in _hang" in said, said


def test_a_hung_test_fails_within_its_timeout_with_every_stack(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_hung="""
        import time

        def test_sleeps_forever():
            time.sleep(3600)

        def test_after_it():
            pass
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_inprocess("--timeout=2", "-p", "no:cacheprovider")
    assert time.monotonic() - start < 60
    result.assert_outcomes(failed=1, passed=1)  # the run goes on after the hung test
    result.stdout.fnmatch_lines(["*Timeout*", "*test_sleeps_forever*"])
