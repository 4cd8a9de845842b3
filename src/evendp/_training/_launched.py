"""The Trainer under a launcher (``evendp launch``, torchrun): one run of ranks, not one run per
process.

As the HF Trainer and Lightning do, the Trainer starts the default process group itself when
torchrun's variables are set and no group is up (:func:`join_launch`), so a script started
once per rank trains as one run. The group is ended when the script ends normally (at exit,
:func:`~evendp._distributed._group.finish_distributed`); after an exception escaped the script
it is left alone (a barrier would wait for ranks that may never come).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from .._core._errors import EvendpError

__all__ = ["join_launch"]

#: What torchrun (and so ``evendp launch``) sets in every rank it starts.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_failed = False  # an exception escaped the script: no barrier at exit


def join_launch(strategy: str) -> None:
    """Start the default process group when a launcher started this process and none is up,
    so that the Trainer runs ``strategy`` across the launched ranks. A one-process strategy
    (``"dp"``) among several launched ranks is refused: each rank would train alone.

    >>> join_launch("ddp")  # no launcher here: nothing to do
    """
    import torch.distributed as dist

    from .._distributed._group import init_distributed
    from ._strategies import STRATEGIES, rank_strategy_names

    if not all(os.environ.get(name, "").strip() for name in _LAUNCH_VARS):
        return  # no launcher started this process
    try:
        world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise EvendpError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an int; it is torchrun's (the number "
            "of ranks): start the script with evendp launch or torchrun, not with these set by hand"
        ) from None
    if not dist.is_available() or dist.is_initialized():
        return
    if not STRATEGIES[strategy].ranks:
        if world == 1:
            return  # one rank: one process, over its own device_ids
        refused = EvendpError(
            f"strategy={strategy!r} runs one process over device_ids, but a launcher started "
            f"this script as rank {os.environ['RANK']} of {world}; pass a strategy for ranks "
            f"({', '.join(map(repr, rank_strategy_names()))}), e.g. "
            "TrainConfig(strategy='ddp'), or run the script with python alone"
        )
        refused.every_rank = True  # the same script and WORLD_SIZE on every rank
        raise refused
    init_distributed()
    # End the group at exit, unless an exception escaped the script (then the other ranks
    # may never reach the barrier).
    hook = sys.excepthook

    def note_failure(*args: Any) -> None:
        global _failed
        _failed = True
        hook(*args)

    sys.excepthook = note_failure
    atexit.register(_finish)


def _finish() -> None:
    import torch.distributed as dist

    from .._distributed._group import finish_distributed

    if _failed or not (dist.is_available() and dist.is_initialized()):
        return
    finish_distributed()
