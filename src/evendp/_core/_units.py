"""Byte counts read from people (``"8GiB"``, ``"500 MB"``, ``"1.5g"``, or a number) and
written for them (``"48.0 MiB"``, ``"1.0 KiB"``, ``"24.00 GiB"``).

The one reader of memory sizes for every argument that takes one (``memory=``, budgets, the
CUDA context allowance, ``--min-free``), and the one writer of every memory figure evendp
prints: each in the binary unit that keeps it readable (``nvidia-smi``'s), never a fixed one
(a 1 KiB budget is not "0.00 GiB").
"""

from __future__ import annotations

import re

from ._errors import EvendpError
from ._validate import shown

#: The largest memory size evendp reads (1 EiB): past it a size is a typo, not a device.
MAX_BYTES = 1 << 60

__all__ = ["byte_unit", "format_bytes", "parse_bytes"]


# Decimal "k"/"kb" = 1000, binary "kib" = 1024, and so on up to tera.
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: size
    for power, prefix in enumerate("kmgt", start=1)
    for suffix, size in (("", 1000**power), ("b", 1000**power), ("ib", 1 << 10 * power))
}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a number or a string with a unit (``"8GiB"``, ``"500 MB"``, ``"1.5g"``).

    >>> parse_bytes("8GiB") == 8 << 30
    True
    >>> parse_bytes("1.5 GB")
    1500000000
    >>> parse_bytes(4096)
    4096
    """
    if isinstance(value, bool):
        raise EvendpError(
            f"memory size must be a number of bytes or e.g. '8GiB', got {shown(value)}"
        )
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        text = str(value)
        pattern = r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*"
        match = None if len(text) > 100 else re.fullmatch(pattern, text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise EvendpError(
                f"cannot read memory size {shown(value)}; write bytes or a number with a unit, "
                "e.g. '8GiB', '500MB', '1.5GB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if not 0 <= number * _UNITS[unit] <= MAX_BYTES:  # also NaN and inf
        raise EvendpError(
            f"memory size must be a number of bytes in [0, 1 EiB], got {shown(value)}; e.g. '8GiB'"
        )
    return int(number * _UNITS[unit])


_WRITTEN = (("TiB", 2**40, 2), ("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1))


def byte_unit(n: float) -> tuple[str, int]:
    """The binary unit that writes ``n`` bytes readably, and its size in bytes (a chart's
    axis takes the unit of its largest figure).

    >>> byte_unit(972), byte_unit(48 * 2**20), byte_unit(80 * 2**30)
    (('B', 1), ('MiB', 1048576), ('GiB', 1073741824))
    """
    return next(((u, s) for u, s, _ in _WRITTEN if abs(n) >= s), ("B", 1))


def format_bytes(n: float | None) -> str:
    """Human-readable bytes (binary units, as ``nvidia-smi``); ``None`` is shown as a dash.

    >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(48 * 2**20), format_bytes(None)
    ('1.5 KiB', '3.00 GiB', '48.0 MiB', '-')
    >>> format_bytes(1000), format_bytes(1024), format_bytes(6 * 2**40)
    ('1000 B', '1.0 KiB', '6.00 TiB')
    """
    if n is None:
        return "-"
    unit, scale = byte_unit(n)
    if scale == 1:
        return f"{int(n)} B"
    digits = 2 if scale >= 2**30 else 1
    return f"{n / scale:.{digits}f} {unit}"
