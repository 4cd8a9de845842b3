"""split_sizes: largest-remainder apportionment with zeros."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evendp import EvendpError, split_sizes

weights_lists = st.lists(st.integers(0, 6) | st.floats(0, 5), min_size=1, max_size=8).filter(
    lambda ws: sum(ws) > 0
)


@given(total=st.integers(0, 500), weights=weights_lists)
def test_sizes_sum_to_total_and_stay_within_one_of_the_exact_share(
    total: int, weights: list[float]
) -> None:
    sizes = split_sizes(total, weights)
    assert sum(sizes) == total
    assert len(sizes) == len(weights)
    for size, weight in zip(sizes, weights, strict=True):
        exact = total * weight / sum(weights)
        assert math.floor(exact) - 1e-9 <= size <= math.ceil(exact) + 1e-9
        if weight == 0:
            assert size == 0


def test_ties_go_to_the_lower_index() -> None:
    assert split_sizes(2, [1, 1, 1, 1]) == [1, 1, 0, 0]
    assert split_sizes(5, [1, 1]) == [3, 2]


def test_scaling_the_weights_changes_nothing() -> None:
    assert split_sizes(37, [3, 2, 1]) == split_sizes(37, [0.3, 0.2, 0.1])


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [
        ([1, -1], "-1 at position 1"),
        ([0, 0], "all weights are zero"),
        ([], "empty"),
        ([1, float("nan")], "nan"),
        ("12", "sequence"),
    ],
)
def test_bad_weights_name_the_value(weights: list[float], fragment: str) -> None:
    with pytest.raises(EvendpError, match=fragment):
        split_sizes(4, weights)


def test_negative_total_is_refused() -> None:
    with pytest.raises(EvendpError, match="-3"):
        split_sizes(-3, [1])


def test_extreme_weights_do_not_overflow() -> None:
    assert split_sizes(3, [5e-324, 0, 5e-324]) == [2, 0, 1]
    assert split_sizes(4, [1e308, 1e308]) == [2, 2]
