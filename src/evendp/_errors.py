"""The exceptions evendp raises, in one place so callers can catch them by type."""

from __future__ import annotations

__all__ = ["EvendpError", "NvmlUnavailableError", "PlanError"]


class EvendpError(ValueError):
    """Bad input to evendp: the message names the value, what was expected and the fix.

    It subclasses :class:`ValueError` so code that already catches ``ValueError``
    around configuration keeps working.
    """


class PlanError(EvendpError):
    """The planner could not produce a plan (a batch that fits nowhere, a failing factory)."""


class NvmlUnavailableError(RuntimeError):
    """NVML could not start: no NVIDIA driver, or the driver is not loaded.

    Not a bad-input error (so not an :class:`EvendpError`): the machine simply has no GPUs
    evendp can see. Callers that can run on CPU catch it and carry on.
    """
