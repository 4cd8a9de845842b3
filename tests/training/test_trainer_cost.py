"""Trainer(costs=...) in one process: each device's contiguous share is its cost-balanced set.

The step's samples are the same as without costs (the sampler's), only their order and the
per-device rows change, so with ``count_fn`` the gradient is one device's on the whole batch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from evendp import TrainConfig, Trainer, UnevenBatchSampler, split_by_cost
from evendp._distributed._group import finish_distributed
from tests._helpers import run_ranks

V = 11


class TokenLM(nn.Module):
    """Per-token model; the mean over non-ignored (-100) labels. OOM above ``limit`` rows."""

    def __init__(self, limit: int = 10**9) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.fc = nn.Linear(8, V)
        self.limit = limit

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("injected")
        logits = self.fc(torch.tanh(self.emb(x)))  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


class Lines(torch.utils.data.Dataset[Any]):
    """Variable-length rows; ``batch`` right-pads to the batch's longest, -100 labels there."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, V, (n + 1,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[i][:-1], self.rows[i][1:]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max((len(self.rows[i]) - 1 for i in indices), default=1)
        x = torch.zeros(len(indices), width, dtype=torch.long)
        y = torch.full((len(indices), width), -100, dtype=torch.long)
        for k, i in enumerate(indices):
            xi, yi = self[i]
            x[k, : len(xi)], y[k, : len(yi)] = xi, yi
        return x, y


def tokens(batch: Any) -> torch.Tensor:
    return (batch[1] != -100).sum()


def one_step(
    data: Lines, weights: list[int], accum: int, limit: int, costs: Any
) -> tuple[Trainer, list[int], torch.Tensor, torch.Tensor]:
    """One Trainer step (lr 0) and the one-device gradient on the same step's samples."""
    torch.manual_seed(0)
    model, ref = TokenLM(limit), TokenLM()
    ref.load_state_dict(model.state_dict())
    cfg = TrainConfig(steps=1, batch_size=10, accum=accum, lr=0.0, grad_clip=None, progress=False)
    trainer = Trainer(
        model,
        data,
        cfg,
        device_ids=["cpu"] * len(weights),
        weights=[float(w) for w in weights],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        count_fn=tokens,
        costs=costs,
    )
    indices = list(next(iter(trainer.sampler)))
    trainer.fit()
    ref(*data.batch(indices)).backward()  # one device: the mean over every counted token
    grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (model, ref)]
    return trainer, indices, grads[0], grads[1]


@settings(max_examples=10, deadline=None, phases=[Phase.generate])
@given(
    weights=st.lists(st.integers(0, 3), min_size=1, max_size=4).filter(any),
    accum=st.integers(1, 2),
    limit=st.sampled_from([2, 10**9]),
    lengths=st.lists(st.integers(1, 12), min_size=10, max_size=10),
)
def test_cost_plan_rows_and_the_exact_gradient(
    weights: list[int], accum: int, limit: int, lengths: list[int]
) -> None:
    data = Lines(lengths, seed=sum(lengths))
    trainer, indices, ours, ref = one_step(data, weights, accum, limit, costs=lengths)
    assert float((ours - ref).norm() / ref.norm()) <= 1e-5
    capacities = trainer.strategy.shares(len(indices))
    plan = split_by_cost([lengths[i] for i in indices], capacities)
    ran = [sum(rows) for rows in zip(*trainer.micro_steps, strict=True)]
    assert ran == [len(share) for share in plan]  # each device ran its cost plan's rows


def test_costs_change_the_rows_from_a_function_of_the_item() -> None:
    # Eight short rows and two long ones on two equal devices: by count each device gets
    # five rows and (most likely) a long one; by cost the long rows share one device.
    lengths = [2] * 8 + [12] * 2
    data = Lines(lengths, seed=0)
    by_cost, _, ours, ref = one_step(data, [1, 1], 1, 10**9, costs=lambda item: len(item[0]))
    by_count, _, *_ = one_step(data, [1, 1], 1, 10**9, costs=None)
    assert [sum(r) for r in zip(*by_count.micro_steps, strict=True)] == [5, 5]
    assert sorted(sum(r) for r in zip(*by_cost.micro_steps, strict=True)) == [2, 8]
    assert float((ours - ref).norm() / ref.norm()) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Under DDP: the sampler assigns each step's samples to ranks by cost (2 gloo ranks)

DDP_LENGTHS = [2, 12, 2, 2, 12, 2, 2, 2, 12, 2, 2, 2, 2, 12, 2, 2, 2, 2, 2, 2]
DDP_SIZES = [6, 4]


def _ddp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TokenLM()
    cfg = TrainConfig(steps=1, batch_sizes=DDP_SIZES, lr=0.0, grad_clip=None, progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = Lines(DDP_LENGTHS, seed=0)
    trainer = Trainer(model, data, cfg, optimizer=opt, count_fn=tokens, costs=DDP_LENGTHS)
    mine = next(iter(trainer.sampler))
    trainer.fit()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    torch.save({"indices": mine, "grads": grads}, Path(out) / f"rank{rank}.pt")
    finish_distributed()


@pytest.mark.multiprocess
def test_ddp_ranks_split_by_cost_and_keep_the_gradient(tmp_path: Path) -> None:
    results = run_ranks(_ddp_worker, 2, tmp_path, 150, "DDP cost workers")
    indices = [r["indices"] for r in results]
    expected = [
        next(iter(UnevenBatchSampler(len(DDP_LENGTHS), DDP_SIZES, rank=r, costs=DDP_LENGTHS)))
        for r in range(2)
    ]
    assert indices == expected  # each rank ran the sampler's cost plan
    assert [len(i) for i in indices] != DDP_SIZES  # which differs from the count split here
    torch.manual_seed(0)
    ref = TokenLM()
    ref(*Lines(DDP_LENGTHS, seed=0).batch(indices[0] + indices[1])).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
    for r in results:
        assert float((r["grads"] - want).norm() / want.norm()) <= 1e-5
