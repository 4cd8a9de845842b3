"""A bad value as an error message echoes it: cut short (standard library only, so the CLI's
parsers can use it before torch is imported: ``evendp --help`` stays light)."""

from __future__ import annotations

from typing import Any

__all__ = ["SHOWN_CHARS", "shown"]

#: How much of a bad value an error message echoes: a 400 KB value must not fill the terminal.
SHOWN_CHARS = 100


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to about ``limit`` characters with the full length said.

    >>> shown("24GiB")
    "'24GiB'"
    >>> shown("x" * 400_000, limit=20)
    "'xxxxxxxx...' (400000 characters)"
    """
    text = value if isinstance(value, str) else None
    if text is not None and len(text) > limit:
        return f"{text[: limit - 12]!r}"[:-1] + f"...' ({len(text)} characters)"
    full = repr(value)
    return full if len(full) <= limit else f"{full[: limit - 3]}... ({len(full)} characters)"
