"""``EngineMean`` in one process: steps of the engine's accumulation, weights, boundaries.

The real DeepSpeed engine on 2 gloo ranks (ZeRO 1, 2 and 3, a short last step leaving a rank
nothing, sizes [0, 4]) runs in tests/integrations/test_deepspeed.py (examples/deepspeed_loop.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evendp
from evendp._core._exact import stand_in_batch


class _Engine:
    """What EngineMean reads of a DeepSpeed engine; ``backward`` divides as DeepSpeed does."""

    def __init__(self, accumulation: int) -> None:
        self.accumulation, self.boundaries = accumulation, []

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundaries.append(is_boundary)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()


def test_steps_weigh_micro_batch_means_into_each_step_mean_with_a_short_last_step() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = _Engine(accumulation=2)
    mean = evendp.EngineMean(engine)
    stand_in = stand_in_batch((x[:1] * 100, y[:1]))  # a real sample, of weight 0
    loader = [(x[:2], y[:2]), stand_in, (x[2:6], y[2:6]), (x[6:], y[6:])]
    grads = []
    for batches in mean.steps(loader):
        for xb, yb in batches:
            engine.backward(mean.weigh(F.cross_entropy(model(xb), yb), yb))
        grads.append(model.weight.grad.clone())
        model.zero_grad()
    assert engine.boundaries == [False, True, False, True]  # the step's last micro-batch
    for got, idx in zip(grads, [slice(0, 2), slice(2, 7)], strict=True):
        ref = torch.nn.Linear(4, 3)
        ref.load_state_dict(model.state_dict())
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        torch.testing.assert_close(got, ref.weight.grad, rtol=1e-5, atol=1e-7)


def test_a_step_of_stand_ins_only_weighs_zero_never_nan() -> None:
    mean = evendp.EngineMean(_Engine(accumulation=3))
    w = torch.tensor(1.0, requires_grad=True)
    loader = [stand_in_batch(torch.ones(1)), stand_in_batch(torch.ones(1)), torch.ones(0)]
    for batches in mean.steps(loader):
        losses = [mean.weigh((w * b).mean() * 1e6, b) for b in batches[:2]]
        sum(losses).backward()
        nan = mean.weigh(torch.tensor(float("nan")), batches[2])  # a mean over no rows
    assert [float(v) for v in losses] == [0.0, 0.0] and float(w.grad) == 0.0
    assert float(nan) == 0.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: evendp.EngineMean(torch.nn.Linear(1, 1)), "pass engine, not engine.module"),
        (lambda: evendp.EngineMean(_Engine(1), count_fn=3), "count_fn"),
        (lambda: evendp.EngineMean(_Engine(1)).weigh(torch.ones(()), None), "mean.steps"),
        (lambda: evendp.EngineMean(_Engine(1)).weigh(torch.ones(2), None), "0-dim tensor"),
    ],
)
def test_bad_input_names_the_fix(call: object, message: str) -> None:
    with pytest.raises(evendp.EvendpError, match=message):
        call()  # type: ignore[operator]
