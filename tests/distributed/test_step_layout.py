"""The step's layout: every rank computes the same one, alone, and an epoch's layouts cover it.

Each rank here is its own sampler and its own OOM guard, built as a rank builds them (no
shared object): the layouts they compute are compared for equality, the micro-steps after the
one agreed count (the MAX all-reduce, done here by hand) for coverage.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evendp._core._errors import EvendpError
from evendp._core._split import split_sizes
from evendp._distributed._sampler import UnevenBatchSampler
from evendp._distributed._step_layout import StepLayout, layout_step, pad_micro_steps
from evendp._training._oom import OomResplit


@dataclass
class Case:
    length: int
    sizes: list[int]
    resized: list[int] | None  # the speed balancer's new sizes, set on every rank mid-epoch
    at_step: int
    costs: list[float] | None
    max_costs: list[float] | None
    devices: list[float]  # each rank's device weights (a one-process rank has several)
    caps: list[list[int | None]]  # per rank, per device: the OOM guard's micro-batch cap
    accum: int
    seed: int
    shuffle: bool
    drop_last: bool


@st.composite
def cases(draw: st.DrawFn) -> Case:
    world = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(0, 6), min_size=world, max_size=world))
    if sum(sizes) == 0:
        sizes[draw(st.integers(0, world - 1))] = 1
    length = draw(st.integers(max(world, 1), 40))
    drop_last = draw(st.booleans()) and length >= sum(sizes)
    resized = None
    if draw(st.booleans()):
        resized = draw(st.lists(st.integers(0, 6), min_size=world, max_size=world))
        if sum(resized) == 0 or (drop_last and sum(resized) > length):
            resized = None
    costs = None
    max_costs = None
    if draw(st.booleans()):
        costs = [
            float(c) for c in draw(st.lists(st.integers(1, 9), min_size=length, max_size=length))
        ]
        if draw(st.booleans()):  # caps that may or may not hold: a refusal is checked alike
            max_costs = [float(draw(st.integers(9, 60))) for _ in range(world)]
    devices = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    if sum(devices) == 0:
        devices[0] = 1
    caps = [[draw(st.one_of(st.none(), st.integers(1, 4))) for _ in devices] for _ in range(world)]
    return Case(
        length, sizes, resized, draw(st.integers(0, 4)), costs, max_costs,
        [float(w) for w in devices], caps, draw(st.integers(1, 3)), draw(st.integers(0, 9)),
        draw(st.booleans()), drop_last,
    )  # fmt: skip


def epoch_layouts(case: Case, rank: int, epoch: int) -> tuple[list[StepLayout], list[list[int]]]:
    """What rank ``rank`` computes alone for one epoch: each step's layout and its batches."""
    sampler = UnevenBatchSampler(
        case.length, case.sizes, rank=rank, world_size=len(case.sizes), shuffle=case.shuffle,
        seed=case.seed, drop_last=case.drop_last, costs=case.costs, max_costs=case.max_costs,
    )  # fmt: skip
    sampler.set_epoch(epoch)
    layouts, batches = [], []
    for step, batch in enumerate(sampler):
        layouts.append(sampler.layout(step))
        batches.append(batch)
        if case.resized is not None and step == case.at_step:
            sampler.set_batch_sizes(case.resized)
    return layouts, batches


def micro_plan(case: Case, rank: int, rows: list[int], steps: int | None) -> list:
    """Rank ``rank``'s micro-steps of its device rows, as the Trainer asks its own guard."""
    guard = OomResplit(devices=len(rows))
    guard.micro_batch_sizes = list(case.caps[rank])  # this rank's OOM state
    accum = [-(-n // case.accum) if n else None for n in rows]
    plan = guard.plan(rows, accum)
    return plan if steps is None else pad_micro_steps(plan, rows, steps)


def device_split(case: Case):  # the strategy's shares: the devices' weights
    return lambda n: split_sizes(n, case.devices)


@settings(max_examples=150, deadline=None)
@given(case=cases(), epoch=st.integers(0, 2))
def test_every_rank_computes_the_same_layout_and_an_epoch_is_covered_once(
    case: Case, epoch: int
) -> None:
    world = len(case.sizes)
    try:
        runs = [epoch_layouts(case, rank, epoch) for rank in range(world)]
    except EvendpError as err:  # a cap that cannot hold: refused, and by every rank alike
        assert "does not fit max_costs" in str(err)
        for rank in range(world):
            with pytest.raises(EvendpError, match="does not fit max_costs"):
                epoch_layouts(case, rank, epoch)
        return
    layouts = runs[0][0]
    for rank, (mine, batches) in enumerate(runs):
        assert mine == layouts  # the same value on every rank, each computed alone
        assert batches == [layout.rank_indices(rank) for layout in layouts]
    seen = [i for layout in layouts for i in layout.indices]
    if case.drop_last:
        assert len(seen) == len(set(seen)) and len(seen) > case.length - max(
            sum(case.sizes), sum(case.resized or case.sizes)
        )
    else:
        assert sorted(seen) == list(range(case.length))  # each sample once per epoch
    for layout in layouts:
        assert len(layout.rows) == world
        by_cost = case.costs is not None and len(case.devices) > 1
        placed = layout.on_devices(device_split(case), case.costs if by_cost else None)
        assert placed.rank_rows == layout.rank_rows
        for rank in range(world):
            assert sorted(placed.rank_indices(rank)) == sorted(layout.rank_indices(rank))
            if not by_cost:  # by the devices' weights, in order
                n = layout.rank_rows[rank]
                assert placed.device_rows(rank) == split_sizes(n, case.devices)
                assert placed.rank_indices(rank) == layout.rank_indices(rank)
        # The micro-steps: each rank's own count, then the agreed MAX (one all-reduce).
        rows = [placed.device_rows(rank) for rank in range(world)]
        agreed = max(len(micro_plan(case, rank, rows[rank], None)) for rank in range(world))
        for rank in range(world):
            plan = micro_plan(case, rank, rows[rank], agreed)
            assert len(plan) == agreed  # every rank runs as many forward/backward passes
            for device, n in enumerate(rows[rank]):
                spans = [step[device] for step in plan]
                covered = [r for a, b in spans for r in range(a, b)]
                assert covered == list(range(n))  # each row once, in order


def test_a_layout_counts_and_places_as_documented() -> None:
    layout = layout_step([4, 0, 3, 1, 2], [2, 0, 3])
    assert layout.rows == ((2,), (0,), (3,))
    assert layout.rank_indices(1) == [] and layout.rank_indices(2) == [3, 1, 2]
    assert layout.count([1, 2, 3, 4, 5]) == 15.0
    by_cost = layout_step([0, 1, 2, 3], [1, 1], costs=[8.0, 1.0, 1.0, 8.0]).on_devices(
        lambda n: [n, 0]
    )
    assert sum(by_cost.rank_rows) == 4 and by_cost.device_rows(0)[1] == 0


def test_a_sampler_keeps_every_steps_sizes_but_only_the_last_layouts() -> None:
    """An epoch's whole layouts would be a second copy of its permutation (hundreds of MB
    for millions of samples): the sizes of every step stay, the last KEPT_LAYOUTS layouts."""
    from evendp._distributed._step_layout import KEPT_LAYOUTS

    steps = KEPT_LAYOUTS + 44
    sampler = UnevenBatchSampler(2 * steps, [1, 1], rank=0, shuffle=False)
    assert len(list(sampler)) == steps
    assert sampler.sizes_in_step(0) == [1, 1] and len(sampler._steps.recent) == KEPT_LAYOUTS
    assert sampler.layout(steps - 1).rank_indices(1) == [2 * steps - 1]
    with pytest.raises(EvendpError, match=r"step 0's layout is no longer kept.*sizes_in_step"):
        sampler.layout(0)
    with pytest.raises(EvendpError, match="has not been sampled yet"):
        sampler.sizes_in_step(steps)
