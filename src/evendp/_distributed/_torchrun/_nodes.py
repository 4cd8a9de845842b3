"""The nodes of one run end together: what evendp's torchrun entry point adds to each agent.

torchrun as it is lets a run that lost a node hang for minutes (issue 35):

- a rank whose agent died trains on, unsupervised: every worker gets ``PR_SET_PDEATHSIG``
  (:func:`die_with_parent`), SIGTERM when its agent dies, and evendp's ranks stop after their
  step, saving, as on any SIGTERM (every node's ranks stop at that same step);
- an agent whose ranks ended waits up to 300 s in its exit barrier for the other nodes'
  agents, in C++, where a SIGTERM waits too: under ``evendp train`` (ranks in lockstep end
  within a step of each other) it waits at most :data:`EXIT_WAIT_S`, in Python, and names the
  nodes that did not come (:func:`bound_exit_barrier`);
- an agent on a node other than the store's, whose ranks still run (one stopped with
  ``kill -STOP``, say), never learns that the store's node ended the run: a watch ends this
  node's ranks once the store is gone (:func:`watch_store`).

Only the standard library and torch are imported (the entry point puts nothing of evendp on
its path).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__:  # imported as evendp's
    from ._addresses import listen_on, resolves
else:  # loaded from its path by _quiet (torchrun's agent: nothing of evendp on the path)
    import importlib.util

    _here = Path(__file__).with_name("_addresses.py")
    _spec = importlib.util.spec_from_file_location("_addresses", _here)
    assert _spec is not None and _spec.loader is not None
    _addresses = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_addresses)
    listen_on, resolves = _addresses.listen_on, _addresses.resolves

__all__ = [
    "ENV_EXIT_WAIT",
    "ENV_TELL_WAIT",
    "ENV_TORCHRUN_LOG",
    "EXIT_WAIT_S",
    "STOP_WATCHING",
    "TELL_WAIT_S",
    "TORCHRUN_EXIT_BARRIER_S",
    "bound_exit_barrier",
    "die_with_parent",
    "stop_watching",
    "resolves",
    "tell_node0",
    "tell_other_nodes",
    "tell_wait_s",
    "wait_for_nodes",
    "watch_refusals",
    "watch_store",
    "workers_die_with_agent",
]

#: How long an agent whose ranks ended waits for the other nodes' agents under
#: ``evendp train``, whose ranks end within a step of each other (torchrun's own: 300 s).
EXIT_WAIT_S = 15.0
#: torchrun's own exit barrier's bound (``SimpleElasticAgent``'s ``exit_barrier_timeout``):
#: what a user's script under ``evendp launch`` on several machines keeps.
TORCHRUN_EXIT_BARRIER_S = 300.0
#: The launcher sets it (seconds) for the runs whose exit barrier is bounded.
ENV_EXIT_WAIT = "EVENDP_EXIT_WAIT_S"
#: The file torchrun's log goes to instead of the terminal, in the launcher's private
#: outcome folder (kept beside it when a rank failed).
ENV_TORCHRUN_LOG = "EVENDP_TORCHRUN_LOG"
_EXIT_KEY = "evendp/exit"
_LEFT_KEY = "evendp/left"
_REFUSED_KEY = "evendp/refused"
_WATCH_EVERY_S = 1.0
#: Set when the agent is done: the watches return before the process exits (a thread still
#: inside a store call while the process exits aborts it: SIGABRT).
STOP_WATCHING = threading.Event()
_CONNECT_S = 5.0
_TOLD_KEY = "evendp/told"
#: How long a node that ends the run before its agent starts waits to tell the others.
TELL_WAIT_S = 60.0
#: Seconds instead of :data:`TELL_WAIT_S` (tests).
ENV_TELL_WAIT = "EVENDP_TELL_WAIT_S"


def die_with_parent() -> None:
    """SIGTERM this process when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing). Called in a child before it runs its program, the setting survives
    ``exec``.

    >>> die_with_parent()  # here: SIGTERM when this test's runner ends
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def workers_die_with_agent() -> None:
    """Start torchrun's workers (in this process) with :func:`die_with_parent`: an agent
    killed with SIGKILL leaves no rank training on (a user's script too, not only evendp's).
    torchrun starts them from its main thread, which lives as long as the agent."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    handler: Any = subprocess_handler  # its own name for Popen, replaced below
    started = handler.Popen
    if getattr(started, "_evendp", False):
        return

    def popen(*args: Any, **kwargs: Any) -> Any:
        return started(*args, preexec_fn=die_with_parent, **kwargs)

    popen._evendp = True  # type: ignore[attr-defined]
    handler.Popen = popen


def wait_for_nodes(
    store: Any,
    node: int,
    nodes: int,
    seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    nap: Callable[[float], None] = time.sleep,
) -> list[int]:
    """Say in ``store`` that ``node`` is done, wait up to ``seconds`` for the other ``nodes``
    to say so; the nodes that did not (``[]``: all came, or the store's node closed it, which
    it does only once all came or it stopped waiting). Python sleeps: a signal ends the wait.
    Once all came, each node says it looks no more, and the store's node (0), which closes the
    store when it returns, waits a moment for that: a look at a closed store logs a C++ stack.

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> wait_for_nodes(store, 0, 2, 0.5, nap=lambda s: None)  # node 1 never came
    [1]
    >>> wait_for_nodes(store, 1, 2, 0.5)
    []
    """
    store.set(f"{_EXIT_KEY}/{node}", "1")
    deadline = clock() + seconds
    while True:
        try:
            missing = [n for n in range(nodes) if not store.check([f"{_EXIT_KEY}/{n}"])]
        except RuntimeError:  # DistStoreError and kin: the store's node closed it
            return []
        if missing and clock() < deadline:
            nap(0.2)
            continue
        if missing:
            return missing
        break
    with contextlib.suppress(RuntimeError):
        if node:
            store.set(f"{_LEFT_KEY}/{node}", "1")  # this node's last word to the store
        else:
            _wait_keys(store, [f"{_LEFT_KEY}/{n}" for n in range(1, nodes)], 2.0, clock, nap)
    return []


def _wait_keys(
    store: Any, keys: list[str], seconds: float, clock: Callable[[], float], nap: Any
) -> None:
    """Until every one of ``keys`` is in ``store``, ``seconds`` at most."""
    deadline = clock() + seconds
    while not store.check(keys) and clock() < deadline:
        nap(0.1)


def bound_exit_barrier(seconds: float) -> None:
    """Replace torchrun's exit barrier (up to 300 s, in C++) in this process with
    :func:`wait_for_nodes` for ``seconds``, saying in one line which nodes did not come."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    def exit_barrier(agent: Any) -> None:
        stop_watching()  # this node's ranks ended: nothing left for the watches to end
        group = agent._worker_group
        node, nodes = int(group.group_rank), int(group.group_world_size)
        missing = wait_for_nodes(agent._store, node, nodes, seconds)
        if missing:
            names = ", ".join(map(str, missing))
            print(
                f"evendp launch: node {names} did not end within {seconds:g} s of node {node}, "
                f"whose ranks had ended: lost, or stuck; node {node} exits",
                file=sys.stderr,
                flush=True,
            )

    SimpleElasticAgent._exit_barrier = exit_barrier  # type: ignore[method-assign]


def _workers() -> list[int]:
    """This process's children that are still running (not reaped zombies)."""
    found = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        with contextlib.suppress(OSError):
            for pid in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(pid))
    return found


def _kill(workers: list[int]) -> None:
    """SIGKILL each worker's session (torchrun starts each in its own; a stopped rank ignores
    every other signal)."""
    for pid in workers:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _reachable(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (a bare connection, closed at once: the
    store takes it without a word, where a store client that fails logs a C++ stack)."""
    try:
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
    except OSError:
        return False
    return True


def _client(host: str, port: int) -> Any:
    """A store client of its own, counted in no rendezvous (``wait_for_workers=False``)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=_CONNECT_S)
    return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)


def tell_wait_s() -> float:
    """How long a refusing node waits to tell the others (:data:`ENV_TELL_WAIT`, else
    :data:`TELL_WAIT_S`)."""
    try:
        return max(0.0, float(os.environ.get(ENV_TELL_WAIT, TELL_WAIT_S)))
    except ValueError:
        return TELL_WAIT_S


def _post(client: Any, node: int, line: str, code: int) -> None:
    """Leave ``line`` (how this node ended the run) and its exit code in the store, and mark
    this node as told (node 0 waits for every other node's mark before it closes)."""
    client.set(_REFUSED_KEY, f"{code}\n{line}")
    client.set(f"{_TOLD_KEY}/{node}", "1")


def tell_node0(
    host: str,
    port: int,
    node: int,
    line: str,
    *,
    code: int = 2,
    wait_s: float | None = None,
    waiting: Callable[[], None] = lambda: None,
) -> bool:
    """On node ``node`` > 0, which ends the run before its agent starts (``line`` says how, in
    one line; ``code``: the exit code the others take): leave it in node 0's store, where
    :func:`watch_refusals` reads it, waiting up to ``wait_s`` for node 0 to come up
    (``waiting()`` is called once if it is not up yet); whether it was told.

    >>> tell_node0("127.0.0.1", 1, 1, "node 1 refused the run: no", wait_s=0)  # nothing on 1
    False
    """
    deadline = time.monotonic() + (tell_wait_s() if wait_s is None else wait_s)
    said_waiting = False
    while True:
        if _reachable(host, port):
            with contextlib.suppress(RuntimeError):
                _post(_client(host, port), node, line, code)
                return True
        if time.monotonic() >= deadline:
            return False
        if not said_waiting:
            waiting()
            said_waiting = True
        time.sleep(0.5)


def tell_other_nodes(
    host: str,
    port: int,
    nodes: int,
    line: str,
    *,
    code: int = 2,
    wait_s: float | None = None,
    waiting: Callable[[], None] = lambda: None,
) -> list[int]:
    """On node 0, which ends the run before its agent starts: serve the run's store at
    ``host:port`` (where the other nodes' agents and watches look for it) holding ``line``
    and ``code``, until every other node read it or ``wait_s`` passed (``waiting()`` is
    called once if they have not read it within 2 s); the nodes not told (``[]``: all).

    >>> tell_other_nodes("127.0.0.1", 0, 1, "node 0 refused the run: no")  # no other node
    []
    """
    if nodes <= 1:
        return []
    import datetime

    import torch.distributed as dist

    try:
        server = dist.TCPStore(
            host, port, None, True, datetime.timedelta(seconds=_CONNECT_S),
            wait_for_workers=False, master_listen_fd=listen_on(host, port),
        )  # fmt: skip
    except (OSError, RuntimeError):  # the port is taken (another run), or not this machine's
        return list(range(1, nodes))
    server.set(_REFUSED_KEY, f"{code}\n{line}")
    deadline = time.monotonic() + (tell_wait_s() if wait_s is None else wait_s)
    say_waiting_at: float | None = time.monotonic() + 2.0
    while True:
        missing = [n for n in range(1, nodes) if not server.check([f"{_TOLD_KEY}/{n}"])]
        if not missing or time.monotonic() >= deadline:
            return missing
        if say_waiting_at is not None and time.monotonic() >= say_waiting_at:
            waiting()
            say_waiting_at = None
        time.sleep(0.2)


def watch_refusals(
    host: str,
    port: int,
    node: int = 0,
    *,
    workers: Callable[[], list[int]] = lambda: _workers(),
    end: Callable[[int], Any] = os._exit,
) -> threading.Thread:
    """On every node: a thread that, once another node left word in the store that it ended
    the run before its agent ever came (it refused its command: exit 2; or node 0 found
    nothing to train: exit 0), ends this node's ranks, says so in one line and exits with
    that node's code; this one would otherwise wait for it until torchrun's rendezvous timeout.
    ``workers``: this agent's ranks (its children), ``end``: how it exits (``os._exit``; a
    test hands in its own)."""

    def watch() -> None:
        client = None
        while client is None:  # the store comes up with node 0's agent (or its refusal)
            if STOP_WATCHING.wait(0.5):
                return
            if _reachable(host, port):
                with contextlib.suppress(RuntimeError):
                    client = _client(host, port)
        while True:
            if STOP_WATCHING.wait(0.5):
                return
            try:
                if client.check([_REFUSED_KEY]):
                    said = client.get(_REFUSED_KEY).decode(errors="replace")[:2000]
                    if node:
                        client.set(f"{_TOLD_KEY}/{node}", "1")
                    break
            except RuntimeError:  # the store closed: the run is over
                return
        code, _, line = said.partition("\n")
        _kill(workers())
        stops = "stops" if code.strip() != "0" else "ends"
        print(f"evendp launch: {line}; node {node} {stops} too", file=sys.stderr, flush=True)
        end(int(code) if code.strip().isdigit() else 2)

    thread = threading.Thread(target=watch, name="evendp-refusal-watch", daemon=True)
    thread.start()
    return thread


def stop_watching(timeout: float = 2.0) -> None:
    """End the watches of this process (torchrun returned) and wait for them."""
    STOP_WATCHING.set()
    for thread in threading.enumerate():
        if thread.name in ("evendp-store-watch", "evendp-refusal-watch"):
            thread.join(timeout)


def watch_store(
    host: str,
    port: int,
    node: int,
    *,
    workers: Callable[[], list[int]] = lambda: _workers(),
    end: Callable[[int], Any] = os._exit,
) -> threading.Thread:
    """On a node other than the store's: a thread that, once the store at ``host:port`` is
    gone while this node's ranks still run (two looks in a row), ends them (SIGKILL: a
    stopped rank ignores the rest), says so in one line and exits 1; once the store is gone
    with no rank running, the run is over and it returns (``workers``, ``end``: as above)."""

    def watch() -> None:
        while not _reachable(host, port):  # the store comes up with node 0's agent
            if STOP_WATCHING.wait(_WATCH_EVERY_S):
                return
        misses = 0
        while misses < 2:
            if STOP_WATCHING.wait(_WATCH_EVERY_S):
                return
            misses = 0 if _reachable(host, port) else misses + 1
        running = workers()
        if not running:  # the ranks had ended: the run is over, nothing to stop
            return
        _kill(running)
        print(
            f"evendp launch: the run's store at {host}:{port} (node 0's agent) closed while "
            f"node {node}'s ranks ran: the run ended or was lost there; node {node}'s ranks "
            "were stopped",
            file=sys.stderr,
            flush=True,
        )
        end(1)

    thread = threading.Thread(target=watch, name="evendp-store-watch", daemon=True)
    thread.start()
    return thread
