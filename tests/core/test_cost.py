"""split_by_cost and padded_cost (evendp._core._cost): the pure cost-balanced split of one step."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evendp._core._cost import padded_cost, split_by_cost
from evendp._core._errors import EvendpError
from evendp._core._split import split_sizes

costs_strategy = st.lists(st.integers(0, 300), min_size=0, max_size=40)
capacities_strategy = st.lists(
    st.sampled_from([0, 0.5, 1, 1, 2, 3]), min_size=1, max_size=6
).filter(lambda c: sum(c) > 0)


def bottleneck(
    costs: list[float], shares: list[list[int]], capacities: list[float], padded: bool = True
) -> float:
    """max_i(cost_i / capacity_i) over the devices with samples."""
    worst = 0.0
    for share, cap in zip(shares, capacities, strict=True):
        cost = padded_cost([costs[j] for j in share], padded)
        if share:
            worst = max(worst, cost / cap if cap > 0 else math.inf)
    return worst


def count_split(n: int, capacities: list[float]) -> list[list[int]]:
    """The sample-count split of a step in step order (what the sampler does without costs)."""
    sizes, shares, start = split_sizes(n, capacities), [], 0
    for size in sizes:
        shares.append(list(range(start, start + size)))
        start += size
    return shares


@settings(max_examples=150, deadline=None)
@given(costs=costs_strategy, capacities=capacities_strategy, padded=st.booleans())
def test_coverage_zero_capacity_and_never_worse_than_the_count_split(
    costs: list[int], capacities: list[float], padded: bool
) -> None:
    shares = split_by_cost(costs, capacities, padded=padded)
    assert len(shares) == len(capacities)
    assert sorted(j for share in shares for j in share) == list(range(len(costs)))
    assert all(share == sorted(share) for share in shares)
    assert all(not share for share, cap in zip(shares, capacities, strict=True) if cap == 0)
    planned = bottleneck(costs, shares, capacities, padded)
    baseline = bottleneck(costs, count_split(len(costs), capacities), capacities, padded)
    assert planned <= baseline * (1 + 1e-9)
    # Deterministic: the same plan again, as every rank computes it on its own.
    assert split_by_cost(list(costs), list(capacities), padded=padded) == shares


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=1, max_size=7),
    capacities=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=3).filter(
        lambda c: sum(c) > 0
    ),
)
def test_optimal_among_sorted_runs(costs: list[int], capacities: list[int]) -> None:
    # Brute force: every device order and every cut of the sorted costs into runs.
    if sum(costs) == 0:
        return  # nothing costs anything: split by count (tested below)
    sorted_costs = sorted(costs)
    n, k = len(costs), len(capacities)
    best = math.inf
    for order in itertools.permutations(range(k)):
        for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
            bounds = [0, *cuts, n]
            worst = 0.0
            for slot, device in enumerate(order):
                run = sorted_costs[bounds[slot] : bounds[slot + 1]]
                if run:
                    cap = capacities[device]
                    worst = max(worst, padded_cost(run) / cap if cap else math.inf)
            best = min(best, worst)
    got = bottleneck(costs, split_by_cost(costs, capacities), capacities)
    assert got <= best * (1 + 1e-8)


@settings(max_examples=60, deadline=None)
@given(costs=costs_strategy.filter(bool), capacities=capacities_strategy, data=st.data())
def test_caps_are_respected(costs: list[int], capacities: list[float], data: st.DataObject) -> None:
    k = len(capacities)
    max_sizes = data.draw(st.lists(st.integers(0, 40), min_size=k, max_size=k))
    max_costs = data.draw(
        st.lists(st.sampled_from([0, 50, 500, 5000, math.inf]), min_size=k, max_size=k)
    )
    try:
        shares = split_by_cost(costs, capacities, max_sizes=max_sizes, max_costs=max_costs)
    except EvendpError as err:
        assert "do not fit the caps" in str(err)
        return
    assert sorted(j for share in shares for j in share) == list(range(len(costs)))
    for share, size_cap, cost_cap in zip(shares, max_sizes, max_costs, strict=True):
        assert len(share) <= size_cap
        assert padded_cost([costs[j] for j in share]) <= cost_cap


def test_groups_similar_lengths_and_follows_capacity() -> None:
    # Eight short and eight long samples interleaved; capacities 2:1:1.
    costs = [10, 100] * 8
    shares = split_by_cost(costs, [2, 1, 1])
    lengths = [sorted({costs[j] for j in share}) for share in shares]
    assert all(len(kinds) == 1 for kinds in lengths)  # no device mixes short and long
    assert bottleneck(costs, shares, [2, 1, 1]) < bottleneck(
        costs, count_split(16, [2, 1, 1]), [2, 1, 1]
    )
    # The plan's padded total equals the real total: no padding at all here.
    assert sum(padded_cost([costs[j] for j in s]) for s in shares) == sum(costs)


def test_all_zero_costs_split_by_count() -> None:
    assert split_by_cost([0, 0, 0, 0, 0], [2, 1, 0]) == [[0, 1, 2], [3, 4], []]


def test_tensor_and_array_costs() -> None:
    import numpy as np
    import torch

    want = split_by_cost([10, 1, 1, 10], [1, 1])
    assert split_by_cost(torch.tensor([10, 1, 1, 10]), [1, 1]) == want  # type: ignore[arg-type]
    assert split_by_cost(np.array([10.0, 1, 1, 10]), [1, 1]) == want  # type: ignore[arg-type]


def test_empty_step() -> None:
    assert split_by_cost([], [1, 2]) == [[], []]


def test_unpadded_balances_sums() -> None:
    shares = split_by_cost([5, 1, 1, 1, 1, 1], [1, 1], padded=False)
    sums = sorted(sum([5, 1, 1, 1, 1, 1][j] for j in s) for s in shares)
    assert sums == [5, 5]


@pytest.mark.parametrize(
    ("costs", "capacities", "kw", "message"),
    [
        ("abc", [1], {}, "costs must be a sequence"),
        ([1, -2], [1], {}, "cost -2 at position 1"),
        ([1, math.nan], [1], {}, "cost nan at position 1"),
        ([1, True], [1], {}, "cost True at position 1"),
        ([1], [0, 0], {}, "all weights are zero"),
        ([1], [1, 1], {"max_sizes": [1]}, "max_sizes must be a sequence of 2"),
        ([1], [1], {"max_costs": [-1]}, "max_costs[0] = -1"),
        ([5, 5], [1, 1], {"max_sizes": [1, 0]}, "do not fit the caps"),
    ],
)
def test_bad_input_names_the_value(
    costs: object, capacities: list[float], kw: dict[str, object], message: str
) -> None:
    with pytest.raises(EvendpError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_by_cost(costs, capacities, **kw)  # type: ignore[arg-type]
