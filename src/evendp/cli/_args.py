"""Argument types and the parser class shared by every subcommand.

Each type names the flag, the value it got, what it expects and an example, so a bad value
reads as one line (``evendp train: error: --lr must be a number > 0, got '-1'; e.g. --lr
3e-3``) with exit code 2, never a Python traceback.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from .._core._validate import shown

__all__ = ["CleanParser", "bounded_float", "bounded_int", "plain_text", "say_units"]


class CleanParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit code 2.

    argparse's own form (usage block, then ``error: argument --x: ...``) becomes
    ``PROG: error: MESSAGE; see 'PROG --help'``.
    """

    def format_help(self) -> str:
        """The help page without reStructuredText markup (module docstrings are reused)."""
        return plain_text(super().format_help())

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        # "--steps: --steps must be ..." -> one mention of the flag is enough.
        flag, _, rest = message.partition(": ")
        if rest.startswith(flag.split("/")[-1].strip()):
            message = rest
        print(f"{self.prog}: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)


def plain_text(text: str) -> str:
    """Drop reStructuredText roles and literals from a docstring for a terminal.

    >>> plain_text("``evendp plan`` uses :func:`~evendp.plan` and :class:`Plan`")
    'evendp plan uses evendp.plan and Plan'
    """
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def bounded_int(
    flag: str, minimum: int, maximum: int | None = None, example: int | None = None
) -> Callable[[str], int]:
    """An argparse ``type`` for ints in ``[minimum, maximum]``.

    >>> bounded_int("--steps", 1)("12")
    12
    >>> bounded_int("--steps", 1)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --steps must be an int >= 1, got '0'; e.g. --steps 1
    """
    expect = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
    hint = f"e.g. {flag} {example if example is not None else minimum}"

    def convert(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{flag} must be {expect}, got {shown(text)}; {hint}")
        return value

    convert.__name__ = "int"
    return convert


def bounded_float(
    flag: str, low: float, high: float, example: str, *, low_inclusive: bool = False
) -> Callable[[str], float]:
    """An argparse ``type`` for finite floats in ``(low, high]`` (``[low, high]`` with
    ``low_inclusive``).

    >>> bounded_float("--lr", 0, 10, "3e-3")("1e-3")
    0.001
    >>> bounded_float("--lr", 0, 10, "3e-3")("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --lr must be a number in (0, 10], got '-1'; e.g. --lr 3e-3
    """
    bracket = "[" if low_inclusive else "("
    expect = f"a number in {bracket}{low:g}, {high:g}]"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above and value <= high):
            raise argparse.ArgumentTypeError(
                f"{flag} must be {expect}, got {shown(text)}; e.g. {flag} {example}"
            )
        return value

    convert.__name__ = "float"
    return convert


# A size with a decimal unit: k, M, G, T, alone or with B (KiB/MiB/GiB/TiB are binary).
# The look-behind starts a match only at a number's first character and the number's pattern is
# unambiguous: otherwise a long run of digits is rescanned (quadratic time on a 100 KB value).
_DECIMAL = re.compile(
    r"(?<![0-9.])([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([kmgt]b?)(?![a-z])", re.IGNORECASE
)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def decimal_sizes(text: str) -> list[tuple[str, int]]:
    """The sizes in ``text`` written with a decimal unit, with their bytes.

    >>> decimal_sizes("24G,24GiB,1.5gb")
    [('24G', 24000000000), ('1.5gb', 1500000000)]
    """
    found = []
    for m in _DECIMAL.finditer(text):
        number = float(m.group(1)) * 1000 ** _POWERS[m.group(2)[0].lower()]
        if math.isfinite(number):  # a 400-digit size is refused later, not said here
            found.append((m.group(0), int(number)))
    return found


def say_units(command: str, flag: str, text: str | None) -> None:
    """Say on stderr how sizes with decimal units were read (``24G`` is 24 * 1000**3 bytes,
    22.35 GiB): ``nvidia-smi`` and ``evendp devices`` speak MiB/GiB, so the difference matters.
    """
    if not text:
        return
    found = decimal_sizes(text)
    if not found:
        return
    from .._core._table import format_bytes

    read = ", ".join(f"{word} = {format_bytes(n)}" for word, n in found)
    print(
        f"{command}: {flag} {shown(text)}: decimal units, read as {read} (k, M, G, KB, MB, GB are "
        "powers of 1000; write KiB, MiB, GiB for powers of 1024, nvidia-smi's units)",
        file=sys.stderr,
    )
