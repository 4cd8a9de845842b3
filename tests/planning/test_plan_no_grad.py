"""Forward-only plans (``plan(..., no_grad=True)``): predicted against a real forward under
``torch.no_grad``, larger shares than training, and ``weights="auto"`` planning them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

import evendp._planning._planner as planner_mod
from evendp import BalancedDataParallel
from evendp._planning._measure import profile_step
from evendp._planning._memory import DeviceMemory
from evendp._planning._planner import auto_weights, plan
from evendp.examples.gpt import GPT, GPTConfig


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def _real_forward_peak(model: nn.Module, inputs: Any) -> int:
    """MemTracker on real tensors: the peak of one forward under ``torch.no_grad``."""
    model.eval()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        batch = inputs()  # created inside, as the fake run creates its batch
        with torch.no_grad():
            out = model(**batch) if isinstance(batch, dict) else model(batch)
        del out
        peak = tracker.get_tracker_snapshot("peak")
    return sum(v["Total"] for v in peak.values())


@pytest.mark.parametrize(
    ("make", "batch"),
    [
        (_tiny_gpt2, lambda n: {"input_ids": torch.randint(0, 64, (n, 32))}),
        (_bn_net, lambda n: torch.randn(n, 3, 16, 16)),
    ],
    ids=["gpt2", "batchnorm"],
)
def test_forward_only_prediction_matches_a_real_no_grad_forward(make: Any, batch: Any) -> None:
    torch.manual_seed(0)
    model = make()
    n = 16
    predicted = profile_step(model, batch(2), sizes=(n,), optimizer=None, no_grad=True)
    real = _real_forward_peak(model, lambda: batch(n))
    assert predicted["grads"] == predicted["optimizer"] == 0
    assert predicted["peak_bytes"][0] == pytest.approx(real, rel=0.05)
    # A training forward keeps its activations for backward: far more than inference holds.
    training = profile_step(model, batch(2), sizes=(n,), optimizer=None)
    assert training["forward_bytes"][0] > 1.5 * predicted["forward_bytes"][0]


def _small_gpt() -> nn.Module:
    return GPT(GPTConfig(block_size=32, n_layer=1, n_embd=32))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _gpt_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 96, (n, 32)), torch.randint(0, 96, (n, 32))


def test_forward_only_plans_fit_more_and_report_training_beside() -> None:
    p = plan(_small_gpt, _gpt_batch, "512MiB,512MiB,256MiB", cuda_context=0, no_grad=True)
    assert p.no_grad and p.training is not None and not p.training.no_grad
    assert p.global_batch >= 1.5 * p.training.global_batch
    assert all(d.fits for d in p.devices)
    for d in p.devices:  # nothing of a backward or an optimizer step is planned
        assert not {"grads", "optimizer", "gathered_grad", "buckets"} & set(d.breakdown)
    data = json.loads(json.dumps(p.to_dict()))
    for key in ("mode", "split", "global_batch", "eta_mem", "even_split", "even_global_batch"):
        assert key in data  # the stable keys stay
    assert data["no_grad"] is True
    assert data["training"]["global_batch"] == p.training.global_batch
    assert data["training"]["max_batch_alone"] == [d.max_batch_alone for d in p.training.devices]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(p.table())
    text = console.export_text()
    assert "forward only" in text and "training: samples" in text


def test_a_given_batch_is_planned_forward_only_and_training_still_reports_its_largest() -> None:
    p = plan(_mlp, torch.randn(1, 64), "64MiB,32MiB", mode="ddp", cuda_context=0,
             no_grad=True, batch_size=10)  # fmt: skip
    assert sum(p.split) == 10 and p.training is not None and p.training.global_batch > 10
    assert plan(_mlp, torch.randn(1, 64), "64MiB", cuda_context=0).to_dict()["no_grad"] is False


def test_no_grad_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="no_grad must be True or False"):
        plan(_mlp, torch.randn(1, 64), "64MiB", no_grad="yes")  # type: ignore[arg-type]


def test_auto_weights_under_no_grad_plan_a_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    mems = [DeviceMemory("cuda:0", 256 << 20), DeviceMemory("cuda:1", 128 << 20)]
    monkeypatch.setattr(planner_mod, "live_memory", lambda ids: mems)
    deep = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.GELU())])
    x = torch.randn(2, 64)
    training = auto_weights(deep, [0, 1], x)
    inference = auto_weights(deep, [0, 1], x, no_grad=True)
    assert sum(inference) >= 1.5 * sum(training)
    with torch.inference_mode():  # where weights="auto" meets it: the first call of predict
        assert auto_weights(deep, [0, 1], x, no_grad=True) == inference
        assert auto_weights(deep, [0, 1], x) == training


@pytest.mark.parametrize("grad", [True, False])
def test_weights_auto_plans_forward_only_when_planned_with_no_grad(
    monkeypatch: pytest.MonkeyPatch, grad: bool
) -> None:
    seen: list[bool] = []

    def record(*args: Any, no_grad: bool = False, **kwargs: Any) -> list[float]:
        seen.append(no_grad)
        return [1.0, 1.0]

    monkeypatch.setattr(planner_mod, "auto_weights", record)
    dp = BalancedDataParallel(nn.Linear(4, 2), ["cpu", "cpu"], weights="auto")
    with torch.set_grad_enabled(grad):
        dp.plan_weights(torch.randn(5, 4))
    assert seen == [not grad]
    with torch.inference_mode():
        x = torch.randn(5, 4)
        BalancedDataParallel(nn.Linear(4, 2), ["cpu", "cpu"], weights="auto", example=(x,))
    assert seen == [not grad, True]
