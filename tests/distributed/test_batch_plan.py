"""One batch plan: built and checked once, carried in one variable, read by one parser.

The launcher writes the plan (sizes and caps) into ``EVENDP_BATCH_SIZES``; a rank reads it
back through ``batch_sizes_from_env``, the sampler and the speed balancer, and the text is
parsed once. ``batch_size`` and ``batch_sizes`` have one meaning (the global batch, its
shares); a contradiction is refused, on the command line and in ``TrainConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

import pytest

import evendp._distributed._batch_plan as plan_mod
from evendp import EvendpError, TrainConfig, UnevenBatchSampler, batch_sizes_from_env
from evendp._distributed._batch_plan import (
    DEFAULT_BATCH_SIZE,
    BatchPlan,
    global_batch_size,
    validate_batch_plan,
)
from evendp._planning._launch import plan_launch
from evendp._planning._speed import SpeedBalancer


def test_the_text_round_trips_with_and_without_caps() -> None:
    for plan in (BatchPlan((3, 0, 5)), BatchPlan((3, 5), (48, 24), "planned for memory")):
        back = BatchPlan.parse(plan.text)
        assert (back.sizes, back.caps) == (plan.sizes, plan.caps)
    assert BatchPlan((3, 5)).text == "3,5"  # without caps: the text scripts have always read
    assert BatchPlan((3, 5), (4, 8)).env() == {"EVENDP_BATCH_SIZES": "3,5;caps=4,8"}


@pytest.mark.parametrize(
    ("sizes", "caps", "world", "message"),
    [
        ([0, 0], None, None, "all batch sizes are zero"),
        ([3, -1], None, None, "batch size -1 for rank 1"),
        ([3, 5], None, 3, "got 2 batch sizes .* for world_size=3"),
        ([3, 5], [9], None, "got 1 caps for 2 ranks"),
        ([3, 5], [9, -1], None, "cap -1 for rank 1 is not a non-negative int"),
        ([3, 5], [9, 4], None, "rank 1 takes 5 samples per step but its memory holds 4"),
        ("3,5", None, None, "must be a sequence of non-negative ints"),
    ],
)
def test_one_check_names_the_value_and_the_fix(
    sizes: Any, caps: Any, world: int | None, message: str
) -> None:
    with pytest.raises(EvendpError, match=message):
        validate_batch_plan(sizes, caps, world)
    with pytest.raises(EvendpError, match=message):  # a plan is never built unchecked
        BatchPlan.of(sizes, caps, world_size=world)


def test_the_launchers_plan_reaches_the_rank_through_one_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Launcher side: the plan and the variables it hands torchrun's ranks.
    launched = plan_launch(nproc=2, batch_sizes="3,5", nvml=False)
    assert launched.batch_plan is not None and launched.batch_plan.source == "given"
    capped = BatchPlan(launched.batch_plan.sizes, (6, 9), "planned for memory")
    assert list(capped.env()) == ["EVENDP_BATCH_SIZES"]  # one channel, caps included
    # Rank side: what torchrun's rank sees in its environment.
    for key, value in {**capped.env(), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert BatchPlan.from_env() == BatchPlan((3, 5), (6, 9), "env")
    assert batch_sizes_from_env() == [3, 5]
    sampler = UnevenBatchSampler(range(64), batch_sizes_from_env(), rank=0)
    assert SpeedBalancer(sampler.batch_sizes).caps == [6, 9]


def test_a_rank_parses_the_text_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: batch_sizes_from_env, the sampler (to mark the sizes read) and the balancer's
    # caps each parsed their own string; now one parse of one text serves all three.
    calls: list[str] = []
    real = plan_mod._ints

    def counting(part: str, *args: Any) -> list[int]:
        calls.append(part)
        return real(part, *args)

    monkeypatch.setattr(plan_mod, "_ints", counting)
    plan_mod._parse_text.cache_clear()
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "3,5;caps=6,9")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = UnevenBatchSampler(range(64), batch_sizes_from_env(), rank=0)
    assert SpeedBalancer(sampler.batch_sizes).caps == [6, 9] and BatchPlan.from_env() is not None
    assert calls == ["3,5", "6,9"]  # the sizes and the caps of one text, once


def test_the_launcher_parses_batch_sizes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from evendp.cli import main

    calls: list[str] = []
    real = plan_mod._ints
    monkeypatch.setattr(plan_mod, "_ints", lambda part, *a: calls.append(part) or real(part, *a))
    plan_mod._parse_text.cache_clear()
    assert main(["launch", "--batch-sizes", "2,7", "--dry-run", "t.py"]) == 0
    assert calls == ["2,7"]


# ---------------------------------------------------------------------------------------------
# batch_size and batch_sizes: one meaning


def test_batch_size_not_given_is_the_sum_of_the_shares() -> None:
    assert TrainConfig().batch_size == 32
    assert TrainConfig(batch_sizes=[3, 5]).batch_size == 8
    assert TrainConfig(batch_size=8, batch_sizes=[3, 5]).batch_size == 8
    assert TrainConfig(batch_size=12, batch_sizes="auto").batch_size == 12
    # dataclasses.replace with other shares derives the sum again, no contradiction.
    again = dataclasses.replace(TrainConfig(batch_sizes=[3, 5]), batch_sizes=[2, 2])
    assert again.batch_size == 4


def test_the_default_is_a_plain_32_everywhere_but_the_check() -> None:
    assert DEFAULT_BATCH_SIZE == 32 and repr(DEFAULT_BATCH_SIZE) == "32"
    assert json.loads(json.dumps(dataclasses.asdict(TrainConfig())))["batch_size"] == 32
    copied = pickle.loads(pickle.dumps(TrainConfig(batch_sizes=[3, 5]).batch_size))
    assert type(copied) is int and copied == 8  # a checkpoint holds a plain int


@pytest.mark.parametrize("given", [10, 32])  # 32 given is told apart from the default
def test_a_contradiction_in_python_is_refused(given: int) -> None:
    with pytest.raises(
        EvendpError,
        match=rf"batch_size={given} \(the global batch per step\) contradicts "
        r"batch_sizes=\[3, 5\] \(each rank's share, 8 in all\); pass batch_size=8",
    ):
        TrainConfig(batch_size=given, batch_sizes=[3, 5])


def test_a_contradiction_on_the_command_line_is_refused() -> None:
    with pytest.raises(
        EvendpError, match=r"--batch 9 .* contradicts --batch-sizes 3,5 .*--batch 8"
    ):
        global_batch_size(9, [3, 5], cli="--batch-sizes ")
    assert global_batch_size(8, [3, 5], cli="--batch-sizes ") == 8
