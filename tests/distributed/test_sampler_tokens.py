"""``UnevenBatchSampler(max_tokens=...)``: a global batch measured in tokens, exact by count.

Each step takes samples from the epoch's permutation while their tokens fit the budget; the
ranks split them by cost. Checked over random lengths, capacities, budgets and world sizes:
every rank yields the same steps, each step's shares partition one contiguous piece of the
permutation that is full (the next sample would not fit), every index once per epoch, and the
steps are the same whatever the split (as one process's).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import evendp


def _epoch(
    lengths: list[int], sizes: list[int], budget: int, **kw: object
) -> list[list[list[int]]]:
    """Per rank, per step, the indices it takes (one epoch)."""
    world = len(sizes)
    samplers = [
        evendp.UnevenBatchSampler(
            len(lengths), sizes, rank=r, world_size=world, costs=lengths, max_tokens=budget, **kw
        )  # type: ignore[arg-type]
        for r in range(world)
    ]
    steps = [list(s) for s in samplers]
    assert all(len(s) == len(steps[0]) for s in samplers)  # len() agrees with the iteration
    return steps


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=60),
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    slack=st.integers(0, 120),
    seed=st.integers(0, 3),
)
def test_steps_fill_the_token_budget_and_cover_the_epoch_once(
    lengths: list[int], sizes: list[int], slack: int, seed: int
) -> None:
    if len(lengths) < len(sizes):  # the sampler refuses fewer samples than ranks
        lengths = lengths * len(sizes)
    budget = max(lengths) + slack
    steps = _epoch(lengths, sizes, budget, seed=seed)
    alone = _epoch(lengths, [1], budget, seed=seed)[0]  # one process, the same epoch
    assert len({len(r) for r in steps}) == 1  # every rank the same number of steps
    order = [i for step in alone for i in step]
    assert sorted(order) == list(range(len(lengths)))  # each index once per epoch
    cursor = 0
    for k, whole in enumerate(alone):
        shares = [rank[k] for rank in steps]
        merged = sorted(i for share in shares for i in share)
        assert merged == sorted(whole)  # the ranks split the step one process takes
        assert whole == order[cursor : cursor + len(whole)]  # a contiguous piece of the perm
        cursor += len(whole)
        tokens = sum(lengths[i] for i in whole)
        assert tokens <= budget
        if cursor < len(order):  # full: the next sample would overflow the budget
            assert tokens + lengths[order[cursor]] > budget
        for r, share in enumerate(shares):
            assert sizes[r] > 0 or not share  # a rank of capacity 0 takes nothing


def test_sizes_in_step_counts_every_rank_share_and_balance_moves_only_the_split() -> None:
    lengths = [5, 3, 9, 2, 2, 7, 1, 4, 6, 6]
    sampler = evendp.UnevenBatchSampler(
        len(lengths), [1, 1], rank=0, shuffle=False, costs=lengths, max_tokens=12
    )
    it = iter(sampler)
    first = next(it)
    sampler.set_batch_sizes([1, 3])  # a speed balancer's move: the steps stay the same
    rest = list(it)
    counts = [sum(sampler.sizes_in_step(k)) for k in range(len(sampler))]
    want = _epoch(lengths, [1], 12, shuffle=False)[0]
    assert counts == [len(step) for step in want]
    assert len([first, *rest]) == len(want)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": 10}, "no costs were given"),
        ({"max_tokens": 3, "costs": [2, 5]}, "below the longest sample's 5 tokens"),
        ({"max_tokens": 9, "costs": [2, 5], "drop_last": True}, "drop_last=False"),
        ({"max_tokens": "9", "costs": [2, 5]}, "positive number"),
    ],
)
def test_bad_budgets_are_refused_naming_the_fix(options: dict[str, object], message: str) -> None:
    with pytest.raises(evendp.EvendpError, match=message):
        evendp.UnevenBatchSampler(2, [1], rank=0, **options)  # type: ignore[arg-type]
