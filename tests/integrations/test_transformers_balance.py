"""``UnevenTrainer(balance="speed")`` and ``UnevenTrainer(costs=...)`` on 2 gloo ranks.

One spawn runs both: a tiny GPT-2 causal LM (padding, -100 labels) with rank 1 slowed by a
sleep per sample, speed-balanced; and the sequence classifier with samples sent to ranks by
length. Each must end with the parameters of one plain ``transformers.Trainer`` process on
the same global batches (SGD, 1e-5), while speed moved samples off the slow rank and cost
balance sent samples by length. ``batch_sizes="auto"`` gives both ranks the same sizes, planned
from each one's declared memory.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import evendp
from tests._helpers import run_ranks, torchrun_env
from tests.integrations._tiny import LR, make_model
from tests.integrations.test_transformers import (
    _args,
    _Data,
    _model,
    _params,
    _relative_update_error,
    _samples,
    pad_collate,
)

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

SPEED_SIZES, SPEED_STEPS = [4, 4], 8
COST_SIZES, COST_ACCUM, COST_STEPS = [1, 3], 2, 3  # one epoch of test_transformers' data
SLEEP_PER_SAMPLE = 0.01  # rank 1's forward: far slower than the tiny model itself
SLOW_OPTIMIZER_S = 0.05  # rank 1's optimizer step: the 4-row forward's time several times
MEMORY, AUTO_PER_DEVICE = "128MiB,64MiB", 6  # unequal; CPU ranks are charged no CUDA context
TOL = 1e-5


class _Repeated(torch.utils.data.Dataset):
    """test_transformers' samples, repeated to cover the speed run's steps."""

    def __init__(self, task: str, samples: int) -> None:
        self.base = _Data(task)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.base[i % len(self.base)]


def _slow_down(model: torch.nn.Module, seconds: float) -> None:
    # Inside the model's forward (a submodule's hook), where a slower GPU would spend it.
    def sleep(_: torch.nn.Module, args: tuple[Any, ...]) -> None:
        time.sleep(seconds * args[0].shape[0])

    model.transformer.register_forward_pre_hook(sleep)


def _speed_run(rank: int, tmp: str) -> dict[str, Any]:
    from evendp.integrations.transformers import UnevenTrainer

    model = _model("lm")
    if rank == 1:
        _slow_down(model, SLEEP_PER_SAMPLE)
    args = _args(tmp, batch=4, accum=1, ddp_backend="gloo", max_steps=SPEED_STEPS)
    trainer = UnevenTrainer(
        model, args, train_dataset=_Repeated("lm", sum(SPEED_SIZES) * SPEED_STEPS),
        data_collator=pad_collate, batch_sizes=SPEED_SIZES, balance="speed",
    )  # fmt: skip
    rows: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, k: rows.append(len(k["input_ids"])), with_kwargs=True
    )
    trainer.train()
    return {"params": _params(model), "history": trainer.balancer.history, "rows": rows}


def _slow_optimizer_run(rank: int, tmp: str) -> dict[str, Any]:
    """Rank 1's optimizer step is slow (a CPU-offloaded one), its forward as fast as rank 0's."""
    from evendp.integrations.transformers import UnevenTrainer

    model = _model("lm")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if rank == 1:
        optimizer.register_step_pre_hook(lambda *_: time.sleep(SLOW_OPTIMIZER_S))
    args = _args(tmp, batch=4, accum=1, ddp_backend="gloo", max_steps=SPEED_STEPS)
    trainer = UnevenTrainer(
        model, args, train_dataset=_Repeated("lm", sum(SPEED_SIZES) * SPEED_STEPS),
        data_collator=pad_collate, batch_sizes=SPEED_SIZES, balance="speed",
        optimizers=(optimizer, None),
    )  # fmt: skip
    trainer.train()
    return {"params": _params(model), "history": trainer.balancer.history}


def _cost_run(tmp: str) -> dict[str, Any]:
    from evendp.integrations.transformers import UnevenTrainer

    model = _model("cls")
    args = _args(tmp, batch=2, accum=COST_ACCUM, ddp_backend="gloo", max_steps=COST_STEPS)
    trainer = UnevenTrainer(
        model, args, train_dataset=_Data("cls"), data_collator=pad_collate,
        batch_sizes=COST_SIZES, costs=lambda item: len(item["input_ids"]),
    )  # fmt: skip
    lengths: list[list[int]] = []  # per forward pass, the real length of each row
    model.register_forward_pre_hook(
        lambda m, a, k: lengths.append(k["attention_mask"].sum(1).tolist()), with_kwargs=True
    )
    trainer.train()
    return {"params": _params(model), "lengths": lengths}


def _auto_sizes(tmp: str) -> dict[str, Any]:
    from evendp.integrations.transformers import UnevenTrainer

    args = _args(tmp, batch=AUTO_PER_DEVICE, accum=1, ddp_backend="gloo")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # issue 36: what "auto" chose is printed
        sizes = UnevenTrainer(
            _model("lm"), args, train_dataset=_Data("lm"), data_collator=pad_collate,
            batch_sizes="auto", memory=MEMORY,
        ).batch_sizes  # fmt: skip
    lines = [line for line in said.getvalue().splitlines() if "batch_sizes='auto'" in line]
    return {"sizes": sizes, "said": lines}


def _accelerate_run(rank: int) -> dict[str, Any]:
    """A hand-written Accelerate loop with ``speed_balancer``; rank 1 slowed."""
    from accelerate import Accelerator

    from evendp.integrations.accelerate import speed_balancer, uneven_dataloader

    x, y = _loop_data()
    accelerator = Accelerator(cpu=True)
    loader = uneven_dataloader(
        accelerator, torch.utils.data.TensorDataset(x, y), SPEED_SIZES, shuffle=False
    )
    balancer = speed_balancer(loader)
    model = make_model()
    if rank == 1:
        model[0].register_forward_pre_hook(lambda m, a: time.sleep(SLEEP_PER_SAMPLE * len(a[0])))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    for xb, yb in loader:
        with balancer.measure(len(yb)):
            local_sum = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum")
        accelerator.backward(evendp.ddp_loss(local_sum, len(yb)))
        optimizer.step()
        optimizer.zero_grad()
        balancer.step()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"params": params, "history": balancer.history}


def _loop_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = sum(SPEED_SIZES) * SPEED_STEPS
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"speed": _speed_run(rank, tmp), "cost": _cost_run(tmp), "auto": _auto_sizes(tmp)}
        result["slow_optimizer"] = _slow_optimizer_run(rank, tmp)
    result["accelerate"] = _accelerate_run(rank)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    import evendp

    evendp.finish_distributed()


def _reference(task: str, data: Any, batch: int, steps: int) -> dict[str, torch.Tensor]:
    """One plain Trainer process, each optimizer step's samples in one forward pass."""
    model = _model(task)
    with tempfile.TemporaryDirectory() as tmp:
        args = _args(tmp, batch=batch, accum=1, max_steps=steps)
        transformers.Trainer(model, args, train_dataset=data, data_collator=pad_collate).train()
    return _params(model)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("hfb"), 300, "balanced UnevenTrainer")


def _moved_off_rank_1_as_one_process(ranks: list[dict[str, Any]], run: str) -> None:
    """Both ranks end with one process's parameters, after the same splits, the last of which
    gives the slow rank 1 fewer samples."""
    total = sum(SPEED_SIZES)
    want = _reference("lm", _Repeated("lm", total * SPEED_STEPS), total, SPEED_STEPS)
    start = _params(_model("lm"))
    for rank in ranks:
        assert _relative_update_error(rank[run]["params"], want, start) < TOL
    history = ranks[0][run]["history"]
    assert history == ranks[1][run]["history"]  # every rank the same splits
    last = history[-1][1]
    assert len(history) > 1 and last[1] < last[0] and sum(last) == total


def test_speed_balance_moves_samples_off_the_slow_rank_and_keeps_one_process_result(
    ranks: list[dict[str, Any]],
) -> None:
    _moved_off_rank_1_as_one_process(ranks, "speed")
    # The split in force is what each rank ran: the fast rank's later steps are bigger.
    assert max(ranks[0]["speed"]["rows"]) > SPEED_SIZES[0] > min(ranks[1]["speed"]["rows"])


def test_speed_balance_counts_a_slow_optimizer_step(ranks: list[dict[str, Any]]) -> None:
    """Issue 37: the optimizer step is timed beside the forward (it was not: a rank slow only
    in its update kept its share)."""
    _moved_off_rank_1_as_one_process(ranks, "slow_optimizer")


def test_cost_balance_sends_samples_by_length_and_keeps_one_process_result(
    ranks: list[dict[str, Any]],
) -> None:
    per_step = sum(COST_SIZES) * COST_ACCUM
    want = _reference("cls", _Data("cls"), per_step, COST_STEPS)
    start = _params(_model("cls"))
    for rank in ranks:
        assert _relative_update_error(rank["cost"]["params"], want, start) < TOL
    lengths = [len(s["input_ids"]) for s in _samples()]

    def split(rank: int, **cost: Any) -> list[list[int]]:
        sampler = evendp.UnevenBatchSampler(
            len(lengths), COST_SIZES, rank=rank, world_size=2, shuffle=False, **cost
        )
        return [[lengths[i] for i in batch] for batch in sampler]

    for rank, result in enumerate(ranks):  # each rank ran the cost plan, not the count split
        assert result["cost"]["lengths"] == split(rank, costs=lengths) != split(rank)


def test_auto_batch_sizes_follow_each_rank_memory_and_agree(ranks: list[dict[str, Any]]) -> None:
    sizes = ranks[0]["auto"]["sizes"]
    assert ranks[1]["auto"]["sizes"] == sizes and sum(sizes) == AUTO_PER_DEVICE * 2
    said = [f"evendp: batch_sizes='auto' planned {sizes} per rank for a global batch of "]
    assert [line[: len(said[0])] for line in ranks[0]["auto"]["said"]] == said
    assert ranks[1]["auto"]["said"] == []  # said once, by rank 0
    assert sizes[0] > sizes[1]  # the rank with more memory takes more of the same total


def test_accelerate_speed_balancer_keeps_one_process_parameters(
    ranks: list[dict[str, Any]],
) -> None:
    x, y = _loop_data()
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step = sum(SPEED_SIZES)
    for k in range(SPEED_STEPS):  # shuffle=False: step k is samples [k * step, (k + 1) * step)
        rows = slice(k * step, (k + 1) * step)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = [p.detach() for p in model.parameters()]
    for rank in ranks:
        got = rank["accelerate"]["params"]
        num = sum(float((g - w).norm() ** 2) for g, w in zip(got, want, strict=True)) ** 0.5
        den = sum(float((w - s).norm() ** 2) for w, s in zip(want, start, strict=True)) ** 0.5
        assert num / den < TOL
    history = ranks[0]["accelerate"]["history"]
    assert history == ranks[1]["accelerate"]["history"] and len(history) > 1
    assert history[-1][1][1] < history[-1][1][0]  # samples moved off the slow rank 1
