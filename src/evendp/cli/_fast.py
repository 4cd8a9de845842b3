"""The ``evendp`` command starts without torch: the package face (which imports torch, 1.6 s
idle) asks :func:`answer_without_torch` first, which answers ``--version``/``--help`` and
makes the face load on first use for the command's other invocations."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

__all__ = ["EarlyStop", "answer_without_torch"]


def _is_evendp_command() -> bool:
    """This process is the ``evendp`` command (not a program that imports evendp)."""
    if sys.argv[0] == "-m":  # runpy imports the package of `python -m NAME` first
        orig = list(getattr(sys, "orig_argv", []))
        return "-m" in orig and orig[orig.index("-m") + 1 : orig.index("-m") + 2] == ["evendp"]
    return Path(sys.argv[0]).name in ("evendp", "evendp.exe")


class EarlyStop:
    """SIGINT/SIGTERM caught while torch loads: kept for the command line's stop flag, which
    reads ``signum`` of the handler it replaces, not a traceback."""

    signum: int | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum


def answer_without_torch() -> bool:
    """Answer ``evendp --version``/``--help`` and exit; catch the signals of ``train`` and
    ``launch`` from now on. Whether this process is the ``evendp`` command."""
    if not _is_evendp_command():
        return False
    from . import KEEP_SIGNALS, is_light, main

    if is_light(sys.argv[1:]):
        sys.exit(main(sys.argv[1:]))
    if (
        sys.argv[1:2]
        and sys.argv[1] in KEEP_SIGNALS
        and threading.current_thread() is threading.main_thread()
    ):
        early = EarlyStop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, early.handle)
    return True
