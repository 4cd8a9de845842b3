"""A rank that stops answering ends the run: the collectives' timeout, and what follows.

torch gives a collective a timeout (gloo's default: 30 minutes) and torchrun restarts ranks
that exit non-zero; neither says which rank went silent. So the Trainer gives every group
(DeepSpeed's too) ``comm_timeout`` once all ranks reached the training loop; when it fires,
each rank still answering raises :class:`RankStalled` without saving and leaves a report for
the launcher (:func:`report_stalled`), whose :class:`StallWatch` stops torchrun (no restart),
kills the silent ranks (a stopped one ignores SIGTERM) and names them in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from .._core._defaults import COMM_TIMEOUT_S
from .._core._defaults import MIN_COMM_TIMEOUT_S as _MIN_COMM_TIMEOUT_S
from .._core._errors import TrainingError

if TYPE_CHECKING:  # the launcher's StallWatch runs without torch
    import torch.distributed as dist

__all__ = [
    "DEFAULT_COMM_TIMEOUT_S",
    "MIN_COMM_TIMEOUT_S",
    "RankStalled",
    "StallWatch",
    "is_comm_failure",
    "peer_lost",
    "report_stalled",
    "set_comm_timeout",
]

#: The default collective timeout, in seconds (NCCL's own default; gloo's is 30 minutes).
DEFAULT_COMM_TIMEOUT_S = COMM_TIMEOUT_S
#: The shortest one the command line takes: shorter ones fire on a slow checkpoint save.
MIN_COMM_TIMEOUT_S = _MIN_COMM_TIMEOUT_S
#: The reports' names in the outcome folder (``evendp._distributed._torchrun`` reads them).
REPORT_PREFIX = "stalled."
_REPORT_GRACE_S = 5.0  # after the first report: the other answering ranks report too
_KILL_GRACE_S = 5.0  # between the SIGTERM and the SIGKILL of a rank that did not report


class RankStalled(TrainingError):
    """A collective waited past the timeout: another rank stopped answering (exit 1)."""

    @classmethod
    def of(
        cls, error: BaseException, rank: int, timeout: float | None, out_dir: object
    ) -> RankStalled:
        """What rank ``rank`` says when a collective (``error``) waited past ``timeout``.

        >>> print(RankStalled.of(RuntimeError("Timed out waiting 20000ms"), 1, 20.0, None))
        rank 1: another rank stopped answering (a collective waited past comm_timeout=20.0: \
Timed out waiting 20000ms); stopped without saving
        """
        said = str(error).strip().splitlines()[-1][-160:] if str(error).strip() else ""
        where = f"; the last good checkpoint is in {str(out_dir)!r}" if out_dir is not None else ""
        return cls(
            f"rank {rank}: another rank stopped answering (a collective waited past "
            f"comm_timeout={timeout}: {said}); stopped without saving{where}"
        )


# What gloo (and NCCL's watchdog) say when a collective waited past its timeout. Not a peer
# that died: torchrun sees that itself and restarts under --max-restarts.
_FAILURES = (
    "timed out waiting",
    "timeout caused pair closure",
    "watchdog caught collective operation timeout",
)


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that waited past its timeout (gloo, NCCL).

    >>> is_comm_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 20000ms for "
    ...                              "recv operation to complete"))
    True
    >>> is_comm_failure(RuntimeError("CUDA error: out of memory"))
    False
    >>> is_comm_failure(RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:1"))
    False
    """
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(f in text for f in _FAILURES)


# What gloo says when the other end of a connection went away (its process died or closed).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe")


def peer_lost(error: BaseException) -> str | None:
    """How gloo said that the other end of a collective went away, else ``None``.

    >>> peer_lost(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by "
    ...                        "peer. This is typically caused by a remote worker hanging"))
    'connection reset by peer'
    >>> peer_lost(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
    """
    text = str(error).lower()
    found = [f for f in _PEER_LOST if f in text] if isinstance(error, RuntimeError) else []
    return found[0] if found else None


def set_comm_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> None:
    """Give ``group`` (``None``: every group of this rank's, DeepSpeed's own too) a
    collective timeout of ``seconds``.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> set_comm_timeout(30)
    >>> dist.destroy_process_group()
    """
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout, _world

    groups = [group] if group is not None else list(_world.pg_map)
    for each in groups:
        if each is not None and not _rank_not_in_group(each):
            _set_pg_timeout(timedelta(seconds=seconds), each)


def report_stalled(outcome: str | None, rank: int) -> bool:
    """Under a launcher (``outcome``: its outcome file) leave this rank's report of a stalled
    peer; False outside one.

    >>> report_stalled(None, 0)
    False
    """
    from ._run_files import open_private

    if not outcome:
        return False
    path = Path(outcome).parent / f"{REPORT_PREFIX}{int(rank)}"
    os.close(open_private(path, os.O_WRONLY | os.O_CREAT))
    return True


def _reported(folder: Path) -> set[int]:
    found = set()
    for path in folder.glob(f"{REPORT_PREFIX}*"):
        with contextlib.suppress(ValueError):
            found.add(int(path.name[len(REPORT_PREFIX) :]))
    return found


def _rank_of(pid: int) -> int | None:
    """The ``RANK`` torchrun gave worker ``pid`` (Linux ``/proc``; ``None``: unknown)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            with contextlib.suppress(ValueError):
                return int(entry[5:])
    return None


class StallWatch:
    """The launcher's side, polled while it waits for torchrun: once ranks reported a
    stalled peer it ends the run in steps; :meth:`line` says which rank stopped answering."""

    def __init__(self, folder: Path, world: int | None = None, per_node: int | None = 1) -> None:
        self.folder = folder
        self.world = world  # the run's ranks, when known: names another node that went silent
        self.per_node = per_node  # None: nodes of other sizes (a rank's node is not known)
        self.first: float | None = None  # when the first report came
        self.stopped: float | None = None  # when torchrun and the silent ranks got SIGTERM
        self.killed = False
        self.silent: list[int] = []  # the ranks that did not report
        self.reported: set[int] = set()

    @property
    def fired(self) -> bool:
        """Whether a rank reported a peer that stopped answering."""
        return self.first is not None

    def poll(self, torchrun: int, workers: list[int] | None) -> None:
        """One look at the reports; act on them when their time has come."""
        now = time.monotonic()
        if self.first is None:
            self.reported = _reported(self.folder)
            if self.reported:
                self.first = now
            return
        if self.stopped is None and now - self.first >= _REPORT_GRACE_S:
            self.reported = _reported(self.folder)
            ranks = {pid: _rank_of(pid) for pid in workers or []}
            silent = {pid: r for pid, r in ranks.items() if r not in self.reported}
            self.silent = sorted(r for r in silent.values() if r is not None)
            self._signal(torchrun, signal.SIGTERM)  # stops its ranks; no restart of this run
            for pid in silent:
                self._signal(pid, signal.SIGTERM)
            self.stopped = now
        elif self.stopped is not None and not self.killed and now - self.stopped >= _KILL_GRACE_S:
            for pid in workers or []:  # still there: stopped, or ignoring SIGTERM
                self._signal(pid, signal.SIGKILL)
            self.killed = True

    @staticmethod
    def _signal(pid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)

    def line(self, timeout: float | None = None) -> str:
        """The one line the launcher prints after a stall."""
        remote = sorted(set(range(self.world or 0)) - self.reported - set(self.silent))
        if self.silent:
            who = "rank " + ", ".join(map(str, self.silent))
        elif remote and self.per_node is None:  # nodes of other sizes: name the ranks
            who = "rank " + ", ".join(map(str, remote)) + " (on another node)"
        elif remote and self.per_node:  # another node's reports are on it: name the node
            nodes = sorted({r // self.per_node for r in remote})
            who = "a rank on node " + ", ".join(map(str, nodes))
        else:
            who = "a rank on another node (or one that left no trace)"
        waited = f" for {timeout:g} s" if timeout is not None else ""
        heard = ", ".join(map(str, sorted(self.reported)))
        return (
            f"{who} stopped answering: rank {heard} waited{waited} in a collective "
            "(--comm-timeout); every rank was stopped without saving, the last good "
            "checkpoint is intact"
        )
