"""``StepMean`` in one process: the exact global mean from per-micro-batch means, stand-ins 0.

The 2-rank path (DDP, a short last step leaving a rank nothing, the next batch fetched during
backward) runs in tests/integrations/test_ports.py (examples/nanogpt_loop.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import evendp
from evendp._core._exact import stand_in_batch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_micro_batch_means_and_a_stand_in_give_the_full_batch_mean() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    full = _model()
    want = F.cross_entropy(full(x), y)
    want.backward()
    model, step = _model(), evendp.StepMean()
    stand_in = stand_in_batch((x[:1] * 100, y[:1]))  # a real sample, of weight 0
    for xb, yb in [(x[:2], y[:2]), stand_in, (x[2:], y[2:])]:
        step.weigh(F.cross_entropy(model(xb), yb), yb).backward()
    loss = step.finish(model)
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-6) and step.loss is loss
    for got, exp in zip(_grads(model), _grads(full), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-7)


def test_a_count_of_zero_gives_zero_not_nan_and_tokens_count() -> None:
    model, step = _model(), evendp.StepMean(count_fn=lambda y: (y != -100).sum())
    x = torch.randn(2, 4)
    y = torch.tensor([1, -100])
    out = step.weigh(F.cross_entropy(model(x), y), y)  # one counted token of two rows
    assert float(out) == pytest.approx(float(F.cross_entropy(model(x[:1]), y[:1])))
    ignored = torch.tensor([-100, -100])
    nan = step.weigh(F.cross_entropy(model(x), ignored), ignored)  # the mean is NaN
    assert float(nan) == 0.0
    assert float(step.finish(model)) == pytest.approx(float(out))


def test_bad_losses_are_named() -> None:
    with pytest.raises(evendp.EvendpError, match="0-dim tensor"):
        evendp.StepMean().weigh(torch.ones(3), torch.ones(3))


def test_count_tokens_over_ignored_labels_is_exact_and_rows_warn_once() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    y[[1, 2, 3]] = -100  # the first micro-batch has 1 counted label of 3 rows
    full = _model()
    F.cross_entropy(full(x), y).backward()
    model, step = _model(), evendp.StepMean(evendp.count_tokens(shift=False))
    for xb, yb in [(x[:3], y[:3]), (x[3:], y[3:])]:
        step.weigh(F.cross_entropy(model(xb), yb), yb).backward()
    step.finish(model)
    for got, exp in zip(_grads(model), _grads(full), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-7)
    rows = evendp.StepMean()
    with pytest.warns(UserWarning, match=r"count_fn=evendp.count_tokens"):
        rows.weigh(F.cross_entropy(model(x[:3]), y[:3]), y[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows.weigh(F.cross_entropy(model(x[3:]), y[3:]), y[3:])  # once
