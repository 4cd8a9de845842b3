"""What evendp's torchrun adds to each node's agent (``_torchrun/_nodes.py``), in this process:
a real store, real child processes; only the final ``os._exit`` is handed a recorder.

The same code runs end to end in ``tests/cli/test_train_nodes.py`` (two agents on loopback),
where coverage cannot see it: the agent's process has nothing of evendp on its path.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from evendp._distributed._torchrun import _nodes
from tests._helpers import free_port


@pytest.fixture(autouse=True)
def _watching() -> Any:
    """The watches' stop is process-wide (an agent stops them once, before it exits): each
    test starts with it clear and leaves it so."""
    _nodes.STOP_WATCHING.clear()
    yield
    _nodes.STOP_WATCHING.clear()


def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def _ended() -> tuple[list[int], threading.Event, Any]:
    codes: list[int] = []
    done = threading.Event()

    def end(code: int) -> None:
        codes.append(code)
        done.set()

    return codes, done, end


def test_a_refusal_left_in_the_store_ends_node_0_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = _server()
    codes, done, end = _ended()
    _nodes.watch_refusals("127.0.0.1", server.port, workers=list, end=end)
    line = "node 1 refused the run: --weights has 4 numbers"
    assert _nodes.tell_node0("127.0.0.1", server.port, 1, line, wait_s=0)
    assert done.wait(30) and codes == [2]
    line = capsys.readouterr().err.strip()
    assert (
        line == "evendp launch: node 1 refused the run: --weights has 4 numbers; node 0 stops too"
    )


def test_a_store_that_goes_away_while_a_rank_runs_ends_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The rank is a child of this process in a session of its own, stopped (``kill -STOP``)
    as in the issue: SIGKILL is what ends it."""
    server = _server()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)  # fmt: skip
    try:
        rank.send_signal(signal.SIGSTOP)
        codes, done, end = _ended()
        alive = lambda: [rank.pid] if rank.poll() is None else []  # noqa: E731
        _nodes.watch_store("127.0.0.1", server.port, 1, workers=alive, end=end)
        time.sleep(1.5)  # it found the store and looked once: nothing to do while it answers
        assert not done.is_set()
        del server  # node 0's agent ends: its store closes
        assert done.wait(60) and codes == [1]
        assert rank.wait(10) == -signal.SIGKILL
    finally:
        rank.kill()
        rank.wait()
    said = capsys.readouterr().err
    assert "(node 0's agent) closed while node 1's ranks ran" in said and said.count("\n") == 1


def test_a_store_that_closes_after_the_ranks_ended_is_the_runs_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = _server()
    codes, _, end = _ended()
    watch = _nodes.watch_store("127.0.0.1", server.port, 1, workers=list, end=end)
    time.sleep(1.5)
    del server  # no rank of this node runs: nothing to end, nothing said
    watch.join(30)
    assert not watch.is_alive() and codes == []  # it returned: the run is over
    assert capsys.readouterr().err == ""


def test_the_exit_barrier_waits_its_bound_and_names_the_node_that_did_not_come(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    monkeypatch.setattr(SimpleElasticAgent, "_exit_barrier", SimpleElasticAgent._exit_barrier)
    _nodes.bound_exit_barrier(0.5)
    store = dist.HashStore()
    agent = SimpleNamespace(
        _worker_group=SimpleNamespace(group_rank=0, group_world_size=3), _store=store
    )
    store.set("evendp/exit/2", "1")  # node 2 ended; node 1 never comes
    started = time.monotonic()
    SimpleElasticAgent._exit_barrier(agent)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    said = capsys.readouterr().err
    assert said.startswith("evendp launch: node 1 did not end within 0.5 s of node 0"), said


def test_workers_started_by_torchrun_die_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's own Popen (its subprocess handler's name for it) starts children whose
    parent-death signal is SIGTERM: read back by the child itself."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    monkeypatch.setattr(handler, "Popen", handler.Popen)
    _nodes.workers_die_with_agent()
    _nodes.workers_die_with_agent()  # once is enough: not wrapped twice
    probe = (
        "import ctypes, ctypes.util; libc = ctypes.CDLL(None); s = ctypes.c_int(); "
        "libc.prctl(2, ctypes.byref(s)); print(s.value)"  # PR_GET_PDEATHSIG
    )
    child = handler.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    assert child.communicate(timeout=60)[0].strip() == str(int(signal.SIGTERM))
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert plain.stdout.strip() == "0"  # the control: no parent-death signal of its own


def test_a_host_that_listens_nowhere_is_not_told() -> None:
    waited: list[bool] = []
    told = _nodes.tell_node0(
        "127.0.0.1", free_port(), 1, "no", wait_s=0.6, waiting=lambda: waited.append(True)
    )
    assert not told and waited == [True]  # it said once that it waits, then gave up


def test_a_refusal_before_node_0_is_up_waits_for_it_and_is_read_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 35: node 1 refused before node 0 was up, so node 0 (its store not up yet) would
    wait for node 1 until torchrun's rendezvous timeout. Node 1 now waits for node 0's store
    and leaves its refusal there."""
    port = free_port()
    told: list[bool] = []
    line = "node 1 refused the run: --weights has 4 numbers"
    teller = threading.Thread(
        target=lambda: told.append(_nodes.tell_node0("127.0.0.1", port, 1, line, wait_s=30))
    )
    teller.start()
    time.sleep(1.0)  # node 1 is waiting; node 0's agent comes up now
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    codes, done, end = _ended()
    _nodes.watch_refusals("127.0.0.1", server.port, workers=list, end=end)
    teller.join(30)
    assert told == [True] and done.wait(30) and codes == [2]
    assert capsys.readouterr().err.strip() == f"evendp launch: {line}; node 0 stops too"


@pytest.mark.parametrize(
    ("code", "line", "said"),
    [
        (2, "node 0 refused the run: --weights has 4 numbers", "node 1 stops too"),
        (0, "node 0 found nothing to train (its checkpoint is at --steps)", "node 1 ends too"),
    ],
)
def test_node_0_ending_before_its_agent_tells_a_waiting_node_its_line_and_code(
    code: int, line: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35: node 0 refused (or had nothing to train) while node 1's agent waited for its
    store. Node 0 now serves the store with its line until node 1 read it; node 1's watch
    exits with node 0's code."""
    port = free_port()
    codes, done, end = _ended()
    _nodes.watch_refusals("127.0.0.1", port, 1, workers=list, end=end)  # node 1, waiting
    started = time.monotonic()
    missing = _nodes.tell_other_nodes("127.0.0.1", port, 2, line, code=code, wait_s=30)
    assert missing == [] and time.monotonic() - started < 10
    assert done.wait(10) and codes == [code]
    assert capsys.readouterr().err.strip() == f"evendp launch: {line}; {said}"


def test_node_0_names_the_nodes_that_never_came_to_read_its_refusal() -> None:
    waited: list[bool] = []
    missing = _nodes.tell_other_nodes(
        "127.0.0.1", free_port(), 3, "node 0 refused the run: no", wait_s=2.5,
        waiting=lambda: waited.append(True),
    )  # fmt: skip
    assert missing == [1, 2] and waited == [True]


def test_node_0_keeps_its_store_until_the_others_looked_their_last() -> None:
    """Node 0 closes the store when its agent returns; a node still looking at it then logged
    a C++ stack. Each other node says it looks no more, and node 0 returns after that."""
    store = dist.HashStore()
    answers: dict[int, list[int]] = {}
    node1 = threading.Thread(
        target=lambda: answers.update({1: _nodes.wait_for_nodes(store, 1, 2, 30)})
    )
    node1.start()
    answers[0] = _nodes.wait_for_nodes(store, 0, 2, 30)
    assert store.check(["evendp/left/1"])  # node 1's last word came before node 0 returned
    node1.join(30)
    assert answers == {0: [], 1: []}
