"""The nodes of one run end together: what evendp's torchrun adds to each agent (issue 35).

What torchrun lacks, each of which let a run that lost a node hang for minutes: its workers
do not die with their agent (:func:`workers_die_with_agent`); its exit barrier waits 300 s in
C++, deaf to SIGTERM, and names nobody (:func:`bound_exit_barrier`); an agent whose ranks
run never learns that the store's node ended the run (:func:`watch_store`), nor that another
node refused it before its agent started (:func:`watch_refusals`, :func:`tell_node0`,
:func:`tell_other_nodes`). Only the standard library and torch are imported.
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
    "children",
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

#: An agent's wait for the other nodes under ``evendp train`` (ranks end within a step).
EXIT_WAIT_S = 15.0
#: torchrun's own bound (``exit_barrier_timeout``): a user's script keeps it.
TORCHRUN_EXIT_BARRIER_S = 300.0
#: The launcher sets it (seconds) for the runs whose exit barrier is bounded.
ENV_EXIT_WAIT = "EVENDP_EXIT_WAIT_S"
#: The file torchrun's log goes to instead of the terminal (the launcher's private folder).
ENV_TORCHRUN_LOG = "EVENDP_TORCHRUN_LOG"
_EXIT_KEY = "evendp/exit"
_LEFT_KEY = "evendp/left"
_REFUSED_KEY = "evendp/refused"
_WATCH_EVERY_S = 1.0
#: Set when the agent is done: a watch still in a store call at exit aborts it (SIGABRT).
STOP_WATCHING = threading.Event()
_CONNECT_S = 5.0
_TOLD_KEY = "evendp/told"
#: How long a node that ends the run before its agent starts waits to tell the others.
TELL_WAIT_S = 60.0
ENV_TELL_WAIT = "EVENDP_TELL_WAIT_S"


def die_with_parent() -> None:
    """SIGTERM this process when the thread that started it ends, at once if it has ended
    (Linux ``PR_SET_PDEATHSIG``, kept across ``exec``; elsewhere nothing): a rank whose
    torchrun was killed stops after its step, saving, instead of training on unsupervised.

    >>> die_with_parent()  # here: SIGTERM when this test's runner ends
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the call: act now
        os.kill(os.getpid(), signal.SIGTERM)


def workers_die_with_agent() -> None:
    """Start torchrun's workers (from its main thread, in this process) with
    :func:`die_with_parent`: a SIGKILLed agent leaves no rank of any script training on."""
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
    """Say in ``store`` that ``node`` is done, wait up to ``seconds`` (in Python: a signal
    ends it) for the other ``nodes``; those that did not come (``[]``: all, or the store
    closed). Then node 0, which closes the store, waits a moment for the others' last look:
    a look at a closed store logs a C++ stack.

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> wait_for_nodes(store, 0, 2, 0.5, nap=lambda s: None)  # node 1 never came
    [1]
    >>> wait_for_nodes(store, 1, 2, 0.5)
    []
    """
    store.set(f"{_EXIT_KEY}/{node}", "1")
    deadline = clock() + seconds
    try:
        while missing := [n for n in range(nodes) if not store.check([f"{_EXIT_KEY}/{n}"])]:
            if clock() >= deadline:
                return missing
            nap(0.2)
    except RuntimeError:  # DistStoreError and kin: the store's node closed it
        return []
    with contextlib.suppress(RuntimeError):
        if node:
            store.set(f"{_LEFT_KEY}/{node}", "1")  # this node's last word to the store
        else:  # up to 2 s for every other node's last word
            left = [f"{_LEFT_KEY}/{n}" for n in range(1, nodes)]
            deadline = clock() + 2.0
            while not store.check(left) and clock() < deadline:
                nap(0.1)
    return []


def bound_exit_barrier(seconds: float) -> None:
    """torchrun's exit barrier as :func:`wait_for_nodes` for ``seconds``, naming in one line
    the nodes that did not come (torchrun's, in C++, races node 0 closing the store)."""
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


def children(pid: int) -> list[int] | None:
    """The running (not zombie) children of ``pid`` (Linux ``/proc``; ``None``: unknown).

    >>> children(-1) is None
    True
    """
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    found = []
    for task in tasks:
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(child))
    return found


def _kill(workers: list[int]) -> None:
    """SIGKILL each worker's session (its own, torchrun's doing; a stopped rank ignores the
    rest)."""
    for pid in workers:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _reachable(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (a bare connection: a store client that
    fails logs a C++ stack)."""
    try:
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
    except OSError:
        return False
    return True


def _client(host: str, port: int, listen_fd: int | None = None) -> Any:
    """A store client of its own, counted in no rendezvous (``wait_for_workers=False``); given
    ``listen_fd``, the store's server on that socket."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=_CONNECT_S)
    server = listen_fd is not None
    return dist.TCPStore(
        host, port, None, server, timeout, wait_for_workers=False, master_listen_fd=listen_fd
    )


def tell_wait_s() -> float:
    """:data:`ENV_TELL_WAIT` (tests), else :data:`TELL_WAIT_S`."""
    try:
        return max(0.0, float(os.environ.get(ENV_TELL_WAIT, TELL_WAIT_S)))
    except ValueError:
        return TELL_WAIT_S


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
    """On node ``node`` > 0, which ends the run before its agent starts: leave ``line`` and
    ``code`` in node 0's store for :func:`watch_refusals`, waiting up to ``wait_s`` for it
    (``waiting()`` once, if it is not up yet); whether it was told.

    >>> tell_node0("127.0.0.1", 1, 1, "node 1 refused the run: no", wait_s=0)  # nothing on 1
    False
    """
    deadline = time.monotonic() + (tell_wait_s() if wait_s is None else wait_s)
    said_waiting = False
    while True:
        if _reachable(host, port):
            with contextlib.suppress(RuntimeError):
                client = _client(host, port)
                client.set(_REFUSED_KEY, f"{code}\n{line}")
                client.set(f"{_TOLD_KEY}/{node}", "1")  # node 0 waits for it before it closes
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
    ``host:port`` holding ``line`` and ``code`` until every other node read it or ``wait_s``
    passed (``waiting()`` once, after 2 s); the nodes not told (``[]``: all).

    >>> tell_other_nodes("127.0.0.1", 0, 1, "node 0 refused the run: no")  # no other node
    []
    """
    if nodes <= 1:
        return []
    try:
        server = _client(host, port, listen_on(host, port))
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
    workers: Callable[[], list[int]] = lambda: children(os.getpid()) or [],
    end: Callable[[int], Any] = os._exit,
) -> threading.Thread:
    """On every node: a thread that, once another node left word in the store that it ended
    the run before its agent came (a refusal: exit 2; nothing to train: exit 0), ends this
    node's ranks, says so in one line and exits with that code (else torchrun waits for the
    rendezvous timeout). ``workers``: this agent's ranks, ``end``: how it exits (tests)."""

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
    workers: Callable[[], list[int]] = lambda: children(os.getpid()) or [],
    end: Callable[[int], Any] = os._exit,
) -> threading.Thread:
    """On a node other than the store's: a thread that, once the store at ``host:port`` is
    gone (two looks in a row) while this node's ranks run, kills them, says so in one line
    and exits 1; with no rank running the run is over (``workers``, ``end``: as above)."""

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
