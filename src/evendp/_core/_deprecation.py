"""The release that ends the last defaults still announced as changing (``REMOVAL``), and the
sentinel that tells a keyword not passed from ``None`` (``UNSET``).

evendp is 0.x: a renamed surface is renamed everywhere at once, with no old spelling kept
(``CHANGELOG.md``, "Removed").
"""

from __future__ import annotations

from typing import Any

__all__ = ["REMOVAL", "UNSET"]

#: The release in which the defaults announced as changing take their new values.
REMOVAL = "0.3.0"


class _Unset:
    """Sentinel default of a keyword: tells "not passed" from ``None``."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
