"""The exceptions evendp defines, in one place so callers can catch them by type.

(Errors of torch and of the user's own code, ``torch.OutOfMemoryError`` included, pass
through as they are.)

One family, rooted at :class:`EvendpError`::

    EvendpError (ValueError)      bad input: the value, what was expected, the fix   exit 2
    ├── PlanError                 the planner cannot produce a plan                  exit 2
    ├── CheckpointError           a checkpoint or run folder that cannot be used     exit 2
    ├── LiveMemoryError           no live GPU memory to read                         exit 2
    └── TrainingError             a fault while training (non-finite loss, disk)     exit 1
    NvmlUnavailableError (RuntimeError): no NVIDIA driver; callers on CPU carry on.

``EvendpError`` stays a :class:`ValueError` so code that already catches ``ValueError``
around configuration keeps working; raised as itself it always means bad input. Each class
carries ``exit_code``, what the command line exits with when it ends a run.

>>> issubclass(CheckpointError, EvendpError), TrainingError.exit_code, EvendpError.exit_code
(True, 1, 2)
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "EvendpError",
    "LiveMemoryError",
    "NvmlUnavailableError",
    "PlanError",
    "TrainingError",
]


class EvendpError(ValueError):
    """Bad input to evendp: the message names the value, what was expected and the fix.

    It subclasses :class:`ValueError` so code that already catches ``ValueError``
    around configuration keeps working. Its subclasses name the faults that are not a
    typo (see the module docstring); ``exit_code`` is what ``evendp`` exits with.

    >>> raise EvendpError("lr='fast' is not a number; pass a float, e.g. lr=3e-4")
    Traceback (most recent call last):
    ...
    evendp.EvendpError: lr='fast' is not a number; pass a float, e.g. lr=3e-4
    """

    exit_code = 2


class PlanError(EvendpError):
    """The planner could not produce a plan (a batch that fits nowhere, a failing factory)."""


class CheckpointError(EvendpError):
    """A checkpoint or run folder that cannot be used: unreadable, corrupt, foreign to this
    run's configuration, or held by another live run. The message names the file and what
    to do (resume from another one, pass a fresh ``--out``)."""


class LiveMemoryError(EvendpError):
    """No live GPU memory to read. ``reason`` says why; the message adds the fix in Python
    spelling, and the command line replaces it with its own flag (``--memory``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"{reason}; declare each device's memory instead, e.g. memory='24GiB,24GiB,12GiB'"
        )


class TrainingError(EvendpError):
    """A run that cannot go on although its input was fine: the loss or the gradient stayed
    non-finite, a disk filled up or turned read-only while saving. The last good checkpoint
    is intact; the message says where it is and how to resume."""

    exit_code = 1


class NvmlUnavailableError(RuntimeError):
    """NVML could not start: no NVIDIA driver, or the driver is not loaded.

    Not a bad-input error (so not an :class:`EvendpError`): the machine simply has no GPUs
    evendp can see. Callers that can run on CPU catch it and carry on.
    """
