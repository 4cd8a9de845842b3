"""Argument types and the parser class shared by every subcommand: a bad value is one line
naming the flag, the value, what it expects and an example, with exit code 2."""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._core._validate import shown

__all__ = [
    "CleanParser",
    "bounded_float",
    "add_int",
    "memory_text",
    "say_error",
    "say_units",
    "suggest",
]


class CleanParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE; see 'PROG
    --help'``, exit code 2; a mistyped option or choice gets the closest valid one (as click
    and git do). ``renamed``: an option's old spelling -> its new one, named as for a typo."""

    def __init__(self, *args: Any, renamed: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = dict(renamed or {})

    def format_help(self) -> str:  # module docstrings are reused: no reStructuredText
        return plain_text(super().format_help())

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        # argparse collects a subcommand's unknown options up here, where it would name the
        # top-level parser and its options; answer from the subcommand's parser instead.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(parsed)
            parser.error(parser._unknown(extras))
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> CleanParser:  # the subcommand's parser
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = str(getattr(parsed, action.dest or "", None))
                chosen = action.choices.get(name)
                if isinstance(chosen, CleanParser):
                    return chosen._chosen(parsed)
        return self

    def _unknown(self, extras: list[str]) -> str:  # or argparse's words for a stray value
        options = [word for word in extras if word.startswith("-") and len(word) > 1]
        if not options:
            return f"unrecognized arguments: {' '.join(extras)}"
        valid = [o for o in self._option_string_actions if o.startswith("--")]
        named = []
        for word in options:
            flag = word.split("=", 1)[0]
            close = self.renamed.get(flag) or suggest(flag, valid)
            named.append(flag + (f" (did you mean {close}?)" if close else ""))
        plural = "s" if len(named) > 1 else ""
        return f"unknown option{plural} {', '.join(named)}"

    def error(self, message: str) -> NoReturn:
        message = _with_choice_hint(message.removeprefix("argument "))
        # "--steps: --steps must be ..." -> one mention of the flag is enough.
        flag, _, rest = message.partition(": ")
        if rest.startswith(flag.split("/")[-1].strip()):
            message = rest
        print(f"{self.prog}: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)


#: Set (to anything but 0 or empty) to see the whole stack behind a command's one-line error.
TRACEBACK_ENV = "EVENDP_TRACEBACK"


def say_error(command: str, exc: BaseException) -> None:
    """A command's refusal or fault as one line on stderr (with ``EVENDP_TRACEBACK=1``, the
    whole stack first)."""
    import os
    import traceback

    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{command}: error: {exc}", file=sys.stderr, flush=True)


def suggest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to a mistyped ``word`` (``None``: nothing is close); a prefix
    either way comes first (``--batch-size`` for ``--batch``), then difflib's closest.

    >>> suggest("--batch-size", ["--block-size", "--batch", "--steps"])
    '--batch'
    >>> suggest("--nprocs", ["--nproc", "--nnodes"]), suggest("--zzz", ["--batch"])
    ('--nproc', None)
    >>> suggest("--setps", ["--steps", "--seed"])
    '--steps'
    """
    stem = word.rstrip("s")
    prefixed = [c for c in candidates if len(c) > 3 and (word.startswith(c) or c.startswith(stem))]
    pool = prefixed or list(candidates)
    close = difflib.get_close_matches(word, pool, n=1, cutoff=0.0 if prefixed else 0.6)
    return close[0] if close else None


# argparse's words for a value outside `choices` (a subcommand, --mode, --amp ...).
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def _with_choice_hint(message: str) -> str:
    """argparse's "invalid choice" message with the closest choice added.

    >>> _with_choice_hint("COMMAND: invalid choice: 'tarin' (choose from 'plan', 'train')")
    "COMMAND: invalid choice: 'tarin' (did you mean 'train'? choose from 'plan', 'train')"
    """
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    close = suggest(match.group(1), re.findall(r"'([^']*)'", match.group(2)))
    if close is None:
        return message
    head = message[: match.start()]
    hint = f"did you mean {close!r}? choose from {match.group(2)}"
    return f"{head}invalid choice: {match.group(1)!r} ({hint})"


def memory_text(flag: str) -> Callable[[str], str]:
    """An argparse ``type`` for a memory spec whose every size has a unit (``--memory 24,12``
    is a mistake for GiB, not 24 bytes).

    >>> memory_text("--memory")("24GiB,2x12GiB-1GiB")
    '24GiB,2x12GiB-1GiB'
    >>> memory_text("--memory")("24,12")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --memory '24,12': a memory spec needs units, e.g. ...
    """

    def convert(text: str) -> str:
        # The unit the user wrote elsewhere in the spec (48MiB,48,24MiB), else GiB.
        written = re.search(r"[0-9.]\s*([KMGT]i?B)\b", text, flags=re.IGNORECASE)
        unit = written.group(1) if written else "GiB"
        fixed = ",".join(_with_units(entry, unit) for entry in text.split(","))
        if fixed != text:
            example = fixed if len(fixed) <= 60 else "24GiB,12GiB"  # a long value: a short fix
            raise argparse.ArgumentTypeError(
                f"{flag} {shown(text)}: a memory spec needs units, e.g. {flag} {example} (KiB, "
                "MiB, GiB, TiB are powers of 1024; KB, MB, GB of 1000)"
            )
        return text

    convert.__name__ = "memory spec"
    return convert


# One entry of a memory spec: an optional count prefix "Nx", then sizes joined by "-".
_COUNT = re.compile(r"\s*\d+\s*x\s*(?=[0-9.])")
_BARE = re.compile(r"\s*[0-9]*\.?[0-9]+\s*")


def _with_units(entry: str, unit: str = "GiB") -> str:
    """``entry`` with ``unit`` after each bare number (unchanged when every size has one).

    >>> _with_units("2x24-10"), _with_units("2x24GiB-10GiB"), _with_units("48", "MiB")
    ('2x24GiB-10GiB', '2x24GiB-10GiB', '48MiB')
    """
    count = _COUNT.match(entry)
    head = count.group(0) if count else ""
    sizes = entry[len(head) :].split("-")
    return head + "-".join(s.strip() + unit if _BARE.fullmatch(s) else s for s in sizes)


def plain_text(text: str) -> str:
    """Drop reStructuredText roles and literals from a docstring for a terminal.

    >>> plain_text("``evendp plan`` uses :func:`~evendp.plan` and :class:`Plan`")
    'evendp plan uses evendp.plan and Plan'
    """
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def add_int(
    parser: argparse._ActionsContainer,
    flag: str,
    bounds: tuple[int, int, int],
    default: int | None,
    text: str,
) -> None:
    """Add the int option ``flag``, an int in ``[least, most]`` (``bounds``: least, most, an
    example); its help is ``text`` and the default, unless ``text`` names the default itself.

    >>> p = argparse.ArgumentParser()
    >>> add_int(p, "--steps", (1, 9, 5), None, "optimizer steps")
    >>> p._option_string_actions["--steps"].type("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --steps must be an int in [1, 9], got '0'; e.g. --steps 5
    """
    minimum, maximum, example = bounds

    def convert(given: str) -> int:
        try:
            value = int(given.strip())
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{flag} must be an int in [{minimum}, {maximum}], got {shown(given)}; "
                f"e.g. {flag} {example}"
            )
        return value

    convert.__name__ = "int"
    if default is not None and "(default" not in text:
        text += f" (default {default})"
    parser.add_argument(flag, type=convert, default=default, help=text)


def bounded_float(
    flag: str, low: float, high: float, example: str, *, low_inclusive: bool = False
) -> Callable[[str], float]:
    """An argparse ``type`` for finite floats in ``(low, high]`` (``[low, ...`` with
    ``low_inclusive``)."""
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


def say_units(command: str, flag: str, text: str | None) -> None:
    """Say on stderr how sizes with decimal units were read (``24G`` is 22.35 GiB, and
    ``nvidia-smi`` speaks GiB)."""
    from .._core._units import format_bytes

    read = []
    for m in _DECIMAL.finditer(text or ""):
        number = float(m.group(1)) * 1000 ** _POWERS[m.group(2)[0].lower()]
        if math.isfinite(number):  # a 400-digit size is refused later, not said here
            read.append(f"{m.group(0)} = {format_bytes(int(number))}")
    if not read:
        return
    print(
        f"{command}: {flag} {shown(text)}: decimal units, read as {', '.join(read)} (k, M, G, KB, "
        "MB, GB are powers of 1000; write KiB, MiB, GiB for powers of 1024, nvidia-smi's units)",
        file=sys.stderr,
    )
