"""The planner end to end on fake tensors: extrapolation flagged, auto weights plan the gather."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import evendp._planning._planner as planner_mod
from evendp._planning._memory import DeviceMemory
from evendp._planning._planner import auto_weights, plan
from evendp.examples.lm_head import LMHead


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def test_a_plan_resting_on_extrapolation_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner_mod, "_MAX_ROUNDS", 0)  # measure 2 and 4 only, never refine
    p = plan(_net(), torch.randn(1, 64), "64MiB,32MiB", mode="ddp", cuda_context=0)
    assert max(p.split) > max(p.measured_sizes)
    assert p.extrapolated and p.to_dict()["extrapolated"] is True
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(p.table())
    assert "extrapolated" in console.export_text()


def test_refined_plans_rest_on_their_last_measurement() -> None:
    p = plan(_net(), torch.randn(1, 64), "64MiB,32MiB", mode="ddp", cuda_context=0)
    assert not p.extrapolated and json.loads(json.dumps(p.to_dict()))["extrapolated"] is False
    # Every recommended size was measured (or lies between measured sizes).
    assert max([*p.split, *(d.max_batch_alone for d in p.devices)]) <= max(p.measured_sizes)
    assert all(d.fits for d in p.devices)


def test_auto_weights_count_the_gathered_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two "GPUs" with equal free memory; an lm-head whose logits dwarf its parameters.
    vocab, seq = 512, 64
    mems = [DeviceMemory("cuda:0", 256 << 20), DeviceMemory("cuda:1", 256 << 20)]
    monkeypatch.setattr(planner_mod, "live_memory", lambda ids: mems)
    model = LMHead(vocab, seq, n_embd=16)
    tokens = torch.randint(0, vocab, (2, seq))
    options = {"optimizer": torch.optim.AdamW, "safety_margin": 0.1, "cuda_context": 0}
    gathered = auto_weights(model, [0, 1], tokens, gather_output=True)
    per_device = auto_weights(model, [0, 1], tokens, gather_output=False)
    # What auto planning counted before: gathered logits held on cuda:0, no gradient for them.
    held_only = plan(model, tokens, mems, mode="dp", gather_output=True, **options).split
    # cuda:0 also holds the optimizer state and reduces the gradients (DP's master), so it
    # takes less even without gathering; holding the gathered logits costs it more, and their
    # gradient (as large again) more still.
    assert gathered[0] < held_only[0] < per_device[0]
