"""Token caps: the planner prices a share by its padded tokens (``plan(seq_len=L)``), and the
sampler and the Trainer keep every device's share within its cap on long-sequence steps.

Fast parts run on synthetic curves; one fake-tensor plan of a tiny GPT-2 (eager attention:
its score matrix is quadratic in the width) checks the fitted token cost against a real
MemTracker run at widths the fit never saw.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from evendp import EvendpError, TrainConfig, Trainer, UnevenBatchSampler, plan
from evendp._core._cost import padded_cost
from evendp._planning._measure import at_width, profile_step
from evendp._planning._solve import Curve, MemoryModel, token_fit
from tests.planning.test_plan_solve import _solve
from tests.training.test_trainer_cost import Lines, TokenLM, tokens

GiB = 2**30
L = 64  # the longest row: the width the caps are planned at


def synthetic_caps(budgets: list[int]) -> list[int]:
    """Per-device token caps from the solver on a synthetic DDP curve at width ``L``:
    1 KiB of activations per token, 1 MiB of parameters and gradients, no optimizer."""
    per_sample = 1024.0 * L
    replica = Curve({n: {"params": 2**19, "grads": 2**19, "act": n * per_sample} for n in (2, 4)})
    static = {"params": 2.0**19, "grads": 2.0**19, "optimizer": 0.0, "optimizer_extra": 0.0}
    model = MemoryModel("ddp", 0, static, replica, replica, Curve({2: {}}), None, None, 0, 0)
    sol = _solve(model, budgets, 48)
    return [c * L for c in sol.caps]


def test_token_fit_recovers_a_quadratic_and_a_linear_cost() -> None:
    attention = {(n, w): 5e5 + n * (300 * w + 2 * w * w) for n, w in [(2, 64), (4, 64), (4, 32)]}
    assert token_fit(attention) == pytest.approx((5e5, 300.0, 2.0))
    linear = {(n, w): 1e3 + n * 40.0 * w for n, w in [(2, 64), (4, 64), (4, 32)]}
    assert token_fit(linear) == pytest.approx((1e3, 40.0, 0.0), abs=1e-9)


def test_long_step_gives_the_small_device_fewer_samples_within_its_token_cap() -> None:
    caps = synthetic_caps([3 << 20, 3 << 20, 13 << 17])  # 2 MiB, 2 MiB, 0.6 MiB of tokens
    assert caps[2] < caps[0] == caps[1]
    # Step 0: 48 long rows (near L); step 1: 48 short ones. Batch sizes 16 each, as if the
    # sample planner had been given the short width.
    lengths = [L - (i % 4) for i in range(48)] + [8] * 48
    sizes = [16, 16, 16]
    capped = [
        list(UnevenBatchSampler(96, sizes, rank=r, shuffle=False, costs=lengths, max_costs=caps))
        for r in range(3)
    ]
    uncapped = [
        list(UnevenBatchSampler(96, sizes, rank=r, shuffle=False, costs=lengths)) for r in range(3)
    ]
    long_step = [capped[r][0] for r in range(3)]
    costs = [padded_cost([lengths[i] for i in share]) for share in long_step]
    assert all(c <= cap for c, cap in zip(costs, caps, strict=True)), (costs, caps)
    assert len(long_step[2]) < len(long_step[0])  # fewer long rows on the small device
    assert sorted(i for share in long_step for i in share) == list(range(48))  # all, once
    # Ignoring the caps overflows the small device on the long step: the check above bites.
    assert padded_cost([lengths[i] for i in uncapped[2][0]]) > caps[2]
    # The short step fits anywhere: the caps do not force the small device's share down.
    assert [len(capped[r][1]) for r in range(3)] == [16, 16, 16]


def test_a_step_that_cannot_fit_its_caps_names_the_step() -> None:
    lengths = [8] * 4 + [L] * 4
    sampler = UnevenBatchSampler(8, [2, 2], rank=0, shuffle=False, costs=lengths, max_costs=[L, L])
    with pytest.raises(EvendpError, match=r"step 1 of epoch 0 does not fit max_costs.*raise"):
        list(sampler)
    with pytest.raises(EvendpError, match="no costs were given"):
        UnevenBatchSampler(8, [2, 2], rank=0, max_costs=[L, L])
    with pytest.raises(EvendpError, match="max_costs"):
        UnevenBatchSampler(8, [2, 2], rank=0, costs=lengths, max_costs=[L])


def test_trainer_keeps_each_device_within_its_token_cap() -> None:
    lengths = [12, 12, 12, 12, 3, 3, 3, 3, 3, 3]
    data = Lines(lengths, seed=0)
    cfg = TrainConfig(steps=1, batch_size=10, lr=0.0, grad_clip=None, progress=False)
    caps = [60, 24]  # device 1 holds two rows of 12 or eight of 3
    trainer = Trainer(
        TokenLM(), data, cfg, device_ids=["cpu", "cpu"], count_fn=tokens,
        costs=lengths, max_costs=caps,
    )  # fmt: skip
    next(iter(trainer.sampler))
    layout = trainer._on_devices(trainer.sampler.layout(0))
    order, rows = layout.rank_indices(0), layout.device_rows(0)
    shares = [order[: rows[0]], order[rows[0] :]]
    for share, cap in zip(shares, caps, strict=True):
        assert padded_cost([lengths[i] for i in share]) <= cap
    trainer.fit()
    tight = Trainer(
        TokenLM(), data, cfg, device_ids=["cpu", "cpu"], costs=lengths, max_costs=[12, 12]
    )
    with pytest.raises(EvendpError, match="do not fit the caps"):
        tight.fit()
    with pytest.raises(EvendpError, match="costs=None"):
        Trainer(TokenLM(), data, cfg, device_ids=["cpu", "cpu"], max_costs=caps)
    # One device has nothing to balance, but its cap is still held.
    alone = Trainer(TokenLM(), data, cfg, device_ids=["cpu"], costs=lengths, max_costs=[12])
    with pytest.raises(EvendpError, match="do not fit the caps"):
        alone.fit()


def tiny_gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=2 * L,
        attn_implementation="eager",  # no fused kernel: the scores cost n * width**2
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def test_plan_seq_len_token_caps_and_the_fit_at_unseen_widths() -> None:
    model = tiny_gpt2()
    ids = torch.zeros(1, 8, dtype=torch.long)  # a short example: seq_len sets the width
    batch = {"input_ids": ids, "labels": ids}
    p = plan(model, batch, "6MiB,6MiB,4MiB", mode="ddp", cuda_context=0, seq_len=L)
    assert p.seq_len == L and p.max_tokens is not None and p.token_cost is not None
    assert p.max_tokens == [d.max_tokens for d in p.devices]
    assert p.max_tokens[2] < p.max_tokens[0] and all(t % L == 0 for t in p.max_tokens)
    assert p.token_cost["per_token_width"] > 0  # attention's quadratic term was measured
    data = p.to_dict()
    assert data["max_tokens"] == p.max_tokens and data["devices"][2]["max_tokens"] > 0
    assert {"mode", "split", "global_batch", "eta_mem", "even_split"} <= data.keys()
    # The fit (widths L and L/2) against a real fake-tensor MemTracker run at other widths.
    fit = p.token_cost
    for n, width in [(3, 48), (6, 24)]:
        measured = profile_step(model, at_width(batch, width), sizes=(n,))["peak_bytes"][0]
        predicted = fit["fixed"] + n * width * (fit["per_token"] + fit["per_token_width"] * width)
        assert predicted == pytest.approx(measured, rel=0.05)


def test_plan_seq_len_needs_a_sequence_dimension() -> None:
    net = torch.nn.Linear(4, 2)
    assert plan(net, torch.randn(1, 4), "1GiB", cuda_context=0).to_dict()["max_tokens"] is None
    with pytest.raises(EvendpError, match="sequence dimension"):
        plan(net, torch.randn(1, 4)[:, 0], "1GiB", seq_len=8)
    with pytest.raises(EvendpError, match="seq_len"):
        plan(net, torch.randn(1, 4), "1GiB", seq_len=0)
