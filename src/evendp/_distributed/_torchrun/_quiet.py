"""torchrun itself (``torch.distributed.run.main``, same arguments), as ``evendp launch`` runs it.

Run as ``python <this folder> ARGS``, with nothing of evendp on the path (only the standard
library and torch are imported). What it adds to torchrun: a signal (the launcher died, or a
second Ctrl-C) or a failed rank ends in one line instead of torchrun's traceback and table;
torchrun's log goes to a private file; its store listens on its own address only
(:func:`serve_store_on_its_address`); and :mod:`._nodes`'s supervision of the other nodes.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__:  # imported as evendp's (doctests, the launcher's tests)
    from . import _nodes
else:  # run from its path (the launcher: nothing of evendp on the path), or by runpy
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_nodes", Path(__file__).with_name("_nodes.py"))
    assert _spec is not None and _spec.loader is not None
    _nodes = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_nodes)

#: The launcher's outcome file (``evendp._planning._launch.ENV_OUTCOME``; a test keeps them equal).
ENV_OUTCOME = "EVENDP_OUTCOME"
OUTCOME_PREFIX = "evendp-outcome-"
#: The ranks' reports of a peer that stopped answering (``evendp._distributed._stalled``).
STALLED_PREFIX = "stalled."
#: torchrun's loggers: their records go to that file, not to the terminal.
_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
)


def main(argv: list[str]) -> int:
    """Run torchrun on ``argv``; a signal that stopped it gives one line and ``128 + N``."""
    serve_store_on_its_address()  # before torchrun's modules take their own TCPStore name
    _nodes.workers_die_with_agent()
    end_with_the_other_nodes(argv, os.environ.get(_nodes.ENV_EXIT_WAIT))
    from torch.distributed.run import main as torchrun

    launcher = os.getppid()
    quiet_on_a_stall(os.environ.get(ENV_OUTCOME))
    log = log_to_file(os.environ.get(_nodes.ENV_TORCHRUN_LOG))
    try:
        return _run(torchrun, argv, log, launcher)
    finally:
        _nodes.stop_watching()


def _run(torchrun: Any, argv: list[str], log: Any, launcher: int) -> int:
    """torchrun on ``argv``: its exit code, a signal or a failed rank said in one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun(argv)
    except ChildFailedError as exc:  # its report: a traceback of torchrun's own and a table
        kept = "" if log is None else f" (its report: {keep_log(log, exc.format_msg())})"
        print(f"evendp launch: {failed_ranks(exc.failures)}{kept}", file=sys.stderr)
        return 1
    except SignalException as exc:
        signum = int(exc.sigval)
        orphaned = os.getppid() != launcher  # reparented: the launcher died
        if orphaned:
            remove_outcome_folder(os.environ.get(ENV_OUTCOME))
        elif _stalled(os.environ.get(ENV_OUTCOME)):
            return 128 + signum  # the launcher ends a stalled run and says so itself
        why = "its launcher died" if orphaned else "passed on by the launcher"
        name = signal.Signals(signum).name
        print(f"evendp launch: torchrun got {name} ({why}) and stopped every rank", file=sys.stderr)
        return 128 + signum
    return 0


def log_to_file(path: str | None) -> Any:
    """Send torchrun's log records to ``path`` (private), not the terminal, where a fault's
    collateral lines would bury evendp's one line; the open file (``None``: no path)."""
    import logging

    if not path:
        return None

    # Created 0600 (the umask can only narrow it): the log is the user's alone, like every
    # file evendp writes for a run; O_NOFOLLOW: never written through a link.
    def private(path: str, flags: int) -> int:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    stream = open(path, "a", encoding="utf-8", buffering=1, opener=private)  # noqa: SIM115
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in _TORCHRUN_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False  # not to torch's own handler on the terminal
        logger.addHandler(handler)
    return stream


def keep_log(log: Any, report: str) -> Path:
    """Add torchrun's ``report`` to its ``log`` and move the log out of the launcher's outcome
    folder (removed at the end) into the private run folder beside it; its new path."""
    log.write(report + "\n")
    log.close()
    here = Path(log.name)
    kept = here.parent.parent / f"torchrun-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    os.replace(here, kept)
    return kept


def quiet_on_a_stall(outcome: str | None) -> None:
    """Leave out torchrun's warning of the SIGTERM the launcher sends a stalled run (the
    launcher says it in its own line)."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not ("death signal" in str(record.msg) and _stalled(outcome))

    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(keep)


def end_with_the_other_nodes(argv: list[str], exit_wait: str | None) -> None:
    """With ``exit_wait`` (the launcher's bound, seconds): bound the exit barrier, and on
    several static nodes, watch the store (nodes > 0) and the other nodes' refusals
    (:mod:`._nodes`)."""
    if not exit_wait:
        return
    from torch.distributed.run import parse_args

    _nodes.bound_exit_barrier(float(exit_wait))
    args = parse_args(argv)
    nnodes = str(args.nnodes)
    several = args.rdzv_backend == "static" and nnodes.isdigit() and int(nnodes) > 1
    if not several:
        return
    node, port = int(args.node_rank), int(args.master_port)
    if node > 0:  # node 0's agent holds the store
        _nodes.watch_store(args.master_addr, port, node)
    _nodes.watch_refusals(args.master_addr, port, node)  # a node that ended it before it began


def failed_ranks(failures: dict[int, Any]) -> str:
    """One line for torchrun's ``ChildFailedError``: which ranks ended how, the first failure
    first (the others are often its victims).

    >>> from types import SimpleNamespace as F
    >>> failed_ranks({1: F(exitcode=1, timestamp=2), 0: F(exitcode=-9, timestamp=1)})
    'rank 0 was killed by SIGKILL, then rank 1 exited with code 1; torchrun stopped the run'
    """
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    said = [f"rank {rank} {_ended(failure.exitcode)}" for rank, failure in ordered]
    return ", then ".join(said) + "; torchrun stopped the run"


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def serve_store_on_its_address() -> None:
    """Make every ``TCPStore`` server this process (torchrun) starts at one of this machine's
    addresses listen on that address alone (``master_listen_fd``).

    Why: torch's server listens on every interface whatever host name it is given, and whoever
    reaches it can write its keys; a one-machine run needs only loopback, a cluster only node
    0's network. A host name of other machines (or none) is left as torch makes it.
    """
    import torch.distributed as dist

    if getattr(dist.TCPStore, "_evendp_bound", False):
        return
    store = bound_store_class(dist.TCPStore)
    dist.TCPStore = store  # type: ignore[misc]
    for name in (
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    ):
        module: Any = sys.modules.get(name)
        if module is not None:  # imported already: its own name for the class too
            module.TCPStore = store


#: ``TCPStore``'s parameters after ``host_name`` and ``port``, in order.
_STORE_ARGS = (
    "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
    "master_listen_fd", "use_libuv",
)  # fmt: skip


def bound_store_class(base: Any) -> Any:
    """``base`` (torch's ``TCPStore``) whose server at this machine's address listens there only.

    >>> import torch.distributed as dist
    >>> Store = bound_store_class(dist.TCPStore)
    >>> server = Store("127.0.0.1", 0, 1, True, wait_for_workers=False)
    >>> server.set("k", "v"); server.get("k"), isinstance(server, dist.TCPStore)
    (b'v', True)
    """

    class BoundTCPStore(base):
        _evendp_bound = True

        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            given = dict(zip(_STORE_ARGS, args, strict=False)) | kwargs
            if given.get("is_master") and given.get("master_listen_fd") is None:
                given["master_listen_fd"] = _nodes.listen_on(host_name, port)
            super().__init__(host_name, port, **given)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    return BoundTCPStore


def _stalled(outcome: str | None) -> bool:
    """Whether a rank reported a stalled peer (in the outcome's folder)."""
    return bool(outcome) and any(Path(str(outcome)).parent.glob(STALLED_PREFIX + "*"))


def remove_outcome_folder(outcome: str | None) -> None:
    """Remove the launcher's private folder of ``outcome`` (only one evendp made).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp(prefix=OUTCOME_PREFIX))
    >>> remove_outcome_folder(str(folder / "outcome.json")); folder.exists()
    False
    >>> remove_outcome_folder("/etc/hostname"); Path("/etc").exists()  # not ours: kept
    True
    """
    if not outcome:
        return
    folder = Path(outcome).parent
    if folder.name.startswith(OUTCOME_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
