"""torchrun as ``evendp launch`` runs it: the folder runs as a program (the code: ``_quiet.py``)."""

from pathlib import Path

__all__ = ["QUIET_TORCHRUN"]

#: ``python QUIET_TORCHRUN ARGS`` is ``python -m torch.distributed.run ARGS``, quiet on a signal;
#: a folder of this package alone, so nothing of evendp is on the path of torchrun and its ranks.
QUIET_TORCHRUN = Path(__file__).resolve().parent
