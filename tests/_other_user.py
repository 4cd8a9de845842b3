"""A second local user for the shared-machine tests: a forked child that becomes another uid.

No account is created: the child calls ``setgid``/``setuid`` to :data:`OTHER_UID`, which needs
no passwd entry, and plants what it is told (folders, links, files) in a folder it reaches
through its working directory (set while it is still root: the test's own folders above it
stay closed to it). Only root can become another user, so the tests that need one are marked
:data:`needs_root` and skipped, with the reason, otherwise.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["OTHER_UID", "as_other", "needs_root", "shared_folder"]

#: Another user: no account of this number exists (the tests need none).
OTHER_UID = 54321

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: only root can run a second user (uid 54321) to plant the files",
)


def shared_folder(tmp_path: Path) -> Path:
    """A folder open to all and sticky (mode 1777, as /tmp), where both users make names."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def as_other(where: Path, act: Callable[[], object]) -> None:
    """Run ``act()`` as :data:`OTHER_UID` in a forked child whose working directory is
    ``where`` (relative paths in ``act`` are there); fails the test when ``act`` raises."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but system calls, then _exit
        code = 1
        try:
            os.chdir(where)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            act()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's actions failed (above)"
