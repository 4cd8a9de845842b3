"""The exactness core: count-weighted shares recover the full-batch mean; empty shares add 0."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evendp._core._exact import combine_means, mean_scale, step_count, weighted_sum, zero_weight
from evendp._core._split import split_sizes

CPU = torch.device("cpu")


def _token_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored tokens: NaN (0 / 0) when none is counted."""
    return torch.nn.functional.cross_entropy(x @ w, y, ignore_index=-100)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A batch of tokens with some labels ignored, and a split of it into shares (zeros too)."""
    n = draw(st.integers(1, 24))
    devices = draw(st.integers(1, 6))
    weights = draw(st.lists(st.integers(0, 5), min_size=devices, max_size=devices))
    if not any(weights):
        weights[0] = 1
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    ignored = torch.rand(n, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    y[ignored] = -100
    return x, y, split_sizes(n, weights)


def _shares(x: torch.Tensor, y: torch.Tensor, sizes: list[int]):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for a, size in zip(starts, sizes, strict=True):
        yield x[a : a + size], y[a : a + size]


@given(_batches())
def test_weighted_sums_over_the_global_count_are_the_full_batch_mean(batch) -> None:
    x, y, sizes = batch
    w = torch.randn(3, 4, requires_grad=True)
    total = step_count((y != -100).sum())
    step = sum(
        weighted_sum(_token_loss(w, xs, ys), (ys != -100).sum()) for xs, ys in _shares(x, y, sizes)
    )
    loss = step * mean_scale(total)
    loss.backward()
    assert not torch.isnan(loss) and torch.isfinite(w.grad).all()
    grad, w.grad = w.grad.clone(), None
    if int((y != -100).sum()) == 0:  # nothing counted anywhere: an exact 0, zero gradient
        assert float(loss.detach()) == 0.0 and not grad.any()
        return
    full = _token_loss(w, x, y)
    full.backward()
    torch.testing.assert_close(loss.detach(), full.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, w.grad, rtol=1e-5, atol=1e-6)


@given(_batches())
def test_combine_means_is_the_full_batch_mean(batch) -> None:
    x, y, sizes = batch
    w = torch.randn(3, 4, requires_grad=True)
    shares = list(_shares(x, y, sizes))
    means = [_token_loss(w, xs, ys) for xs, ys in shares]
    counts = [float((ys != -100).sum()) for _, ys in shares]
    combined = combine_means(means, counts, CPU)
    combined.backward()
    if sum(counts) == 0:  # nothing counted: a zero leaf, and backward leaves w untouched
        assert float(combined.detach()) == 0.0 and w.grad is None
        return
    assert torch.isfinite(w.grad).all()
    grad, w.grad = w.grad.clone(), None
    full = _token_loss(w, x, y)
    full.backward()
    torch.testing.assert_close(combined.detach(), full.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("count", [0, 0.0, torch.tensor(0), torch.tensor(0.0)])
def test_a_share_that_counts_nothing_gives_exactly_zero_and_a_zero_gradient(count) -> None:
    w = torch.randn(3, 4, requires_grad=True)
    x, y = torch.randn(2, 3), torch.full((2,), -100)
    mean = _token_loss(w, x, y)
    assert math.isnan(float(mean.detach()))  # the hazard: 0 / 0
    out = weighted_sum(mean, count)
    assert out.requires_grad and float(out.detach()) == 0.0
    out.backward()
    assert w.grad is not None and not w.grad.any()


def test_an_empty_share_gives_exactly_zero_connected_to_every_parameter() -> None:
    net = torch.nn.Linear(3, 2)
    mean = net(torch.zeros(0, 3)).mean()  # a mean over no rows: NaN
    out = weighted_sum(mean, 0)
    out.backward()
    assert float(out.detach()) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())


def test_zero_weight_runs_backward_through_a_stand_in_with_weight_zero() -> None:
    net = torch.nn.Linear(3, 1)
    loss = net(torch.randn(1, 3)).mean()  # the stand-in sample's (finite) loss
    out = zero_weight(loss)
    out.backward()
    assert float(out.detach()) == 0.0 and out.dtype == torch.float32
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    assert float(zero_weight(torch.tensor(float("nan")))) == 0.0


def test_weighted_sum_keeps_at_least_fp32() -> None:
    half = torch.tensor(0.5, dtype=torch.bfloat16)
    assert weighted_sum(half, 3).dtype == torch.float32
    assert weighted_sum(half.double(), torch.tensor(3)).dtype == torch.float64


def test_step_count_needs_no_reduction_for_samples_and_one_otherwise() -> None:
    calls: list[torch.Tensor] = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t * 3  # as if three ranks counted the same

    assert step_count(None, samples=9, all_reduce=all_reduce) == 9 and not calls
    local = torch.tensor(4)
    total = step_count(local, all_reduce=all_reduce)
    assert len(calls) == 1 and calls[0] is not local  # a fresh tensor: reduced in place
    assert total.dtype == torch.int64 and float(total) == 12.0
    assert step_count(2.5).dtype == torch.float64
    with pytest.raises(TypeError, match="samples"):
        step_count(None)


def test_mean_scale_is_zero_with_no_items_anywhere() -> None:
    assert mean_scale(0) == 0.0 and mean_scale(4, numerator=2) == 0.5
    assert float(mean_scale(torch.tensor(0.0)) * torch.tensor(0.0)) == 0.0
    assert mean_scale(torch.tensor(4, dtype=torch.float64)).dtype == torch.float32
