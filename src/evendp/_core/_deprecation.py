"""Renamed arguments: the old spelling keeps working for one release, with a warning.

Every rename is listed in ``CHANGELOG.md`` under "Deprecated", with the release that drops it.
"""

from __future__ import annotations

import warnings
from typing import Any

from ._errors import EvendpError

__all__ = ["REMOVAL", "UNSET", "renamed_argument", "warn_renamed"]

#: The release in which the old spellings deprecated now stop working.
REMOVAL = "0.3.0"


class _Unset:
    """Sentinel default of a deprecated keyword: tells "not passed" from ``None``."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def warn_renamed(old: str, new: str, *, stacklevel: int) -> None:
    """Warn that the spelling ``old`` is deprecated in favour of ``new`` (same meaning).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_renamed("BalancedDataParallel.gather", "gather_output", stacklevel=2)
    >>> print(caught[0].message)
    BalancedDataParallel.gather is deprecated and goes in evendp 0.3.0; use gather_output
    """
    warnings.warn(
        f"{old} is deprecated and goes in evendp {REMOVAL}; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def renamed_argument(
    where: str,
    old: str,
    new: str,
    old_value: Any,
    new_value: Any,
    *,
    default: Any = None,
    stacklevel: int = 3,
) -> Any:
    """The value of a renamed argument: ``new_value``, or ``old_value`` with a warning.

    ``default`` is the new argument's default (passing both spellings is an error);
    ``stacklevel`` 3 points the warning at the caller of the function that calls this.

    >>> renamed_argument("plan", "devices", "memory", UNSET, "24GiB")
    '24GiB'
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed_argument("plan", "devices", "memory", "24GiB", None)
    '24GiB'
    >>> print(caught[0].message)
    plan(devices=...) is deprecated and goes in evendp 0.3.0; use plan(memory=...)
    """
    if old_value is UNSET:
        return new_value
    if new_value is not default:
        raise EvendpError(f"{where}() got both {old}= (its old name) and {new}=; pass only {new}=")
    warn_renamed(f"{where}({old}=...)", f"{where}({new}=...)", stacklevel=stacklevel)
    return old_value
