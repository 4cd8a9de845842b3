"""Pure split arithmetic: per-device weights -> integer sample counts that sum to the batch.

Largest-remainder (Hamilton) apportionment: each device first gets the floor of its exact
share, then the samples left over go to the largest fractional parts. Ties go to the lower
device index so the result is deterministic. A zero weight always gets zero samples.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from ._errors import EvendpError
from ._validate import validate_int

__all__ = [
    "largest_remainder",
    "split_even",
    "split_sizes",
    "validate_weights",
]


def validate_weights(weights: Sequence[float], expected_len: int | None = None) -> list[float]:
    """Return ``weights`` as floats, or raise naming what is wrong and how to fix it."""
    if (
        isinstance(weights, (str, bytes))
        or not isinstance(weights, Sequence)
        or not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights)
    ):
        raise EvendpError(
            f"weights must be a sequence of non-negative numbers, got {weights!r}; "
            "pass e.g. [1, 1, 0.5]"
        )
    values = [float(w) for w in weights]
    if expected_len is not None and len(values) != expected_len:
        raise EvendpError(
            f"got {len(values)} weights {list(weights)!r} for {expected_len} devices; "
            f"pass exactly one weight per device ({expected_len} numbers)"
        )
    if not values:
        raise EvendpError("weights is empty; pass one non-negative weight per device")
    for i, w in enumerate(values):
        if not math.isfinite(w) or w < 0:
            raise EvendpError(
                f"weight {weights[i]!r} at position {i} is not a non-negative finite number; "
                "use 0 to give a device no samples"
            )
    if sum(values) <= 0:
        raise EvendpError(
            f"all weights are zero ({list(weights)!r}); at least one device needs a positive weight"
        )
    return values


def split_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` samples in proportion to ``weights`` (largest remainder, zeros allowed).

    The sizes always sum to ``total``; a zero weight always gets 0.

    >>> split_sizes(10, [1, 1, 1])
    [4, 3, 3]
    >>> split_sizes(32, [2, 2, 1])
    [13, 13, 6]
    >>> split_sizes(3, [1, 0, 1])
    [2, 0, 1]
    """
    validate_int("total", total, minimum=0, example="32")
    return largest_remainder(total, validate_weights(weights))


def largest_remainder(total: int, values: Sequence[float]) -> list[int]:
    """:func:`split_sizes` of a count and weights checked where they were given (a step's
    split: the weights were checked once, not again every step).

    >>> largest_remainder(7, [1.0, 1.0, 1.0])
    [3, 2, 2]
    """
    # Relative to the largest weight first: tiny (subnormal) or huge weights would make
    # total / sum overflow to infinity.
    largest = max(values)
    values = [w / largest for w in values]
    scale = total / sum(values)
    exact = [w * scale for w in values]
    sizes = [math.floor(x) for x in exact]
    left = total - sum(sizes)
    # Largest fractional part first, ties to the lower index. Zero weights never take
    # a leftover sample, even when float round-off leaves equal fractions.
    positive = [i for i, w in enumerate(values) if w > 0]
    order = sorted(positive, key=lambda i: (-(exact[i] - sizes[i]), i))
    for k in range(left):
        sizes[order[k % len(order)]] += 1
    return sizes


def split_even(total: int, count: int) -> list[int]:
    """``total`` samples over ``count`` equal devices: what ``nn.DataParallel`` runs.

    >>> split_even(10, 3)
    [4, 3, 3]
    """
    return split_sizes(total, [1] * count)  # count: a device or rank count evendp checked
