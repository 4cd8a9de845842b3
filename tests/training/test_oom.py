"""OOM re-split: injected out-of-memory errors never change the step's gradient.

The DDP checks run in one pair of gloo processes, started once for the module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from torch import nn

from evendp._core._errors import EvendpError
from evendp._distributed._group import all_reduce_gradients, finish_distributed
from evendp._parallel._dp import BalancedDataParallel
from evendp._training._oom import OomResplit
from tests._helpers import OomInBackward, run_ranks

N = 12


class OomNet(nn.Module):
    """A small MLP that raises torch.OutOfMemoryError when its batch is larger than a limit."""

    def __init__(self, forward_limit: int = 10**9, backward_limit: int = 10**9) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 16)
        self.fc2 = nn.Linear(16, 3)
        self.forward_limit = forward_limit
        self.backward_limit = backward_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.forward_limit:
            raise torch.OutOfMemoryError("injected OOM in forward")
        h = torch.tanh(self.fc1(x))
        # fc2's weight gradient is accumulated before this backward raises: the guard must
        # drop that partial gradient.
        h = OomInBackward.apply(h, self.backward_limit)
        return self.fc2(h)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    limits = model.forward_limit, model.backward_limit
    model.forward_limit = model.backward_limit = 10**9
    nn.functional.cross_entropy(model(x), y).backward()
    model.forward_limit, model.backward_limit = limits
    ref = _grads(model).clone()
    model.zero_grad()
    return ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("fwd", "bwd"), [(5, 10**9), (10**9, 4), (3, 2)])
def test_injected_oom_keeps_the_exact_gradient(fwd: int, bwd: int) -> None:
    torch.manual_seed(0)
    model = OomNet(forward_limit=fwd, backward_limit=bwd)
    x, y = _data()
    ref = _reference(model, x, y)
    guard = OomResplit()
    loss = guard.run(
        N,
        lambda a, b: nn.functional.cross_entropy(model(x[a:b]), y[a:b]),
        weight=1 / N,
        zero_grad=model.zero_grad,
    )
    assert loss is not None and guard.resplits > 0 and guard.skipped == 0
    assert guard.micro_batch_size is not None
    assert guard.micro_batch_size <= min(fwd, bwd)
    assert _rel(_grads(model), ref) <= 1e-5
    model.forward_limit = 10**9
    assert torch.allclose(loss, nn.functional.cross_entropy(model(x), y).detach(), rtol=1e-5)


def test_working_size_is_remembered() -> None:
    model = OomNet(forward_limit=4)
    x, y = _data()
    guard = OomResplit()
    for _ in range(2):
        guard.run(
            N,
            lambda a, b: nn.functional.cross_entropy(model(x[a:b]), y[a:b]),
            weight=1 / N,
            zero_grad=model.zero_grad,
        )
        model.zero_grad()
    assert guard.micro_batch_size == 3 and guard.resplits == 2  # 12 -> 6 -> 3, then kept


def test_oom_inside_balanced_data_parallel_share() -> None:
    torch.manual_seed(0)
    # Only device 0's share (weight 2 of 4) goes above 4 samples: its thread raises.
    inner = OomNet(forward_limit=4)
    model = BalancedDataParallel(inner, ["cpu", "cpu", "cpu"], weights=[2, 1, 1])
    x, y = _data()
    ref = _reference(inner, x, y)
    guard = OomResplit()
    loss = guard.run(
        N,
        lambda a, b: nn.functional.cross_entropy(model(x[a:b]), y[a:b]),
        weight=1 / N,
        zero_grad=model.zero_grad,
    )
    assert loss is not None and guard.resplits == 1 and guard.micro_batch_size == 6
    assert _rel(_grads(inner), ref) <= 1e-5


def test_skip_is_the_last_resort_and_counted() -> None:
    model = OomNet(forward_limit=0)
    x, y = _data()
    guard = OomResplit(micro_batch_size=4)
    loss = guard.run(
        N,
        lambda a, b: nn.functional.cross_entropy(model(x[a:b]), y[a:b]),
        weight=1 / N,
        zero_grad=model.zero_grad,
    )
    assert loss is None and guard.skipped == 1
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_gradient_accumulation_cap_and_bad_input() -> None:
    model = OomNet()
    x, y = _data()
    ref = _reference(model, x, y)
    sizes: list[int] = []

    def chunk(a: int, b: int) -> torch.Tensor:
        sizes.append(b - a)
        return nn.functional.cross_entropy(model(x[a:b]), y[a:b])

    OomResplit().run(N, chunk, weight=1 / N, zero_grad=model.zero_grad, micro_batch_size=5)
    assert sizes == [5, 5, 2]
    assert _rel(_grads(model), ref) <= 1e-5
    with pytest.raises(EvendpError, match="micro_batch_size"):
        OomResplit(micro_batch_size=0)
    with pytest.raises(EvendpError, match="non-negative"):
        OomResplit().run(-1, chunk, weight=1.0, zero_grad=model.zero_grad)


# --- one guard, several devices: each share has its own cap -------------------------------

SHARES = [3, 6, 3]  # of N = 12: only device 1's share is above a limit of 4 or 5


def _dp_run(
    model: BalancedDataParallel, guard: OomResplit, x: torch.Tensor, y: torch.Tensor
) -> list[list[int]]:
    """One step the way the Trainer runs it; returns the sizes of each micro-step that ran."""
    offsets = [sum(SHARES[:i]) for i in range(len(SHARES))]
    seen: list[list[int]] = []

    def chunk_loss(spans: list[tuple[int, int]]) -> torch.Tensor:
        if all(a == 0 for a, _ in spans):
            seen.clear()  # a restart after an OOM: keep the attempt that completed
        rows = torch.cat(
            [torch.arange(o + a, o + b) for o, (a, b) in zip(offsets, spans, strict=True)]
        )
        model.weights = [b - a for a, b in spans]
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        seen.append(list(model.last_sizes))
        return loss

    guard.run_shares(SHARES, chunk_loss, weight=1 / N, zero_grad=model.zero_grad)
    return seen


def test_forward_oom_on_one_device_shrinks_only_its_share() -> None:
    torch.manual_seed(0)
    inner = OomNet(forward_limit=4)
    model = BalancedDataParallel(inner, ["cpu", "cpu", "cpu"])
    x, y = _data()
    ref = _reference(inner, x, y)
    guard = OomResplit(devices=3)
    seen = _dp_run(model, guard, x, y)
    # Device 1 (not the first, not the home device) ran out: only its cap is halved, and the
    # healthy devices ran their whole shares in the first micro-step.
    assert guard.micro_batch_sizes == [None, 3, None] and guard.resplits == 1
    assert seen == [[3, 3, 3], [0, 3, 0]]
    assert _rel(_grads(inner), ref) <= 1e-5
    model.zero_grad()
    assert _dp_run(model, guard, x, y) == seen and guard.resplits == 1  # the cap is reused
    assert _rel(_grads(inner), ref) <= 1e-5


def test_backward_oom_names_no_device_and_shrinks_every_share() -> None:
    torch.manual_seed(0)
    inner = OomNet(backward_limit=5)
    model = BalancedDataParallel(inner, ["cpu", "cpu", "cpu"])
    x, y = _data()
    ref = _reference(inner, x, y)
    guard = OomResplit(devices=3)
    assert _dp_run(model, guard, x, y) == [[2, 3, 2], [1, 3, 1]]
    assert guard.micro_batch_sizes == [2, 3, 2] and guard.resplits == 1
    assert _rel(_grads(inner), ref) <= 1e-5


def _oom_on(device: int) -> NoReturn:
    error = torch.OutOfMemoryError("injected")
    error.evendp_device_index = device  # type: ignore[attr-defined]
    raise error


def test_per_device_skip_accumulation_cap_and_bad_input() -> None:
    # The failing device is already at one sample: skip at once, even though device 0 could
    # still shrink (shrinking it would not help the device that ran out).
    guard = OomResplit(devices=2)
    loss = guard.run_shares([4, 1], lambda spans: _oom_on(1), weight=0.2, zero_grad=lambda: None)
    assert loss is None and guard.skipped == 1 and guard.resplits == 0
    assert guard.micro_batch_sizes == [None, None]
    # An index that names no device of this guard (or no attribute) shrinks every share.
    calls: list[list[tuple[int, int]]] = []

    def chunk_loss(spans: list[tuple[int, int]]) -> torch.Tensor:
        calls.append(spans)
        if len(calls) == 1:
            _oom_on(7)
        return torch.ones((), requires_grad=True)

    guard = OomResplit(devices=2)
    loss = guard.run_shares(
        [4, 2], chunk_loss, weight=1 / 6, zero_grad=lambda: None, micro_batch_sizes=[3, None]
    )
    assert loss is not None and torch.allclose(loss, torch.ones(()))
    # accumulation capped device 0 at 3; the OOM halved both: 3 -> 2, 2 -> 1
    assert guard.micro_batch_sizes == [2, 1]
    assert calls[1:] == [[(0, 2), (0, 1)], [(2, 4), (1, 2)]]
    with pytest.raises(EvendpError, match="3 shares"):
        guard.run_shares([1, 1, 1], chunk_loss, weight=1.0, zero_grad=lambda: None)
    with pytest.raises(EvendpError, match="run_shares"):
        guard.run(2, lambda a, b: torch.ones(()), weight=1.0, zero_grad=lambda: None)
    with pytest.raises(EvendpError, match="devices"):
        OomResplit(devices=0)


# --- DDP on gloo: 2 processes, spawned once for the module ---------------------------------

SIZES = [7, 5]  # uneven shares of N = 12


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    x, y = _data()
    start = sum(SIZES[:rank])
    xs, ys = x[start : start + SIZES[rank]], y[start : start + SIZES[rank]]
    world = dist.get_world_size()

    def run(model: nn.Module, guard: OomResplit) -> torch.Tensor | None:
        model.zero_grad()
        loss = guard.run(
            len(xs),
            lambda a, b: nn.functional.cross_entropy(model(xs[a:b]), ys[a:b]),
            weight=world / N,
            zero_grad=model.zero_grad,
        )
        all_reduce_gradients(model.parameters())
        return loss

    # 1) OOM on rank 0 only (forward above 2 samples): exact gradient on both ranks.
    torch.manual_seed(0)
    model = OomNet(forward_limit=2 if rank == 0 else 10**9)
    guard = OomResplit()
    loss = run(model, guard)
    results["oom_one_rank"] = (_grads(model).clone(), guard.resplits, loss is None)
    # 2) OOM in backward on rank 1 only.
    model.forward_limit, model.backward_limit = 10**9, (1 if rank == 1 else 10**9)
    guard = OomResplit()
    loss = run(model, guard)
    results["oom_backward"] = (_grads(model).clone(), guard.resplits, loss is None)
    # 3) Rank 1 cannot fit even one sample: both ranks skip, neither hangs.
    model.backward_limit = 10**9
    model.forward_limit = 0 if rank == 1 else 10**9
    guard = OomResplit()
    loss = guard.run(
        len(xs),
        lambda a, b: nn.functional.cross_entropy(model(xs[a:b]), ys[a:b]),
        weight=world / N,
        zero_grad=model.zero_grad,
    )
    results["skip"] = (loss is None, guard.skipped)
    # Both ranks still talk afterwards: one more collective completes.
    t = torch.ones(1)
    dist.all_reduce(t)
    results["after"] = float(t.item())
    torch.save(results, Path(out) / f"rank{rank}.pt")
    finish_distributed()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("oom_ddp")
    return run_ranks(_worker, 2, out, 120, "DDP OOM workers")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["oom_one_rank", "oom_backward"])
def test_ddp_oom_on_one_rank_gives_the_exact_gradient(
    ddp_results: list[dict[str, Any]], case: str
) -> None:
    torch.manual_seed(0)
    model = OomNet()
    x, y = _data()
    ref = _reference(model, x, y)
    (g0, resplits0, skipped0), (g1, resplits1, skipped1) = (r[case] for r in ddp_results)
    assert not skipped0 and not skipped1
    assert (resplits0 > 0) != (resplits1 > 0)  # exactly one rank re-split
    assert _rel(g0, ref) <= 1e-5 and _rel(g1, ref) <= 1e-5


@pytest.mark.multiprocess
def test_ddp_ranks_agree_to_skip_and_do_not_hang(ddp_results: list[dict[str, Any]]) -> None:
    assert [r["skip"] for r in ddp_results] == [(True, 1), (True, 1)]
    assert [r["after"] for r in ddp_results] == [2.0, 2.0]


def test_min_micro_steps_runs_empty_micro_steps_with_zero_not_nan_gradients() -> None:
    # A DDP rank with no samples must still run forward and backward; the mean loss of an
    # empty batch is NaN, and the padded step must leave zero (not NaN, not None) gradients.
    net = nn.Linear(5, 3)
    x, y = torch.randn(0, 5), torch.zeros(0, dtype=torch.long)
    guard = OomResplit()
    seen = []

    def chunk_loss(spans: list[tuple[int, int]]) -> torch.Tensor:
        seen.append((guard.micro_step, guard.micro_steps, spans))
        a, b = spans[0]
        return nn.functional.cross_entropy(net(x[a:b]), y[a:b])

    total = guard.run_shares(
        [0], chunk_loss, weight=1.0, zero_grad=net.zero_grad, min_micro_steps=2
    )
    assert seen == [(0, 2, [(0, 0)]), (1, 2, [(0, 0)])]
    assert total is not None and float(total) == 0.0
    for p in net.parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))
    with pytest.raises(EvendpError, match="min_micro_steps"):
        guard.run_shares([1], chunk_loss, weight=1.0, zero_grad=net.zero_grad, min_micro_steps=-1)


def test_the_guards_count_of_the_attempts_micro_steps_is_micro_steps() -> None:
    """issue 33: one meaning per name; ``micro_step_count`` is the strategies' agreement (a
    method), the guard's count of the attempt's micro-steps is ``micro_steps``."""
    guard = OomResplit()
    guard.run(4, lambda a, b: torch.ones((), requires_grad=True), weight=0.25,
              zero_grad=lambda: None, micro_batch_size=2)  # fmt: skip
    assert guard.micro_steps == 2 and not hasattr(guard, "micro_step_count")
