"""Byte counts written by people: ``"8GiB"``, ``"500 MB"``, ``"1.5g"``, or a number.

The one reader of memory sizes for every argument that takes one (``memory=``, budgets, the
CUDA context allowance, ``--min-free``).
"""

from __future__ import annotations

import re

from ._errors import EvendpError
from ._validate import shown

#: The largest memory size evendp reads (1 EiB): past it a size is a typo, not a device.
MAX_BYTES = 1 << 60

__all__ = ["parse_bytes"]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
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
