"""The exceptions evendp defines, in one place so callers can catch them by type.

(Errors of torch and of the user's own code, ``torch.OutOfMemoryError`` included, pass
through as they are.)

One family, rooted at :class:`EvendpError`, split by kind: bad input is a :class:`ValueError`,
a fault at run time is not::

    EvendpError                   every error evendp raises (catch this one)
    ├── InputError (ValueError)   bad input: the value, what was expected, the fix   exit 2
    │   ├── PlanError             the planner cannot produce a plan                  exit 2
    │   ├── CheckpointError       a checkpoint or run folder that cannot be used     exit 2
    │   └── LiveMemoryError       no live GPU memory to read                         exit 2
    └── TrainingError             a fault while training (non-finite loss, disk)     exit 1
    NvmlUnavailableError (RuntimeError): no NVIDIA driver; callers on CPU carry on.

``raise EvendpError(message)`` raises an :class:`InputError`, as ``OSError(errno.ENOENT, ...)``
builds a ``FileNotFoundError``. Each class carries ``exit_code``, what the command line exits
with when it ends a run.

>>> issubclass(CheckpointError, InputError), issubclass(TrainingError, ValueError)
(True, False)
>>> type(EvendpError("lr='fast' is not a number")).__name__, TrainingError.exit_code
('InputError', 1)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "EvendpError",
    "InputError",
    "LiveMemoryError",
    "NvmlUnavailableError",
    "PlanError",
    "TrainingError",
]


class EvendpError(Exception):
    """Every error evendp raises: catch it to handle any of them.

    Raised as itself it means bad input, and builds an :class:`InputError` (a
    :class:`ValueError`): the message names the value, what was expected and the fix.
    ``exit_code`` is what ``evendp`` exits with; ``every_rank`` is true where evendp's ranks
    agreed on the error, so that every rank raises it alike (a rank may then end on it
    without leaving another waiting).

    >>> raise EvendpError("lr='fast' is not a number; pass a float, e.g. lr=3e-4")
    Traceback (most recent call last):
    ...
    evendp.InputError: lr='fast' is not a number; pass a float, e.g. lr=3e-4
    """

    exit_code = 2
    every_rank = False

    def __new__(cls, *args: Any, **kwargs: Any) -> EvendpError:
        # The family's root stands for bad input when raised as itself (see the module doc).
        kind = InputError if cls is EvendpError else cls
        return super().__new__(kind, *args, **kwargs)


class InputError(EvendpError, ValueError):
    """Bad input to evendp (exit 2): the message names the value, what was expected and the
    fix. A :class:`ValueError`, so code that catches ``ValueError`` around configuration
    keeps working.

    >>> try:
    ...     raise EvendpError("batch_size=0 is not a batch; pass e.g. batch_size=32")
    ... except ValueError as err:
    ...     isinstance(err, InputError), isinstance(err, EvendpError)
    (True, True)
    """


class PlanError(InputError):
    """The planner could not produce a plan (a batch that fits nowhere, a failing factory)."""


class CheckpointError(InputError):
    """A checkpoint or run folder that cannot be used: unreadable, corrupt, foreign to this
    run's configuration, or held by another live run. The message names the file and what
    to do (resume from another one, pass a fresh ``--out``)."""


class LiveMemoryError(InputError):
    """No live GPU memory to read. ``reason`` says why; the message adds the fix in Python
    spelling, and the command line replaces it with its own flag (``--memory``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"{reason}; declare each device's memory instead, e.g. memory='24GiB,24GiB,12GiB'"
        )

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # Rebuilt from the reason, not the message (pickle, ranks exchanging it): else the
        # fix would be added twice.
        return type(self), (self.reason,)


class TrainingError(EvendpError):
    """A run that cannot go on although its input was fine (exit 1): the loss or the gradient
    stayed non-finite, a disk filled up or turned read-only while saving, a rank stopped
    answering. Not a :class:`ValueError`. The last good checkpoint is intact; the message
    says where it is and how to resume."""

    exit_code = 1


class NvmlUnavailableError(RuntimeError):
    """NVML could not start: no NVIDIA driver, or the driver is not loaded.

    Neither bad input nor a failed run (so not an :class:`EvendpError`): the machine has no GPUs
    evendp can see. Callers that can run on CPU catch it and carry on.
    """
