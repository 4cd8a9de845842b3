"""torchrun itself (``torch.distributed.run.main``, same arguments), quiet when a signal ends it.

Run as ``python <this folder> ARGS``, the way ``evendp launch`` starts torchrun. Why not
``python -m torch.distributed.run``: torchrun turns SIGTERM, SIGINT and SIGHUP into a
``SignalException`` that ends in a 30-line traceback. The launcher passes a signal on to the
ranks, not to torchrun, but torchrun still gets one when the launcher dies (``PR_SET_PDEATHSIG``,
even after a SIGKILL) or on a second Ctrl-C. By the time the exception reaches here torchrun has
stopped its ranks; what is left is one line, exit 128 + the signal's number, and, when the
launcher is gone, its outcome folder removed (nobody is left to read it).

Only the standard library and torch are imported: nothing of evendp is on this process's path.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

#: The launcher's outcome file (``evendp._planning._launch.ENV_OUTCOME``; a test keeps them equal).
ENV_OUTCOME = "EVENDP_OUTCOME"
OUTCOME_PREFIX = "evendp-outcome-"


def main(argv: list[str]) -> int:
    """Run torchrun on ``argv``; a signal that stopped it gives one line and ``128 + N``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    launcher = os.getppid()
    try:
        torchrun(argv)
    except SignalException as exc:
        signum = int(exc.sigval)
        orphaned = os.getppid() != launcher  # reparented: the launcher died
        if orphaned:
            remove_outcome_folder(os.environ.get(ENV_OUTCOME))
        why = "its launcher died" if orphaned else "passed on by the launcher"
        name = signal.Signals(signum).name
        print(f"evendp launch: torchrun got {name} ({why}) and stopped every rank", file=sys.stderr)
        return 128 + signum
    return 0


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
