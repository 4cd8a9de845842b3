"""Planning by distinct device specs (issue 22): the solver works per distinct device, gives the
per-device answer exactly, and a plan over many copies of a card costs what one copy does.

The reference below is the per-device solver evendp had before (one cap search per device),
kept here verbatim in substance as the oracle for random spec mixes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import evendp
from evendp._core._errors import PlanError
from evendp._core._split import split_sizes
from evendp._planning import _planner
from evendp._planning._solve import MemoryModel, _largest
from tests.planning.test_plan_solve import KiB, _model, _solve


def _capped_even_split(caps: list[int], total: int) -> list[int]:
    """Split ``total`` as evenly as the caps allow: ``min(cap_i, level)`` for the lowest level.

    For equally fast devices the step takes as long as the largest share, so the best split
    that fits is the even one, with a device that cannot hold its even share kept at its cap
    and the rest spread evenly over the others (speed differences are the speed balancer's
    job, at run time). The caller guarantees ``sum(caps) >= total``.

    >>> _capped_even_split([100, 5, 100], 30)
    [13, 5, 12]
    """
    level = _largest(lambda lv: sum(min(c, lv) for c in caps) < total, 1) + 1
    sizes = [min(c, level) for c in caps]
    excess = sum(sizes) - total
    for i in reversed(range(len(sizes))):  # take the excess back from the uncapped, last first
        if excess and sizes[i] == level:
            sizes[i] -= 1
            excess -= 1
    return sizes


def _reference(model: MemoryModel, budgets: list[int], batch: int | None) -> dict[str, list[int]]:
    """One cap search per device: the answer the grouped solver must reproduce."""
    k = len(budgets)

    def cap(i: int, total: int) -> int:
        return _largest(lambda n: model.peak(i, n, total) <= budgets[i], total or 1)

    def caps(total: int) -> list[int]:
        return [min(cap(i, total), total) for i in range(k)]

    def feasible(total: int) -> bool:
        c = caps(total)
        return min(c) >= 0 and sum(c) >= total

    def alone_cap(i: int) -> int:
        return max(0, _largest(lambda n: model.peak(i, n, n) <= budgets[i]))

    alone = [alone_cap(i) for i in range(k)]
    best = _largest(feasible, max(1, sum(alone)))
    if best < 1:
        raise PlanError("not even one sample fits")
    total = best if batch is None else batch
    if total > best:
        raise PlanError("does not fit")
    step_caps = [max(c, 0) for c in caps(total)]
    split = _capped_even_split(step_caps, total)

    def even_fits(t: int) -> bool:
        sizes = split_sizes(t, [1] * k)
        return all(model.peak(i, sizes[i], t) <= budgets[i] for i in range(k))

    even_total = total if batch is not None else max(0, _largest(even_fits, max(1, best)))
    even = split_sizes(even_total, [1] * k)
    return {"split": split, "alone": alone, "even": even, "caps": step_caps}


CARDS = [int(b * KiB) for b in (0, 6, 12, 12.5, 20, 40)]


@given(
    budgets=st.lists(st.sampled_from(CARDS), min_size=1, max_size=9),
    mode=st.sampled_from(["dp", "ddp"]),
    output=st.integers(0, 8),
    gathered=st.sampled_from([None, 0.25 * KiB]),
    convex=st.sampled_from([0.0, 8.0]),
    batch=st.sampled_from([None, 1, 7, 30]),
)
def test_grouped_solver_equals_the_per_device_answer(
    budgets: list[int],
    mode: str,
    output: int,
    gathered: float | None,
    convex: float,
    batch: int | None,
) -> None:
    model = dataclasses.replace(
        _model(KiB, 2 * KiB, mode=mode, convex=convex, gathered_per_sample=gathered),  # type: ignore[arg-type]
        output_device=output % len(budgets),
    )
    try:
        want: dict[str, Any] = _reference(model, budgets, batch)
    except PlanError:
        with pytest.raises(PlanError):
            _solve(model, budgets, batch)
        return
    got = dataclasses.asdict(_solve(model, budgets, batch))
    assert got == want


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record every cost-model evaluation (device index) and every model run on fake tensors."""
    seen: dict[str, list[Any]] = {"peak": [], "measure": []}
    peak, measure = MemoryModel.peak, _planner.measure_replica

    def counted_peak(self: MemoryModel, i: int, n: int, total: int) -> float:
        seen["peak"].append(i)
        return peak(self, i, n, total)

    def counted_measure(*args: Any, **kwargs: Any) -> Any:
        seen["measure"].append(args[1:])
        return measure(*args, **kwargs)

    monkeypatch.setattr(MemoryModel, "peak", counted_peak)
    monkeypatch.setattr(_planner, "measure_replica", counted_measure)
    return seen


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


@pytest.mark.parametrize("mode", ["dp", "ddp"])
def test_many_copies_of_a_card_cost_what_one_distinct_card_does(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    seen = _counting(monkeypatch)
    calls = {}
    for n in (3, 5_000):
        seen["peak"].clear(), seen["measure"].clear()
        result = evendp.plan(_net(), torch.randn(1, 16), f"{n}x64MiB", mode=mode, cuda_context=0)  # type: ignore[arg-type]
        assert len(result.split) == len(result.devices) == n
        calls[n] = (len(seen["peak"]), list(seen["measure"]))
        # Only the first devices' roles are evaluated: device 0 (DP's master and output
        # device) and one of the alike rest.
        assert set(seen["peak"]) <= {0, 1}
    assert calls[3][1] == calls[5_000][1]  # the same model runs on fake tensors
    # The searches run over a larger batch (more halvings: about log2 of the batch), not over
    # more devices: one search per device would make 1,700 times the calls.
    assert calls[5_000][0] < 4 * calls[3][0]


def test_a_mix_of_cards_is_evaluated_once_per_distinct_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _counting(monkeypatch)
    spec = "2x64MiB,300x32MiB,2000x16MiB"
    result = evendp.plan(_net(), torch.randn(1, 16), spec, mode="ddp", cuda_context=0)
    starts = {0, 2, 302}  # the first device of each distinct card
    assert set(seen["peak"]) == starts
    alike = evendp.plan(_net(), torch.randn(1, 16), "1x64MiB,1x32MiB,1x16MiB", mode="ddp",
                        cuda_context=0)  # fmt: skip
    assert result.split[:3] == [result.split[0]] * 2 + [result.split[2]]
    assert alike.devices[0].max_batch_alone == result.devices[0].max_batch_alone


def _columns(result: evendp.Plan) -> list[str]:
    return [str(c.header) for c in result.table().columns[1:]]


def test_a_large_plan_shows_one_column_per_run_of_alike_devices() -> None:
    small = evendp.plan(_net(), torch.randn(1, 16), "3x64MiB", mode="ddp", cuda_context=0)
    assert _columns(small) == ["dev0", "dev1", "dev2"]  # small plans: one column per device
    large = evendp.plan(_net(), torch.randn(1, 16), "2x64MiB,4000x32MiB", cuda_context=0)
    labels = _columns(large)
    # Runs cut where the share or the memory changes: a handful, covering every device once.
    counts = [int(label.split("(x")[1][:-1]) if "(x" in label else 1 for label in labels]
    assert len(labels) <= 6 and sum(counts) == 4002
    assert labels[0] == "dev0" and "dev4001 (x" in labels[-1]
    for count, (_, d, first) in zip(counts, large.columns(), strict=True):
        last = large.devices[first + count - 1]  # alike: the first one but for its name
        assert dataclasses.replace(last, name=d.name) == d
    assert large.devices[4001].name == "dev4001" and len(large.to_dict()["split"]) == 4002
