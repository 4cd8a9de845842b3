"""Every rank trains one batch plan or every rank stops (issue 35), on ranks as threads.

Two nodes started with different ``--batch-sizes`` each trained their own plan to exit 0 with
samples never used; a rank whose plan was refused stopped alone while the others waited.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from evendp._core._errors import EvendpError
from evendp._distributed._batch_plan import BatchPlan
from evendp._distributed._plan_agreement import agreed_plan
from tests._threaded import run_threads


def _outcomes(plans: list[Any]) -> list[Any]:
    """Each rank's answer (its plan, or the message it raised) when rank r builds plans[r]
    (an ``EvendpError`` there: that rank's build refuses)."""

    def rank_body(rank: int, world: int) -> Any:
        def build() -> BatchPlan:
            if isinstance(plans[rank], EvendpError):
                raise plans[rank]
            return BatchPlan.of(plans[rank], world_size=None)

        try:
            return agreed_plan(build, world)
        except EvendpError as exc:
            return str(exc)

    return run_threads(rank_body, len(plans))


@given(st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any))
def test_ranks_holding_one_plan_train_it(sizes: list[int]) -> None:
    got = _outcomes([sizes] * len(sizes))
    assert all(isinstance(p, BatchPlan) and list(p.sizes) == sizes for p in got)


@given(
    st.lists(st.integers(0, 9), min_size=2, max_size=5).filter(any),
    st.data(),
)
def test_a_rank_with_another_plan_stops_every_rank_naming_both(sizes: list[int], data: Any) -> None:
    odd = data.draw(st.integers(1, len(sizes) - 1))
    other = list(reversed(sizes)) if sizes != sizes[::-1] else [s + 1 for s in sizes]
    plans = [sizes] * len(sizes)
    plans[odd] = other
    got = _outcomes(plans)
    first_odd = next(r for r, p in enumerate(plans) if p != sizes)
    assert len(set(got)) == 1  # every rank says the same line
    said = got[0]
    assert isinstance(said, str) and f"rank 0 (node 0) has sizes {sizes}" in said
    assert f"rank {first_odd} (node 0) has sizes {other}" in said and "--batch-sizes" in said


def test_caps_count_as_part_of_the_plan() -> None:
    plans = [BatchPlan((3, 1), caps=(8, 4)), BatchPlan((3, 1), caps=(8, 2))]

    def rank_body(rank: int, world: int) -> Any:
        try:
            return agreed_plan(lambda: plans[rank], world)
        except EvendpError as exc:
            return str(exc)

    said = run_threads(rank_body, 2)
    assert said[0] == said[1] and "with caps [8, 2]" in said[0]


def test_a_rank_whose_plan_is_refused_stops_the_others_too() -> None:
    own = EvendpError("batch sizes [1, 3, 4] have 3 entries for 2 ranks")
    got = _outcomes([[1, 3], own])
    assert got[1] == str(own)  # its own reason
    assert got[0].startswith("rank 1 (node 0) refused its batch plan, so no rank trains")


@given(st.integers(2, 5), st.data())
def test_a_rank_started_with_other_options_stops_every_rank_naming_the_option(
    world: int, data: Any
) -> None:
    """Issue 35: machines started with another --lr (or --steps, --resume...) trained on, each
    its own run, the replicas drifting apart. The options' digest travels with the plan; the
    first option that differs is named on every rank."""
    odd = data.draw(st.integers(1, world - 1))

    def rank_body(rank: int, world: int) -> Any:
        options = {"lr": 0.01 if rank == odd else 0.003, "steps": 50}
        try:
            return agreed_plan(lambda: BatchPlan.of([1] * world, world_size=None), world, options)
        except EvendpError as exc:
            return str(exc)

    got = run_threads(rank_body, world)
    assert len(set(got)) == 1, got
    assert got[0] == (
        f"node 0 was started with other options than node 0: --lr is 0.01 there (rank {odd}), "
        "0.003 on node 0; start every machine with the same options but --node-rank, --devices "
        "and --out"
    )
    same = run_threads(lambda r, w: agreed_plan(lambda: BatchPlan.of([1] * w), w, {"lr": 1}), world)
    assert all(isinstance(p, BatchPlan) for p in same)
