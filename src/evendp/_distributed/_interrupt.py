"""Interrupts that stop training between steps: SIGINT and SIGTERM set a flag, never raise.

A ``KeyboardInterrupt`` wherever the signal lands (in backward, the optimizer, a collective)
tears the step, and under torchrun leaves ranks stopped at different points waiting for each
other. While :class:`StopFlag` is active the signals only record themselves; the Trainer
reads the flag between steps, agreed by the ranks through :class:`StopNotice`, so every rank
stops after the same step and saves.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from ._torchrun._nodes import children as _children
from ._torchrun._nodes import die_with_parent

if TYPE_CHECKING:
    import torch.distributed as dist

    from ._stalled import StallWatch

__all__ = [
    "ESCALATE_S",
    "StopFlag",
    "StopNotice",
    "die_with_parent",
    "exit_code",
    "group_store",
    "late_signal",
    "resume_command",
    "run_forwarding_signals",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long ranks may take to stop after a signal before torchrun is told (it then escalates
# to SIGKILL): past the collective timeout, by when a hung rank has ended the others.
ESCALATE_S = 660.0
#: The same before training began: a start-up collective has no timeout yet.
START_ESCALATE_S = 60.0


def _pending(handler: Any) -> int | None:
    """The signal a previous :class:`StopFlag`'s handler caught and nobody acted on yet."""
    signum = getattr(getattr(handler, "__self__", None), "signum", None)
    return signum if isinstance(signum, int) else None


def exit_code(signum: int | None) -> int:
    """The shell's exit code for a run stopped by ``signum`` (0 when none).

    >>> exit_code(signal.SIGINT), exit_code(signal.SIGTERM), exit_code(None)
    (130, 143, 0)
    """
    return 0 if signum is None else 128 + int(signum)


class StopFlag:
    """Catches SIGINT/SIGTERM while active; :attr:`signum` is the first one received.

    Outside the main thread it stays inactive (Python installs no handler there). A second
    SIGINT raises ``KeyboardInterrupt`` at once: the user will not wait for the step.

    >>> import os
    >>> with StopFlag() as flag:
    ...     os.kill(os.getpid(), signal.SIGTERM)
    ...     flag.signum == signal.SIGTERM
    True
    >>> signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back
    True
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def is_set(self) -> bool:
        """Whether a stop was requested on this process."""
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        elif signum == signal.SIGINT:  # Ctrl-C pressed again: the user will not wait
            raise KeyboardInterrupt("SIGINT twice: stopping now, not at a step boundary")

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
                pending = _pending(self._previous[sig])
                if self.signum is None and pending is not None:
                    # A signal during start-up, caught by the command line's flag: this run
                    # stops at its first step boundary instead of never hearing of it.
                    self.signum = pending
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# Every rank runs the same fits in the same order: the n-th fit has the same key everywhere.
_FITS = itertools.count(1)


class StopNotice:
    """The stop request of one ``fit`` across ranks, in the process group's ``store``.

    A rank that received SIGINT or SIGTERM posts "stop after step ``s``" in the store torchrun's
    ranks share (set once: the first poster wins); every rank looks for it after each step, a
    host lookup that never waits for the device. ``s`` is the step in progress when the request
    is seen before one of its backward passes, else the next. In time for all: the poster
    writes before it joins step ``s``'s last gradient collective, which no rank can finish
    before that. Each ``fit`` has its own key: an interrupted run's notice never stops the next.

    >>> import torch.distributed as dist
    >>> notice = StopNotice(dist.HashStore())
    >>> notice.due(step=3) is None
    True
    >>> notice.post(int(signal.SIGTERM), step=3)  # received during step 3: stop after 4
    >>> notice.post(int(signal.SIGINT), step=4)  # a later request changes nothing
    >>> notice.due(step=3), notice.due(step=4) == signal.SIGTERM
    (None, True)
    """

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._key = f"evendp/stop/{next(_FITS)}"
        self._posted = False
        self._notice: tuple[int, int] | None = None  # (stop after step, signal), once read

    def post(self, signum: int, step: int) -> None:
        """This rank received ``signum`` with ``step`` steps done: stop after the next one."""
        if self._posted:
            return
        self._posted = True
        # compare_set: set only when absent, so the first request is every rank's.
        self._store.compare_set(self._key, "", f"{step + 1}:{signum}")

    def due(self, step: int) -> int | None:
        """The agreed signal when every rank stops after ``step`` (steps done), else ``None``."""
        if self._notice is None and self._store.check([self._key]):
            at, signum = self._store.get(self._key).decode().split(":")
            self._notice = (int(at), int(signum))
        if self._notice is not None and step >= self._notice[0]:
            return self._notice[1]
        return None


def group_store() -> dist.Store:
    """The store of the default process group."""
    # A private accessor, stable since torch 1.x; the public API offers none.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def resume_command(argv: Sequence[str], prog: str = "evendp") -> str:
    """The exact command that continues a stopped run: the same one, with ``--resume``.

    >>> resume_command(["train", "--steps", "9", "--out", "my runs/a"])
    "evendp train --steps 9 --out 'my runs/a' --resume"
    >>> resume_command(["train", "--resume-or-start"])
    'evendp train --resume-or-start'
    """
    import shlex

    args = list(argv)
    if "--resume" not in args and "--resume-or-start" not in args:
        args.append("--resume")
    return shlex.join([prog, *args])


def late_signal(signum: int | None, finished: bool, rank: int = 0) -> int | None:
    """The signal that stopped a run, or ``None`` when it came after the last step: the run
    is then finished (exit 0, ``interrupted: false``), and rank 0 says so in one line.

    >>> late_signal(2, finished=False), late_signal(None, finished=True)
    (2, None)
    """
    if signum is None or not finished:
        return signum
    if rank == 0:
        print(
            f"evendp: {signal.Signals(signum).name} came after the last step: the run had "
            "finished and is saved as finished",
            file=sys.stderr,
            flush=True,
        )
    return None


def run_forwarding_signals(
    cmd: Sequence[str],
    env: Mapping[str, str],
    *,
    watch: StallWatch | None = None,
    escalate_s: float = ESCALATE_S,
    training: Callable[[], bool] | None = None,
) -> int:
    """Run ``cmd`` (torchrun, in a session of its own, dying with this process), pass
    SIGINT/SIGTERM/SIGHUP (as SIGTERM) on to its ranks, wait for it; 128 + the signal's
    number when one came, else its exit code.

    Why not let torchrun forward it: torchrun gives its ranks ``--shutdown-timeout`` (30 s)
    to stop, then SIGKILL, and ends in a ``SignalException``. A rank with evendp's stop
    handler gets the signal directly, finishes its step, saves, exits 0 however long the step
    takes. The signal goes to torchrun (which escalates to SIGKILL) when no rank has a handler
    after :data:`_GRACE_S`, on a second Ctrl-C, or once ranks ignored it ``escalate_s``; with
    ``training`` (whether the ranks said training began) before training began, after
    :data:`START_ESCALATE_S`, and ranks still there 5 s later are killed (nothing to save).
    ``watch`` (:class:`~evendp._distributed._stalled.StallWatch`) ends a stalled run.
    """
    process = subprocess.Popen(
        list(cmd), env=dict(env), start_new_session=True, preexec_fn=die_with_parent
    )
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    main = threading.current_thread() is threading.main_thread()
    catch = (*_SIGNALS, signal.SIGHUP)
    previous = {sig: signal.signal(sig, record) for sig in catch} if main else {}
    pending = _pending(previous.get(signal.SIGINT))
    if pending is not None:  # came while this command started up: pass it on now
        received.append(pending)
    try:
        code = _wait_forwarding(process, received, watch, escalate_s, training)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code(received[0]) if received else code


def _wait_forwarding(
    process: subprocess.Popen[bytes],
    received: list[int],
    watch: StallWatch | None,
    escalate_s: float,
    training: Callable[[], bool] | None,
) -> int:
    sent: set[int] = set()
    to_torchrun: float | None = None  # when torchrun was told
    since: float | None = None
    killed = False
    while True:
        try:
            return process.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
        if watch is not None:
            watch.poll(process.pid, _children(process.pid))
        if not received:
            continue
        signum = signal.SIGTERM if received[0] == signal.SIGHUP else received[0]
        since = time.monotonic() if since is None else since
        workers = _children(process.pid)
        ready = [w for w in workers or [] if _catches_sigterm(w)]
        for pid in ready:
            if pid not in sent:
                sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        starting = training is not None and not training()
        waited = time.monotonic() - since
        limit = START_ESCALATE_S if starting else escalate_s
        impatient = len(received) > 1 or (not sent and waited > _GRACE_S) or workers is None
        impatient = impatient or (bool(workers) and waited > limit)  # ignored: escalate
        if impatient and to_torchrun is None:
            to_torchrun = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)
        late = to_torchrun is not None and time.monotonic() - to_torchrun > _KILL_GRACE_S
        if starting and late and workers and not killed:  # stopped, or deaf: nothing to save
            killed = True
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


_GRACE_S = 5.0  # how long a signal waits for the ranks' stop handlers before going to torchrun
_KILL_GRACE_S = 5.0  # at start-up: from telling torchrun to killing the ranks still there


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (evendp's stop flag) installed now."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return False
