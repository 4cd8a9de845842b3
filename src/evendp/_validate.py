"""One check for integer arguments, so every ``must be a positive int`` reads the same.

``bool`` is an ``int`` subclass in Python, so ``isinstance(True, int)`` holds; a flag passed
where a count belongs is a mistake, and this check refuses it.
"""

from __future__ import annotations

from typing import Any

from ._errors import EvendpError

__all__ = ["is_int", "validate_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (a flag is never a count).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(minimum: int | None) -> str:
    if minimum == 1:
        return "a positive int"
    if minimum == 0:
        return "a non-negative int"
    if minimum is None:
        return "an int"
    return f"an int >= {minimum}"


def validate_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    allow_none: bool = False,
    example: str | None = None,
) -> Any:
    """Return ``value`` when it is an int (not a bool) of at least ``minimum``.

    ``allow_none`` lets ``None`` through unchanged. Otherwise raises :class:`EvendpError`
    naming ``name``, what was expected and, with ``example``, a value that works.

    >>> validate_int("batch_size", 8, minimum=1)
    8
    >>> validate_int("batch_size", True, minimum=1, example="batch_size=64")
    Traceback (most recent call last):
    ...
    evendp.EvendpError: batch_size must be a positive int, got True; e.g. batch_size=64
    """
    if value is None and allow_none:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        expected = _kind(minimum) + (" or None" if allow_none else "")
        hint = f"; e.g. {example}" if example else ""
        raise EvendpError(f"{name} must be {expected}, got {value!r}{hint}")
    return value
