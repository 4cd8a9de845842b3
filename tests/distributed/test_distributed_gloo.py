"""Exact gradients under DDP and FSDP2 with uneven per-rank batches, on gloo with 3 CPU processes.

The workers are spawned ONCE for the module (fixture ``results``); they run every case and
save what they measured, and the tests below assert on it. Each worker also computes the
single-process reference (the full global batch through the same initial model) itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from evendp._distributed._collate import EmptySafeCollate
from evendp._distributed._group import ddp_loss, finish_distributed, global_count, global_mean
from evendp._distributed._sampler import UnevenBatchSampler
from tests._helpers import free_port
from tests._pool import RANKS

pytestmark = pytest.mark.multiprocess

WORLD = 3
IGNORE = -100
TOL = 1e-5


# --- cases, generated in the parent ----------------------------------------------------------


def _collect(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """``n`` examples of ``strategy``, drawn deterministically by hypothesis in this process."""
    found: list[Any] = []

    @settings(
        max_examples=n, database=None, deadline=None, derandomize=True, phases=[Phase.generate]
    )
    @given(strategy)
    def collect(example: Any) -> None:
        found.append(example)

    collect()
    return found


SIZES = st.lists(st.integers(0, 6), min_size=WORLD, max_size=WORLD).filter(lambda s: sum(s) > 0)
# Per rank, per micro-step sample counts for one accumulated step (3 micro-steps).
MICRO = st.lists(
    st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=WORLD, max_size=WORLD
).filter(lambda c: sum(map(sum, c)) > 0)


def _cases() -> dict[str, Any]:
    fixed = [[0, 4, 0], [3, 0, 5], [1, 1, 1], [6, 2, 0]]
    generated = _collect(st.tuples(SIZES, st.integers(0, 9)), 10)
    return {
        "grad": [(s, 5) for s in fixed] + generated,  # (sizes, extra samples -> partial step)
        "micro": [[[2, 0, 3], [4, 1, 0], [0, 0, 2]], *_collect(MICRO, 4)],
    }


# --- the model, data and reference -----------------------------------------------------------


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _data(n: int, seed: int, ignore: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    if ignore:  # token-style targets: some positions do not count
        y[torch.rand(n, generator=g) < 0.3] = IGNORE
    return x, y


def _ref_grads(seed: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of the global mean loss on one process, flattened."""
    model = _model(seed)
    F.cross_entropy(model(x), y, ignore_index=IGNORE).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def _flat_grads(model: nn.Module) -> torch.Tensor:
    out = []
    for p in model.parameters():
        g = p.grad
        assert g is not None
        if hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor (collective: same order)
            g = g.full_tensor()
        out.append(g.reshape(-1))
    return torch.cat(out)


def _flat_params(model: nn.Module) -> torch.Tensor:
    out = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.reshape(-1))
    return torch.cat(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        return DDP(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _no_sync(kind: str, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
    """DDP: ``no_sync()`` on all but the last micro-step; FSDP2: the same via a flag."""
    if kind == "ddp":
        return contextlib.nullcontext() if sync else model.no_sync()  # type: ignore[operator]
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    return contextlib.nullcontext()


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --- the checks each worker runs -------------------------------------------------------------


def _check_grad_case(kind: str, sizes: list[int], extra: int, seed: int) -> list[float]:
    """Every step of one epoch: the uneven step's gradient vs the full-batch gradient."""
    n = max(sum(sizes) + extra, WORLD)
    x, y = _data(n, seed, ignore=seed % 2 == 1)
    model = _wrap(kind, _model(seed))
    errors = []
    for batch in UnevenBatchSampler(n, sizes, seed=seed):  # rank/world from the process group
        model.zero_grad(set_to_none=True)
        xb, yb = x[batch], y[batch]  # a size-0 rank still runs forward on its empty batch
        local_sum = F.cross_entropy(model(xb), yb, ignore_index=IGNORE, reduction="sum")
        ddp_loss(local_sum, (yb != IGNORE).sum()).backward()
        everything = [i for part in _gather(batch) for i in part]
        if (y[everything] != IGNORE).any():
            errors.append(_rel(_flat_grads(model), _ref_grads(seed, x[everything], y[everything])))
        else:  # nothing counts anywhere: ddp_loss gives a zero gradient, not NaN
            errors.append(float(_flat_grads(model).abs().max()))
    return errors


def _check_naive() -> dict[str, float]:
    """Mean per rank + DDP's 1/world averaging is wrong for uneven sizes; ddp_loss is right."""
    sizes, n = [1, 6, 3], 10
    x, y = _data(n, 123)
    batch = next(iter(UnevenBatchSampler(n, sizes, seed=1)))
    everything = [i for part in _gather(batch) for i in part]
    ref = _ref_grads(0, x[everything], y[everything])
    out = {}
    for name in ("naive", "evendp"):
        model = DDP(_model(0))
        if name == "naive":
            F.cross_entropy(model(x[batch]), y[batch]).backward()
        else:
            s = F.cross_entropy(model(x[batch]), y[batch], reduction="sum")
            ddp_loss(s, len(batch)).backward()
        out[name] = _rel(_flat_grads(model), ref)
    return out


def _check_training(kind: str, switch: list[int] | None = None) -> dict[str, Any]:
    """Optimizer steps through DataLoader + UnevenBatchSampler vs single-process training.

    ``switch``: new sizes set after the second step (as a speed balancer would, on all ranks).
    """
    sizes, n, seed = [2, 0, 5], 30, 11  # 5 steps; the last one has 2 samples
    x, y = _data(n, seed)
    data = TensorDataset(x, y, torch.arange(n))  # the index rides along to rebuild the step
    sampler = UnevenBatchSampler(data, sizes, seed=seed)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))
    model = _wrap(kind, _model(seed))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_model = _model(seed)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.2, momentum=0.9)
    losses, ref_losses, batch_shapes, seen = [], [], [], []
    for step, (xb, yb, ib) in enumerate(loader):
        batch_shapes.append(tuple(xb.shape))
        opt.zero_grad(set_to_none=True)
        local_sum = F.cross_entropy(model(xb), yb, reduction="sum")
        # DDP all-reduces the count; FSDP2 takes it from the sampler (no communication).
        total = None if kind == "ddp" else sampler.samples_in_step(step)
        ddp_loss(local_sum, len(yb), total).backward()
        opt.step()
        losses.append(float(global_mean(local_sum, len(yb))))
        everything = [i for part in _gather(ib.tolist()) for i in part]
        seen += everything
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = F.cross_entropy(ref_model(x[everything]), y[everything])
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
        if switch is not None and step == 1:
            sampler.set_batch_sizes(switch)
    params = _flat_params(model)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_rel": _rel(params, _flat_params(ref_model)),
        "params_all_ranks": _gather(params),
        "batch_shapes": batch_shapes,
        "seen": sorted(seen),
    }


def _check_accumulation(kind: str, counts: list[list[int]], seed: int) -> float:
    """3 micro-steps, no gradient sync but on the last; counts differ by rank and micro-step."""
    total = sum(map(sum, counts))
    x, y = _data(total, seed, ignore=True)
    if not (y != IGNORE).any():
        y[0] = 0  # at least one target that counts
    rank = dist.get_rank()
    start = sum(map(sum, counts[:rank]))
    micro = []
    for c in counts[rank]:
        micro.append((x[start : start + c], y[start : start + c]))
        start += c
    model = _wrap(kind, _model(seed))
    # The global count of the WHOLE accumulated step, all-reduced once, before any backward.
    total_count = global_count(sum(int((yb != IGNORE).sum()) for _, yb in micro))
    for i, (xb, yb) in enumerate(micro):
        with _no_sync(kind, model, sync=i == len(micro) - 1):
            s = F.cross_entropy(model(xb), yb, ignore_index=IGNORE, reduction="sum")
            ddp_loss(s, (yb != IGNORE).sum(), total_count).backward()
    return _rel(_flat_grads(model), _ref_grads(seed, x, y))


def _worker(rank: int, port: int, cases: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    res: dict[str, Any] = {"grad": {}, "training": {}, "accumulation": {}}
    try:
        for kind in ("ddp", "fsdp"):
            res["grad"][kind] = [
                (sizes, _check_grad_case(kind, sizes, extra, seed))
                for seed, (sizes, extra) in enumerate(cases["grad"])
            ]
            res["training"][kind] = _check_training(kind)
            res["accumulation"][kind] = [
                (c, _check_accumulation(kind, c, seed)) for seed, c in enumerate(cases["micro"])
            ]
        res["training"]["ddp-switch"] = _check_training("ddp", switch=[1, 4, 3])
        res["naive"] = _check_naive()
        sampler = UnevenBatchSampler(40, [3, 0, 5], seed=4)
        res["sampler"] = {"rank": sampler.rank, "batches": list(sampler)}
    finally:
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finish_distributed()  # reached on success only: a failed rank meets no barrier


# --- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp_gloo")
    RANKS.run(_worker, WORLD, (free_port(), _cases(), str(out)), 300, "gloo exactness ranks")
    yield [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


KINDS = ["ddp", "fsdp"]


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_gradient_equals_full_batch(results: list[dict[str, Any]], kind: str) -> None:
    checked = 0
    for res in results:
        for sizes, errors in res["grad"][kind]:
            assert errors, sizes
            assert max(errors) <= TOL, (sizes, errors)
            checked += len(errors)
    cases = [sizes for sizes, _ in results[0]["grad"][kind]]
    assert any(0 in s for s in cases) and any(0 not in s for s in cases)  # zeros were covered
    assert checked >= 2 * len(cases) * WORLD  # every case had at least two steps


@pytest.mark.parametrize("kind", KINDS)
def test_five_step_training_matches_single_process(
    results: list[dict[str, Any]], kind: str
) -> None:
    for res in results:
        t = res["training"][kind]
        assert len(t["losses"]) == 5
        torch.testing.assert_close(t["losses"], t["ref_losses"], rtol=TOL, atol=0)
        assert t["param_rel"] <= TOL
        assert t["ref_losses"][-1] < t["ref_losses"][0]  # it trained
        assert t["seen"] == list(range(30))
    # Rank 1 has batch size 0: DataLoader gave it empty (0, 5) batches every step.
    assert results[1]["training"][kind]["batch_shapes"] == [(0, 5)] * 5
    assert [s[0] for s in results[0]["training"][kind]["batch_shapes"]] == [2, 2, 2, 2, 1]


def test_changing_sizes_mid_epoch_stays_exact(results: list[dict[str, Any]]) -> None:
    for res in results:
        t = res["training"]["ddp-switch"]
        torch.testing.assert_close(t["losses"], t["ref_losses"], rtol=TOL, atol=0)
        assert t["param_rel"] <= TOL
        assert t["seen"] == list(range(30))  # every sample once despite the change
    # 2 steps of [2, 0, 5] (14 samples), then 16 samples at [1, 4, 3]: 2 more steps.
    shapes = [[s[0] for s in res["training"]["ddp-switch"]["batch_shapes"]] for res in results]
    assert shapes == [[2, 2, 1, 1], [0, 0, 4, 4], [5, 5, 3, 3]]


def test_parameters_identical_across_ranks_after_training(results: list[dict[str, Any]]) -> None:
    params = results[0]["training"]["ddp"]["params_all_ranks"]
    for p in params[1:]:
        assert torch.equal(p, params[0])


@pytest.mark.parametrize("kind", KINDS)
def test_accumulation_with_no_sync_is_exact(results: list[dict[str, Any]], kind: str) -> None:
    for res in results:
        for counts, err in res["accumulation"][kind]:
            assert err <= TOL, (counts, err)


def test_naive_per_rank_mean_is_wrong_and_ddp_loss_fixes_it(
    results: list[dict[str, Any]],
) -> None:
    for res in results:
        assert res["naive"]["naive"] > 1e-2  # far from the full-batch gradient
        assert res["naive"]["evendp"] <= TOL


def test_sampler_takes_rank_from_process_group(results: list[dict[str, Any]]) -> None:
    assert [res["sampler"]["rank"] for res in results] == list(range(WORLD))
    steps = {len(res["sampler"]["batches"]) for res in results}
    assert steps == {5}
    seen = sorted(i for res in results for b in res["sampler"]["batches"] for i in b)
    assert seen == list(range(40))
