"""OOM-safe DDP reduces its gradient buckets while backward runs, and stays exact when a
launched bucket goes stale (issue 37, item 3).

In one process: the launch order and when a launched copy is stale. On two gloo ranks (one
task of the shared pool) the Trainer's default DDP trains a tiny HF GPT-2 (right padding,
``-100`` labels, the token mean through ``count_fn``) on an uneven split, and each step equals
one process's on the whole batch: plainly (the buckets went during backward), after an OOM in
one rank's last backward that came after some buckets had gone (that rank retries smaller,
every rank reduces again), and with a weight used in two reentrant-checkpointed blocks (its
gradient arrives twice in one backward).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from evendp import TrainConfig, Trainer, finish_distributed
from evendp._distributed._grad_buckets import GradientBuckets
from evendp._training._strategies import _ddp as oom_safe_ddp
from evendp._training._strategies._ddp import OomSafeDDP
from tests._helpers import OomInBackward, run_ranks, tiny_gpt2_config

SIZES = [3, 5]  # the two ranks' shares of a global batch of 8
STEPS = 2
SMALL_BUCKETS = 4096  # bytes: the tiny GPT-2's 20 kB of gradients in several buckets


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)]
    return nn.Sequential(*layers)


def test_buckets_go_in_backward_order_while_backward_runs() -> None:
    model = _mlp()
    seen: list[int] = []  # how many buckets had gone when the first layer's gradient came
    layer = model[0]
    assert isinstance(layer, nn.Linear)

    def note(_: torch.Tensor) -> None:
        seen.append(len(buckets._launched))

    layer.weight.register_post_accumulate_grad_hook(note)
    buckets = GradientBuckets(model.parameters(), bucket_bytes=SMALL_BUCKETS)  # hooks after
    assert buckets.buckets[0][0] is model[4].bias  # the last layer's first
    with buckets.overlapping():
        model(torch.randn(3, 4)).sum().backward()
    assert len(buckets.buckets) >= 3 and 1 <= seen[0] < len(buckets.buckets)
    # Every bucket went during backward but the last, which the step's flags ride in.
    assert len(buckets._launched) == len(buckets.buckets) - 1 and not buckets.stale
    buckets.finish(torch.zeros(1))
    before = [_grad(p).clone() for p in model.parameters()]
    buckets.apply()  # one process: the average of one rank is its own gradient
    assert all(torch.equal(a, _grad(p)) for a, p in zip(before, model.parameters(), strict=True))


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def test_a_gradient_after_its_bucket_went_makes_the_step_stale() -> None:
    model = _mlp()
    buckets = GradientBuckets(model.parameters(), bucket_bytes=SMALL_BUCKETS)
    x = torch.randn(3, 4)
    with buckets.overlapping():  # an attempt that launched its buckets, then failed
        model(x).sum().backward()
    model.zero_grad()
    model(x).sum().backward()  # the retry's first micro-step: a launched bucket's gradient
    assert buckets.stale and buckets.overlap  # a retry: overlap stays on for later steps
    with buckets.overlapping():  # the retry's last micro-step launches nothing more
        model(x).sum().backward()
    buckets.finish(torch.zeros(1))
    buckets.reduce_again()
    assert not buckets.stale and buckets._launched == []

    shared = _mlp()[2]  # one weight in two reentrant-checkpointed blocks, as ALBERT shares

    def twice(h: torch.Tensor) -> torch.Tensor:
        h = checkpoint(shared, h, use_reentrant=True)
        return checkpoint(shared, torch.tanh(h), use_reentrant=True)

    buckets = GradientBuckets(shared.parameters(), bucket_bytes=SMALL_BUCKETS)
    with buckets.overlapping():
        twice(torch.randn(3, 64, requires_grad=True)).sum().backward()
    assert buckets.stale and not buckets.overlap  # from now on this rank launches at the end


# --- two ranks: the Trainer's default DDP -------------------------------------------------------


class Padded(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Right-padded token rows of random lengths; padding and the first token are -100."""

    def __init__(self, n: int = SIZES[0] * 4 + SIZES[1] * 4, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 64, (n, seq), generator=g)
        self.lengths = torch.randint(2, seq + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.arange(self.ids.shape[1]) < self.lengths[i]
        labels = torch.where(mask, self.ids[i], torch.tensor(-100))
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask.long(), "labels": labels}


def _gpt2(oom_rank_rows: int | None) -> nn.Module:
    """A tiny GPT-2 whose embedding's backward runs out of memory above ``oom_rank_rows``
    rows: the last to run in backward, after the blocks' buckets went."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=2))
    if oom_rank_rows is not None:
        wte = model.transformer.wte
        wte.register_forward_hook(lambda m, a, out: OomInBackward.apply(out, oom_rank_rows))
    return model


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss  # the mean over the shifted labels that are not -100


def _count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


class SharedBlock(nn.Module):
    """One Linear run twice inside reentrant checkpoints: its gradient accumulates twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.shared, self.head = nn.Linear(4, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def _rows() -> Any:
    g = torch.Generator().manual_seed(5)
    n = sum(SIZES) * STEPS
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class SpyBuckets(GradientBuckets):
    """The strategy's buckets, telling per step how many had gone when the flags were sent
    (all in backward, or some at the end) and how the gradients became the ranks'."""

    steps: ClassVar[list[tuple[int, str]]] = []  # per step: (launched in backward, outcome)

    def finish(self, flags: torch.Tensor, *, failed: bool = False) -> None:
        self.steps.append((len(self._launched), ""))
        super().finish(flags, failed=failed)

    def _outcome(self, what: str) -> None:
        self.steps[-1] = (self.steps[-1][0], what)

    def apply(self) -> None:
        self._outcome("applied")
        super().apply()

    def reduce_again(self) -> None:
        self._outcome("reduced again")
        super().reduce_again()


CASES = ("overlap", "oom_after_launch", "shared_weight")


def _case(case: str, rank: int) -> dict[str, Any]:
    SpyBuckets.steps = []
    if case == "shared_weight":
        model: nn.Module = SharedBlock()
        data: Any = _rows()
        extra: dict[str, Any] = {}
    else:
        model = _gpt2(1 if case == "oom_after_launch" and rank == 1 else None)
        data, extra = Padded(), {"loss_fn": _loss, "count_fn": _count}
    cfg = TrainConfig(
        steps=STEPS, batch_sizes=SIZES, lr=0.1, grad_clip=None, progress=False, seed=0
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, data, cfg, optimizer=opt, **extra)
    trainer.sampler.set_epoch(0)
    mine = list(trainer.sampler)[:STEPS]
    every: list[Any] = [None, None]
    dist.all_gather_object(every, mine)
    report = trainer.fit()
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "indices": every,
        "losses": report.losses,
        "resplits": report.resplits,
        "launched": [n for n, _ in SpyBuckets.steps],
        "outcomes": [what for _, what in SpyBuckets.steps],
        "buckets": len(trainer.strategy._buckets.buckets),  # type: ignore[attr-defined]
    }


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # Small buckets, and buckets that tell what they did; put back for the pool's next task.
    saved = OomSafeDDP.bucket_bytes, oom_safe_ddp.GradientBuckets
    OomSafeDDP.bucket_bytes, oom_safe_ddp.GradientBuckets = SMALL_BUCKETS, SpyBuckets  # type: ignore[misc]
    try:
        results = {case: _case(case, rank) for case in CASES}
    finally:
        OomSafeDDP.bucket_bytes, oom_safe_ddp.GradientBuckets = saved  # type: ignore[misc]
    torch.save(results, Path(out) / f"rank{rank}.pt")
    finish_distributed()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("grad_buckets"), 180, "bucket ranks")


def _one_process(case: str, steps: list[list[int]]) -> tuple[torch.Tensor, list[float]]:
    """The same steps on one process, each on its whole batch."""
    if case == "shared_weight":
        model: nn.Module = SharedBlock()
        data: Any = _rows()
    else:
        model, data = _gpt2(None), Padded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for indices in steps:
        opt.zero_grad()
        if case == "shared_weight":
            x, y = data[indices]
            loss = model(x, y)
        else:
            batch = torch.utils.data.default_collate([data[i] for i in indices])
            loss = _loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_each_step_equals_one_process_on_the_whole_batch(
    ranks: list[dict[str, Any]], case: str
) -> None:
    r0, r1 = (r[case] for r in ranks)
    steps = [a + b for a, b in zip(r0["indices"][0], r0["indices"][1], strict=True)]
    params, losses = _one_process(case, steps)
    for r in (r0, r1):
        assert float((r["params"] - params).norm() / params.norm()) <= 1e-5
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
    assert r0["buckets"] >= (3 if case != "shared_weight" else 1)
    if case == "overlap":  # every bucket went during backward but the flags' one
        assert r0["launched"] == r1["launched"] == [r0["buckets"] - 1] * STEPS
        assert r0["outcomes"] == ["applied"] * STEPS
    if case == "oom_after_launch":  # rank 1 launched some buckets, ran out, retried smaller
        assert r1["resplits"] > 0 and r0["resplits"] == 0
        assert 0 < r1["launched"][0] < r1["buckets"]
        assert r0["outcomes"][0] == r1["outcomes"][0] == "reduced again"
    if case == "shared_weight":  # the first step is stale; afterwards rank 1 waits for the end
        assert r0["outcomes"] == r1["outcomes"] == ["reduced again", "applied"]
        assert r0["launched"][1] == 0


def test_unfreezing_layers_rebuilds_the_buckets_at_the_next_last_backward() -> None:
    """Progressive unfreezing: a parameter that starts to train joins the buckets (else its
    gradient would never be averaged); the check runs at the start of a last backward."""
    from evendp import init_distributed

    init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = _mlp()
    model[0].requires_grad_(False)
    strategy = OomSafeDDP(model)
    first = strategy._gradient_buckets()
    assert not any(p is model[0].weight for b in first.buckets for p in b)
    assert strategy._gradient_buckets(recheck=True) is first  # nothing changed
    model[0].requires_grad_(True)
    assert strategy._gradient_buckets() is first  # mid-step: kept
    again = strategy._gradient_buckets(recheck=True)
    assert again is not first and again.holds(model.parameters())
    assert any(p is model[0].weight for b in again.buckets for p in b)
