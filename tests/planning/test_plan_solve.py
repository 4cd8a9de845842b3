"""The planner's solver on synthetic cost curves: pure arithmetic, no model runs (milliseconds)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from evendp._core._errors import PlanError
from evendp._planning._solve import Curve, MemoryModel, Mode, cut_spans, expand, solve_spans

KiB = 1024.0


@dataclasses.dataclass
class Solution:
    """Per-device samples: the chosen split, each device's most alone, the even split."""

    split: list[int]
    alone: list[int]
    even: list[int]
    caps: list[int]  # each device's most samples within the chosen global batch


def _solve(model: MemoryModel, budgets: list[int], batch: int | None) -> Solution:
    """The planner's answer for one budget per device, as per-device lists."""
    runs = [(v, len(list(g))) for v, g in itertools.groupby(budgets)]
    segments = solve_spans(model, cut_spans(model, runs), batch)
    return Solution(*(expand(segments, f) for f in ("split", "alone", "even", "cap")))


def _model(
    per_sample: float,
    fixed: float = 0.0,
    *,
    mode: Mode = "ddp",
    convex: float = 0.0,
    gathered_per_sample: float | None = None,
) -> MemoryModel:
    """Peak(n) = fixed + per_sample * n + convex * n^2, measured at n = 1, 2, 4, 8."""
    acts = {
        n: {"params": fixed, "activations": per_sample * n + convex * n * n} for n in (1, 2, 4, 8)
    }
    static = {"params": fixed, "grads": 0.0, "optimizer": 0.0, "optimizer_extra": 0.0}
    gathered = held = None
    if gathered_per_sample is not None:
        per_total = {t: {"gathered_grad": gathered_per_sample * t} for t in (1, 2, 4, 8)}
        gathered, held = Curve(per_total), Curve(per_total)
    return MemoryModel(
        mode=mode,
        output_device=0,
        static=static,
        replica=Curve(acts),
        forward_end=Curve({n: {"params": fixed} for n in acts}),
        outputs=Curve({n: {"bytes": 0.0} for n in acts}),
        gathered=gathered,
        gathered_held=held,
        buckets=0,
        context=0,
    )


def test_affine_curves_fill_each_device_to_its_budget() -> None:
    model = _model(per_sample=KiB, fixed=10 * KiB)
    sol = _solve(model, [int(20 * KiB), int(15 * KiB)], None)
    assert sol.alone == [10, 5]
    assert sol.split == [10, 5]
    # Even: shares differ by at most one (the first takes the remainder), so the small
    # device's 5 caps the batch at 11.
    assert sol.even == [6, 5]


def test_a_given_batch_is_split_as_evenly_as_the_caps_allow() -> None:
    model = _model(per_sample=KiB, fixed=10 * KiB)
    budgets = [int(20 * KiB), int(15 * KiB)]
    assert _solve(model, budgets, 12).split == [7, 5]
    assert _solve(model, budgets, 8).split == [4, 4]
    assert _solve(model, budgets, 8).even == [4, 4]
    with pytest.raises(PlanError, match="largest that fits is 15"):
        _solve(model, budgets, 16)


def test_a_zero_budget_device_gets_no_samples_when_it_holds_nothing_fixed() -> None:
    sol = _solve(_model(per_sample=KiB), [int(8 * KiB), 0, int(4 * KiB)], None)
    assert sol.split == [8, 0, 4]
    # Evenly, a batch of 2 would give the empty device a sample: even tops out at 1.
    assert sol.even == [1, 0, 0]


def test_budgets_too_small_for_one_sample_raise() -> None:
    # Each figure in a unit that shows it (issue 51: it was "needs 0.00 GiB ... 0.00 GiB").
    needs = r"device 0 needs 11\.0 KiB for one sample, may use 10\.5 KiB; device 1 needs"
    with pytest.raises(PlanError, match=needs):
        _solve(_model(per_sample=KiB, fixed=10 * KiB), [int(10.5 * KiB)] * 2, None)
    # A device that cannot even hold the model (DDP: every rank does) makes any batch infeasible.
    with pytest.raises(PlanError, match="not even one sample fits"):
        _solve(_model(per_sample=KiB, fixed=10 * KiB), [int(20 * KiB), int(5 * KiB)], None)


def test_convex_curves_interpolate_above_and_extrapolate_below() -> None:
    def true(n: float) -> float:
        return 50 * n * n + 50 * n

    curve = Curve({n: {"b": true(n)} for n in (1, 2, 4)})
    # Between measured sizes the chord over-predicts a convex peak (safe) ...
    assert curve.at(3)["b"] >= true(3)
    # ... beyond the largest it under-predicts: extrapolation is a lower bound.
    assert curve.at(8)["b"] < true(8)
    assert curve.slope() == pytest.approx((true(4) - true(2)) / 2)


def test_convex_cost_caps_the_device_where_the_curve_crosses_its_budget() -> None:
    model = _model(per_sample=KiB, convex=KiB)  # n + n^2 KiB, measured exactly at 1, 2, 4, 8
    # Budget 20 KiB: 4 samples cost 20 KiB exactly; 5 (interpolated 4..8) would cost 32 KiB.
    assert _solve(model, [int(20 * KiB)], None).alone == [4]


def test_the_gathered_gradient_shrinks_the_output_devices_share() -> None:
    budgets = [int(16 * KiB)] * 2
    plain = _solve(_model(per_sample=KiB, mode="dp"), budgets, None)
    gathered = _solve(_model(per_sample=KiB, mode="dp", gathered_per_sample=KiB / 2), budgets, None)
    assert plain.split[0] == plain.split[1]
    assert gathered.split[0] < gathered.split[1]
    assert sum(gathered.split) < sum(plain.split)
