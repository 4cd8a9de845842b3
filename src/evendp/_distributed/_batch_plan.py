"""One batch plan: how many samples each rank takes per step, what its memory holds, and why.

Decided once (``evendp launch``, the Trainer, ``evendp train --mode ddp``) as a
:class:`BatchPlan`, checked by :func:`validate_batch_plan`, carried to the ranks by
``EVENDP_BATCH_SIZES`` (``"3,5"``, or with memory caps ``"3,5;caps=48,24"``), read by
:meth:`BatchPlan.parse` alone. ``batch_size`` is the global batch, ``batch_sizes`` each
rank's share: given both, they must agree (:func:`global_batch_size`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .._core._defaults import BATCH, NotGiven
from .._core._errors import EvendpError
from .._core._validate import is_int, shown, validate_instance, validate_int
from ._launch_notes import note_sizes_read

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "ENV_BATCH_SIZES",
    "MAX_BATCH",
    "MAX_RANKS",
    "BatchPlan",
    "batch_sizes_from_env",
    "global_batch_size",
    "parse_batch_sizes",
    "validate_batch_plan",
    "validate_batch_sizes_option",
]

#: Set by ``evendp launch``, read by ``batch_sizes_from_env``.
ENV_BATCH_SIZES = "EVENDP_BATCH_SIZES"
CAPS_MARK = ";caps="

#: The most samples one rank takes per step, and the most ranks: past them, a typo that would
#: exhaust the machine (``10**26``).
MAX_BATCH = 1_000_000_000
MAX_RANKS = 1_000_000

Source = Literal["given", "planned for memory", "even", "env"]
SOURCES: tuple[str, ...] = ("given", "planned for memory", "even", "env")


# ---------------------------------------------------------------------------------------------
# The one check


def _validate_sizes(batch_sizes: object, world_size: int | None) -> list[int]:
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise EvendpError(
            f"batch_sizes must be a sequence of non-negative ints (one per rank), got "
            f"{shown(batch_sizes)}; pass e.g. [3, 5], or parse_batch_sizes('3,5')"
        )
    sizes = list(batch_sizes)
    if not sizes:
        raise EvendpError("batch_sizes is empty; pass one non-negative int per rank, e.g. [3, 5]")
    if len(sizes) > MAX_RANKS:
        raise EvendpError(
            f"got {len(sizes)} batch sizes, more ranks than the {MAX_RANKS} evendp plans for; "
            "pass one batch size per rank, e.g. [3, 5]"
        )
    for i, b in enumerate(sizes):
        if is_int(b) and b > MAX_BATCH:
            raise EvendpError(
                f"batch size {shown(b)} for rank {i} is more than {MAX_BATCH} samples per step; "
                "pass the samples this rank takes per step, e.g. [3, 5]"
            )
        if not is_int(b) or b < 0:
            raise EvendpError(
                f"batch size {shown(b)} for rank {i} in {shown(sizes)} is not a non-negative int; "
                "use 0 for a rank that should get no samples"
            )
    if sum(sizes) == 0:
        raise EvendpError(
            f"all batch sizes are zero ({shown(sizes)}); at least one rank needs a positive "
            "batch size"
        )
    if world_size is not None and len(sizes) != world_size:
        raise EvendpError(
            f"got {len(sizes)} batch sizes {shown(sizes)} for world_size={world_size}; "
            f"pass exactly one batch size per rank ({world_size} numbers)"
        )
    return [int(b) for b in sizes]


def _validate_caps(caps: object, world_size: int | None) -> list[int] | None:
    if caps is None:
        return None
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
        raise EvendpError(
            f"caps must be a sequence of non-negative ints (the most samples each rank's memory "
            f"holds), got {shown(caps)}; pass e.g. [48, 24]"
        )
    values = list(caps)
    for i, c in enumerate(values):
        if not is_int(c) or not 0 <= c <= MAX_BATCH:
            raise EvendpError(
                f"cap {shown(c)} for rank {i} is not a non-negative int (at most {MAX_BATCH}); "
                "expected one memory cap (max samples) per rank, e.g. [48, 48, 24]"
            )
    if world_size is not None and len(values) != world_size:
        raise EvendpError(
            f"got {len(values)} caps for {world_size} ranks; give one memory cap per rank"
        )
    return [int(c) for c in values]


def validate_batch_plan(
    batch_sizes: object, caps: object = None, world_size: int | None = None
) -> tuple[list[int], list[int] | None]:
    """``(sizes, caps)`` checked, else :class:`EvendpError` naming the value and the fix.

    One non-negative int per rank, not all zero (``world_size`` of them when given); caps
    (``None``: no bound) one per rank, none below its rank's size.

    >>> validate_batch_plan([3, 5], [48, 24])
    ([3, 5], [48, 24])
    >>> validate_batch_plan([3, 5], [2, 24])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: rank 0 takes 3 samples per step but its memory holds 2 (caps=[2, 24]); ...
    """
    validate_int("world_size", world_size, minimum=1, allow_none=True, example="world_size=2")
    sizes = _validate_sizes(batch_sizes, world_size)
    checked = _validate_caps(caps, len(sizes))
    for i, (n, c) in enumerate(zip(sizes, checked or (), strict=False)):
        if n > c:
            raise EvendpError(
                f"rank {i} takes {n} samples per step but its memory holds {c} (caps="
                f"{shown(checked)}); lower its batch size, or raise its cap"
            )
    return sizes, checked


def validate_batch_sizes_option(batch_sizes: object, name: str = "batch_sizes") -> None:
    """What ``batch_sizes=`` takes: ``None`` (an even split), ``"auto"`` (planned for memory)
    or one size per rank (checked by :func:`validate_batch_plan`).

    >>> validate_batch_sizes_option("auto"), validate_batch_sizes_option([3, 5])
    (None, None)
    """
    if batch_sizes is None or batch_sizes == "auto":
        return
    if isinstance(batch_sizes, str):
        raise EvendpError(
            f"{name} must be a list of ints >= 0 or None, got {shown(batch_sizes)}; expected "
            "'auto' (planned from each rank's memory), a list of per-rank sizes like [3, 5], or "
            "None (an even split)"
        )
    try:
        validate_batch_plan(batch_sizes)
    except EvendpError as err:
        raise EvendpError(f"{name}: {err}") from None


# ---------------------------------------------------------------------------------------------
# batch_size and batch_sizes: one meaning


#: ``TrainConfig.batch_size``'s default: 32 samples per step, told apart from a given 32.
DEFAULT_BATCH_SIZE: int = NotGiven(BATCH)


def global_batch_size(batch_size: int, batch_sizes: object, *, cli: str | None = None) -> int:
    """The global batch per optimizer step, from ``batch_size`` and ``batch_sizes``.

    Given only the shares, their sum; given both, they must agree (else an
    :class:`EvendpError` in the caller's spelling: ``cli``, the sizes' flag beside
    ``--batch``; else ``TrainConfig``'s keywords). ``"auto"`` and ``None`` split ``batch_size``.

    >>> global_batch_size(DEFAULT_BATCH_SIZE, [3, 5]), global_batch_size(8, [3, 5])
    (8, 8)
    >>> global_batch_size(10, [3, 5], cli="--batch-sizes ")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: --batch 10 (the global batch per step) contradicts --batch-sizes 3,5 ...
    >>> global_batch_size(10, [3, 5])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: batch_size=10 (the global batch per step) contradicts batch_sizes=[3, 5] ...
    """
    if batch_sizes is None or isinstance(batch_sizes, str):
        return batch_size
    total = sum(validate_batch_plan(batch_sizes)[0])
    if isinstance(batch_size, NotGiven):
        return NotGiven(total)
    if batch_size == total:
        return batch_size
    if cli is not None:
        sizes = ",".join(map(str, batch_sizes))  # type: ignore[call-overload]
        raise EvendpError(
            f"--batch {batch_size} (the global batch per step) contradicts {cli}{sizes} "
            f"(each rank's share, {total} in all); give --batch {total}, or only one of them"
        )
    raise EvendpError(
        f"batch_size={shown(batch_size)} (the global batch per step) contradicts "
        f"batch_sizes={shown(batch_sizes)} (each rank's share, {total} in all); pass "
        f"batch_size={total}, or drop batch_size (it is then sum(batch_sizes)), or drop "
        "batch_sizes to split batch_size evenly"
    )


# ---------------------------------------------------------------------------------------------
# The plan, its text and its channel


def _ints(part: str, text: str, what: str, example: str) -> list[int]:
    """``"3, 5"`` as ints; a word, or a number Python will not read (5000 digits), is named."""
    pieces = part.split(",")
    if len(pieces) > MAX_RANKS:
        raise EvendpError(
            f"{what} {shown(text)} has {len(pieces)} entries, more ranks than the {MAX_RANKS} "
            f"evendp plans for; expected one per rank, e.g. {example}"
        )
    values: list[int] = []
    for piece in pieces:
        try:
            values.append(int(piece.strip()))
        except ValueError:
            raise EvendpError(
                f"{what} {shown(text)}: {shown(piece.strip())} is not an int; expected "
                f"comma-separated non-negative ints, one per rank, e.g. {example}"
            ) from None
    return values


@dataclass(frozen=True)
class BatchPlan:
    """Each rank's samples per step (``sizes``), the most its memory holds (``caps``,
    ``None``: no bound) and where they came from (``source``); checked when built. ``text``
    is how it travels (``EVENDP_BATCH_SIZES``), :meth:`parse` reads it back.

    >>> plan = BatchPlan((3, 5), caps=(48, 24), source="planned for memory")
    >>> plan.global_batch, plan.text
    (8, '3,5;caps=48,24')
    >>> BatchPlan.parse(plan.text).caps
    (48, 24)
    >>> BatchPlan.even(10, 3).sizes
    (4, 3, 3)
    """

    sizes: tuple[int, ...]
    caps: tuple[int, ...] | None = None
    source: Source = "given"

    def __post_init__(self) -> None:
        sizes, caps = validate_batch_plan(self.sizes, self.caps)
        if self.source not in SOURCES:
            raise EvendpError(f"source={shown(self.source)} is not one of {SOURCES}")
        object.__setattr__(self, "sizes", tuple(sizes))
        object.__setattr__(self, "caps", None if caps is None else tuple(caps))

    @property
    def global_batch(self) -> int:
        """Samples per full step over all ranks."""
        return sum(self.sizes)

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def text(self) -> str:
        """The plan as ``EVENDP_BATCH_SIZES`` carries it."""
        sizes = ",".join(map(str, self.sizes))
        return sizes if self.caps is None else sizes + CAPS_MARK + ",".join(map(str, self.caps))

    def env(self) -> dict[str, str]:
        """The variables that carry the plan to the ranks (one)."""
        return {ENV_BATCH_SIZES: self.text}

    @classmethod
    def of(
        cls,
        sizes: object,
        caps: object = None,
        source: Source = "given",
        world_size: int | None = None,
    ) -> BatchPlan:
        """The plan of any sequences of sizes and caps, checked (``world_size`` of them).

        >>> BatchPlan.of([3, 5], world_size=2)
        BatchPlan(sizes=(3, 5), caps=None, source='given')
        """
        checked, checked_caps = validate_batch_plan(sizes, caps, world_size)
        return cls(tuple(checked), None if checked_caps is None else tuple(checked_caps), source)

    @classmethod
    def even(cls, global_batch: int, world_size: int) -> BatchPlan:
        """``global_batch`` split as evenly as ints allow (the first ranks take one more)."""
        from .._core._split import split_even

        validate_int("global_batch", global_batch, minimum=1, example="global_batch=32")
        validate_int("world_size", world_size, minimum=1, example="world_size=2")
        return cls(tuple(split_even(global_batch, world_size)), source="even")

    @classmethod
    def parse(
        cls, text: object, world_size: int | None = None, *, source: Source = "given"
    ) -> BatchPlan:
        """The plan a text like ``"3,5"`` or ``"3,5;caps=48,24"`` says (the one parser).

        >>> BatchPlan.parse(" 3, 5").sizes
        (3, 5)
        >>> BatchPlan.parse("3,x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        evendp.InputError: batch sizes '3,x': 'x' is not an int; expected ...
        """
        if not isinstance(text, str):
            raise EvendpError(f"batch sizes must be a string like '3,5', got {shown(text)}")
        plan = _parse_text(text)
        return cls.of(plan.sizes, plan.caps, source, world_size)

    @classmethod
    def from_env(
        cls,
        world_size: int | None = None,
        *,
        var: str = ENV_BATCH_SIZES,
        environ: Mapping[str, str] | None = None,
    ) -> BatchPlan | None:
        """The plan the launcher left in ``var`` (``None``: not set), its caps included.
        ``world_size`` defaults to ``WORLD_SIZE``.

        >>> BatchPlan.from_env(environ={"EVENDP_BATCH_SIZES": "3,5;caps=4,8"}).caps
        (4, 8)
        >>> BatchPlan.from_env(environ={}) is None
        True
        """
        validate_int("world_size", world_size, minimum=1, allow_none=True, example="world_size=2")
        validate_instance("var", var, str, "the name of an environment variable")
        validate_instance("environ", environ, Mapping, "a mapping of variables", allow_none=True)
        env = os.environ if environ is None else environ
        if world_size is None and env.get("WORLD_SIZE", "").strip().isdigit():
            world_size = int(env["WORLD_SIZE"])
        text = env.get(var)
        if text is None or not text.strip():
            return None
        try:
            return cls.parse(text, world_size, source="env")
        except EvendpError as err:
            raise EvendpError(f"{var}={shown(text)} is invalid: {err}") from None


@functools.lru_cache(maxsize=16)
def _parse_text(text: str) -> BatchPlan:
    """The plan ``text`` says; once per text in a process (read by several alike)."""
    sizes_text, mark, caps_text = text.partition(CAPS_MARK)
    sizes = _ints(sizes_text, text, "batch sizes", "'3,5'")
    caps = _ints(caps_text, text, "caps in", "'3,5;caps=48,24'") if mark else None
    return BatchPlan.of(sizes, caps)


# ---------------------------------------------------------------------------------------------
# Batch sizes from the command line or the environment


def parse_batch_sizes(text: str, world_size: int | None = None) -> list[int]:
    """Parse ``"3,5,0"`` into ``[3, 5, 0]``, checked like the sampler checks its sizes.

    >>> parse_batch_sizes("3, 5,0")
    [3, 5, 0]
    >>> parse_batch_sizes("3,x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: batch sizes '3,x': 'x' is not an int; expected ...
    """
    return list(BatchPlan.parse(text, world_size).sizes)


def batch_sizes_from_env(
    world_size: int | None = None,
    *,
    var: str = ENV_BATCH_SIZES,
    default: Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[int]:
    """Per-rank batch sizes from ``EVENDP_BATCH_SIZES`` (set by ``evendp launch``).

    Checked against ``world_size``, else torchrun's ``WORLD_SIZE`` when set. ``default``
    (checked) when the variable is absent; without one, that is an error.

    >>> batch_sizes_from_env(environ={"EVENDP_BATCH_SIZES": "3,5"})
    [3, 5]
    >>> batch_sizes_from_env(2, default=[4, 4], environ={})
    [4, 4]
    """
    plan = BatchPlan.from_env(world_size, var=var, environ=environ)
    if plan is None:
        if default is not None:
            env = os.environ if environ is None else environ
            if world_size is None and env.get("WORLD_SIZE", "").strip().isdigit():
                world_size = int(env["WORLD_SIZE"])
            return validate_batch_plan(default, None, world_size)[0]
        raise EvendpError(
            f"environment variable {var} is not set; `evendp launch` sets it, or set it "
            f"yourself to one batch size per rank (e.g. {var}=3,5), or pass the sizes directly"
        )
    if environ is None and var == ENV_BATCH_SIZES:
        note_sizes_read()  # evendp launch warns when no rank read the sizes it set
    return list(plan.sizes)
