"""The checks at evendp's boundary, one meaning each, so every refusal reads the same:
``NAME must be WHAT IT TAKES, got VALUE; e.g. A VALUE THAT WORKS`` (an :class:`EvendpError`),
the bad value echoed cut short (:func:`shown`). Standard library only, so the CLI's parsers
use it before torch is imported (``evendp --help`` stays light).

``bool`` is an ``int`` subclass in Python, so ``isinstance(True, int)`` holds; a flag passed
where a count belongs is a mistake, and this check refuses it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import EvendpError

if TYPE_CHECKING:  # torch loads where a check needs it: the command line's launchers do not
    import torch

__all__ = [
    "is_int",
    "json_data",
    "shown",
    "validate_bool",
    "validate_callable",
    "validate_choice",
    "validate_count",
    "validate_device",
    "validate_float",
    "validate_instance",
    "validate_int",
    "validate_numbers",
    "validate_path",
    "validate_sequence",
]


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


#: How deep a JSON document evendp reads may nest (a DeepSpeed config nests 3 or 4 levels).
JSON_DEPTH = 32


def json_data(text: str | bytes) -> Any:
    """``text`` parsed as JSON nested at most :data:`JSON_DEPTH` levels; a ``ValueError``
    (``json.JSONDecodeError`` for bad syntax) otherwise, never a ``RecursionError``.

    >>> json_data('{"a": [1, 2]}')
    {'a': [1, 2]}
    >>> json_data("[" * 40 + "]" * 40)
    Traceback (most recent call last):
    ...
    ValueError: nested deeper than 32 levels
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {JSON_DEPTH} levels") from None
    level, todo = 0, [data]
    while todo:  # breadth-first, one level at a time: no recursion of our own either
        level += 1
        if level > JSON_DEPTH:
            raise ValueError(f"nested deeper than {JSON_DEPTH} levels")
        todo = [
            child
            for item in todo
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
    return data


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (a flag is never a count).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


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

    >>> validate_int("batch_size", True, minimum=1, example="batch_size=64")
    Traceback (most recent call last):
    ...
    evendp.InputError: batch_size must be a positive int, got True; e.g. batch_size=64
    """
    if value is None and allow_none:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        kinds = {1: "a positive int", 0: "a non-negative int", None: "an int"}
        expected = kinds.get(minimum, f"an int >= {minimum}") + (" or None" if allow_none else "")
        hint = f"; e.g. {example}" if example else ""
        raise EvendpError(f"{name} must be {expected}, got {value!r}{hint}")
    return value


def _fail(
    name: str, expected: str, value: Any, example: str | None, allow_none: bool = False
) -> EvendpError:
    expected += " or None" if allow_none else ""
    hint = f"; e.g. {example}" if example else ""
    shown = repr(value) if len(repr(value)) <= 80 else f"a {type(value).__name__}"
    return EvendpError(f"{name} must be {expected}, got {shown}{hint}")


def validate_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    positive: bool = False,
    allow_none: bool = False,
    example: str | None = None,
) -> Any:
    """Return ``value`` when it is a finite real number (not a bool, not a string), at least
    ``minimum`` and, with ``positive``, above 0. NaN and infinity are refused: a NaN limit
    compares false with everything, so it would silently switch a check off.

    >>> validate_float("grad_clip", float("nan"), positive=True, example="grad_clip=1.0")
    Traceback (most recent call last):
    ...
    evendp.InputError: grad_clip must be a finite number > 0, got nan; e.g. grad_clip=1.0
    """
    if value is None and allow_none:
        return None
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (minimum is None or float(value) >= minimum)
        and (not positive or float(value) > 0)
    )
    if not ok:
        bound = " > 0" if positive else (f" >= {minimum:g}" if minimum is not None else "")
        raise _fail(name, f"a finite number{bound}", value, example, allow_none)
    return value


def validate_bool(name: str, value: Any) -> bool:
    """Return ``value`` when it is ``True`` or ``False``: a flag, not a truthy object.

    >>> validate_bool("resume", "no")
    Traceback (most recent call last):
    ...
    evendp.InputError: resume must be True or False, got 'no'
    """
    if not isinstance(value, bool):
        raise _fail(name, "True or False", value, None)
    return value


def validate_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """Return ``value`` when it is one of ``choices``.

    >>> validate_choice("amp", "fp8", ("none", "bf16", "fp16"))
    Traceback (most recent call last):
    ...
    evendp.InputError: amp must be one of ('none', 'bf16', 'fp16'), got 'fp8'
    """
    if not isinstance(value, Hashable) or value not in choices:
        raise _fail(name, f"one of {choices}", value, None)
    return value


def validate_callable(name: str, value: Any, what: str, *, allow_none: bool = False) -> Any:
    """Return ``value`` when it can be called; ``what`` says what it is called with.

    >>> validate_callable("loss_fn", "mse", "a function (model, batch) -> loss")
    Traceback (most recent call last):
    ...
    evendp.InputError: loss_fn must be a function (model, batch) -> loss, got 'mse'
    """
    if value is None and allow_none:
        return None
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    if (
        not callable(value)
        or isinstance(value, type)
        or (torch and isinstance(value, torch.Tensor))
    ):
        raise _fail(name, what, value, None, allow_none)
    return value


def validate_instance(
    name: str, value: Any, kind: type | tuple[type, ...], what: str, *, allow_none: bool = False
) -> Any:
    """Return ``value`` when it is a ``kind``; ``what`` names the kind for people.

    >>> import torch
    >>> validate_instance("model", None, torch.nn.Module, "an nn.Module")
    Traceback (most recent call last):
    ...
    evendp.InputError: model must be an nn.Module, got None
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, kind):
        raise _fail(name, what, value, None, allow_none)
    return value


#: The longest path, and path component, Linux takes (bytes): longer ones fail only when used.
_PATH_MAX, _NAME_MAX = 4096, 255


def validate_path(name: str, value: Any, *, allow_none: bool = False) -> Any:
    """Return ``value`` when it is a path: a non-empty ``str`` or an ``os.PathLike``, UTF-8
    text, no name in it longer than 255 bytes (what a file system takes).

    >>> validate_path("out_dir", 123)
    Traceback (most recent call last):
    ...
    evendp.InputError: out_dir must be a path (str or pathlib.Path), got 123
    >>> validate_path("--out", "runs/" + "a" * 300)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: --out must be a path whose names are at most 255 bytes (4096 in all), ...
    """
    if value is None and allow_none:
        return None
    if not (isinstance(value, os.PathLike) or (isinstance(value, str) and value)):
        raise _fail(name, "a path (str or pathlib.Path)", value, None, allow_none)
    text = os.fspath(value)
    if isinstance(text, str):  # bytes paths are the OS's own: nothing to encode
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise EvendpError(
                f"{name} must be a path in UTF-8 text, got {shown(text)}; rename it"
            ) from None
        longest = max(len(part.encode()) for part in text.split(os.sep))
        if longest > _NAME_MAX or len(text.encode()) > _PATH_MAX:
            raise EvendpError(
                f"{name} must be a path whose names are at most {_NAME_MAX} bytes ({_PATH_MAX} "
                f"in all), got {shown(text)}; give a shorter one"
            )
    return value


def validate_numbers(
    name: str,
    value: Any,
    *,
    integral: bool = False,
    allow_none: bool = False,
    example: str | None = None,
) -> Any:
    """Return ``value`` when it is a sequence (not a string) of finite numbers >= 0; with
    ``integral``, of ints. A string is refused: ``"3,5"`` is text for the command line, and
    iterating it would read its characters.

    >>> validate_numbers("batch_sizes", "3,5", integral=True, example="batch_sizes=[3, 5]")
    Traceback (most recent call last):
    ...
    evendp.InputError: batch_sizes must be a list of ints >= 0, got '3,5'; e.g. batch_sizes=[3, 5]
    """
    if value is None and allow_none:
        return None
    if not _numbers(value, integral) or not all(math.isfinite(v) and v >= 0 for v in value):
        expected = "a list of " + ("ints" if integral else "finite numbers") + " >= 0"
        raise _fail(name, expected, value, example, allow_none)
    return value


def validate_sequence(
    name: str, value: Any, *, integral: bool = False, example: str | None = None
) -> Any:
    """Return ``value`` when it is a sequence (not a string) of numbers (``integral``: ints);
    their values are the caller's to check.

    >>> validate_sequence("seconds_per_sample", 0.5, example="[0.5]")
    Traceback (most recent call last):
    ...
    evendp.InputError: seconds_per_sample must be a list of numbers, got 0.5; e.g. [0.5]
    """
    if not _numbers(value, integral):
        raise _fail(name, "a list of " + ("ints" if integral else "numbers"), value, example)
    return value


def _numbers(value: Any, integral: bool) -> bool:
    """Whether ``value`` is a sequence, not a string, of numbers (``integral``: ints), no bool."""
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return False
    return all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def validate_count(
    name: str, value: Any, *, integral: bool = True, check_values: bool = True
) -> Any:
    """Return ``value`` when it is a count of items: a number or one-element tensor, finite,
    >= 0 and (``integral``) a whole number of samples or tokens; ``integral=False`` also takes
    fractional counts (weighted items). ``check_values=False`` checks the kind and shape only,
    where reading the value would wait for a GPU.

    >>> import torch
    >>> validate_count("count_fn(batch)", torch.tensor(3.0))
    tensor(3.)
    >>> validate_count("count_fn(batch)", -1)
    Traceback (most recent call last):
    ...
    evendp.InputError: count_fn(batch) must be a whole number >= 0 (items counted), got -1
    """
    import torch

    expected = ("a whole number" if integral else "a finite number") + " >= 0 (items counted)"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise _fail(name, expected + " as an int or a one-element tensor", value, None)
        if not check_values or value.device.type == "meta":
            return value
        number: Any = value.detach().reshape(()).item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = value
    else:
        raise _fail(name, expected, value, None)
    whole = not integral or float(number).is_integer()
    if not (math.isfinite(number) and number >= 0 and whole):
        raise _fail(name, expected, value, None)
    return value


def validate_device(name: str, value: Any) -> torch.device:
    """``value`` as a ``torch.device`` (a device, ``"cuda:1"``, ``"cpu"`` or a GPU index).

    >>> validate_device("device", "cuda:1")
    device(type='cuda', index=1)
    >>> validate_device("device", "gpu0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: device must be a torch.device, a name like 'cuda:0' ..., got 'gpu0'
    """
    import torch

    try:
        if isinstance(value, bool) or not isinstance(value, str | int | torch.device):
            raise TypeError
        return torch.device(value)
    except (TypeError, RuntimeError, ValueError):
        expected = "a torch.device, a name like 'cuda:0' or 'cpu', or a GPU index"
        raise _fail(name, expected, value, None) from None
