"""Interrupts that stop training between steps: SIGINT and SIGTERM set a flag, never raise.

A ``KeyboardInterrupt`` raised wherever the signal lands (inside backward, in the middle of
the optimizer update, while a collective is in flight) leaves a torn step and, under
torchrun, ranks that stop at different points and then wait for each other forever. So while
:class:`StopFlag` is active the two signals only record themselves; the Trainer reads the
flag between steps, under DDP/FSDP2 after the ranks agreed on it in a collective, so every
rank stops after the same step, saves, and returns. The previous handlers come back when the
flag is closed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = ["StopFlag", "exit_code", "run_forwarding_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int | None) -> int:
    """The shell's exit code for a run stopped by ``signum`` (0 when none).

    >>> exit_code(signal.SIGINT), exit_code(signal.SIGTERM), exit_code(None)
    (130, 143, 0)
    """
    return 0 if signum is None else 128 + int(signum)


class StopFlag:
    """Catches SIGINT/SIGTERM while active; :attr:`signum` is the first one received.

    Outside the main thread Python cannot install handlers: the flag then stays inactive and
    the caller keeps the default behaviour (``KeyboardInterrupt``). A second SIGINT raises
    ``KeyboardInterrupt`` at once, for a user who will not wait for the step to end.

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
        self.active = False
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
            self.active = True
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
        self.active = False


def run_forwarding_signals(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` (torchrun) in a session of its own, pass SIGINT/SIGTERM on, wait for it.

    Its own session: a Ctrl-C in the terminal reaches only this process, which forwards it
    once; torchrun then signals its workers once (a second signal would cut torchrun's
    shutdown short). Returns 130/143 when a signal came (the workers saved and stopped),
    else the command's exit code.
    """
    process = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in _SIGNALS} if main else {}
    try:
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code(received[0]) if received else code
