"""``uneven_dataloader`` on 2 gloo ranks with sizes [1, 3]: batches, coverage and exact training.

One spawn: each rank trains 2 epochs with the documented accumulation recipe and records the
sample indices of every batch; the tests compare them with each rank's own
``UnevenBatchSampler`` and the parameters with one process training on the same windows.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import evendp
from tests._helpers import run_ranks, torchrun_env
from tests.integrations._tiny import (
    ACCUM,
    EPOCHS,
    LR,
    SAMPLES,
    SEED,
    Data,
    RejectsEmpty,
    make_model,
    reference_run,
    reference_update_error,
    warmup,
)

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")

SIZES = [1, 3]
TOL = 1e-5


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    from accelerate import Accelerator

    from evendp.integrations.accelerate import uneven_dataloader

    accelerator = Accelerator(cpu=True)
    loader = uneven_dataloader(accelerator, Data(), SIZES, seed=SEED)
    again = accelerator.prepare(loader)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen: list[list[list[int]]] = []
    for _epoch in range(EPOCHS):
        seen.append([])
        batches = iter(loader)
        while window := list(itertools.islice(batches, ACCUM)):
            # The recipe: count the window's samples on all ranks, then sum-losses scaled.
            total = evendp.global_count(sum(len(y) for _, y, _ in window))
            for i, (x, y, idx) in enumerate(window):
                seen[-1].append(idx.tolist())
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    local_sum = F.cross_entropy(model(x), y, reduction="sum")
                    accelerator.backward(evendp.ddp_loss(local_sum, len(y), total))
            optimizer.step()
            optimizer.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    result = {
        "world": accelerator.num_processes,
        "prepared_again_is_same": again is loader,
        "seen": seen,
        "params": params,
        "standard": {"ranks": _standard_loop(list(SIZES)), "zero": _standard_loop([0, 4])},
        "plain_lrs": _plain_scheduler_lrs(),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    evendp.finish_distributed()


def _standard_loop(sizes: list[int]) -> dict[str, Any]:
    """A standard Accelerate loop as users write it, on UnevenAccelerator: the model's mean loss,
    ``accumulate``, ``backward``, a warm-up scheduler stepped every batch; 9 samples, so the
    short last step [0, 1] leaves rank 0 nothing; the model refuses 0 rows."""
    from evendp.integrations.accelerate import UnevenAccelerator, uneven_dataloader

    accelerator = UnevenAccelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    nine = torch.utils.data.Subset(Data(), range(9))
    loader = uneven_dataloader(accelerator, nine, sizes, seed=SEED)
    model = RejectsEmpty()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    seen: list[list[list[int]]] = []
    lrs: list[float] = []
    for _epoch in range(EPOCHS):
        seen.append([])
        for x, y, idx in loader:
            seen[-1].append([] if evendp.is_stand_in(idx) else idx.tolist())
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    lrs.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {
        "seen": seen,
        "params": params,
        "lrs": lrs,
        "eval": _evaluation(accelerator, model, sizes),
    }


def _evaluation(
    accelerator: Any, model: torch.nn.Module, sizes: list[int]
) -> dict[str, torch.Tensor]:
    """An evaluation loop as users write it (issue 36): ``gather_for_metrics`` of each batch's
    indices and logits over an uneven loader of the 9 samples in order (5 a step, short
    last step, a stand-in wherever a rank's share is empty); and every logit, computed here."""
    from evendp.integrations.accelerate import uneven_dataloader

    nine = torch.utils.data.Subset(Data(), range(9))
    loader = uneven_dataloader(accelerator, nine, [2, 3] if sizes[0] else [0, 5], shuffle=False)
    indices, logits = [], []
    with torch.no_grad():
        for x, _, idx in loader:
            got_idx, got_logits = accelerator.gather_for_metrics((idx, model(x)))
            indices.append(got_idx)
            logits.append(got_logits)
        every = model(torch.stack([nine[i][0] for i in range(9)]))
    return {"indices": torch.cat(indices), "logits": torch.cat(logits), "every": every}


def _plain_scheduler_lrs() -> list[float]:
    """A plain Accelerator, the ddp_loss recipe and a warm-up scheduler prepared after the
    uneven loader, stepped after every optimizer step: each optimizer step's rate."""
    from accelerate import Accelerator

    from evendp.integrations.accelerate import uneven_dataloader

    accelerator = Accelerator(cpu=True)
    loader = uneven_dataloader(accelerator, Data(), SIZES, seed=SEED)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    lrs: list[float] = []
    for _epoch in range(EPOCHS):
        batches = iter(loader)
        while window := list(itertools.islice(batches, ACCUM)):
            total = evendp.global_count(sum(len(y) for _, y, _ in window))
            for x, y, _ in window:
                local_sum = F.cross_entropy(model(x), y, reduction="sum")
                accelerator.backward(evendp.ddp_loss(local_sum, len(y), total))
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return lrs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("acc"), 240, "accelerate ranks")


def test_each_rank_gets_exactly_its_own_batches(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        assert result["world"] == 2
        assert result["prepared_again_is_same"]
        sampler = evendp.UnevenBatchSampler(SAMPLES, SIZES, rank=rank, seed=SEED)
        for epoch, batches in enumerate(result["seen"]):
            sampler.set_epoch(epoch)
            assert batches == list(sampler)


def test_every_sample_once_per_epoch_in_a_new_order(ranks: list[dict[str, Any]]) -> None:
    orders = []
    for epoch in range(EPOCHS):
        steps = zip(*(r["seen"][epoch] for r in ranks), strict=True)
        order = [i for step in steps for batch in step for i in batch]
        assert sorted(order) == list(range(SAMPLES))
        orders.append(order)
    assert orders[0] != orders[1]  # set_epoch reached the sampler


def test_parameters_equal_one_process_on_the_same_windows(ranks: list[dict[str, Any]]) -> None:
    seen = [r["seen"] for r in ranks]
    for result in ranks:
        assert reference_update_error(seen, result["params"]) < TOL


@pytest.mark.parametrize("run", ["ranks", "zero"])
def test_a_standard_loop_with_a_scheduler_equals_one_process(
    ranks: list[dict[str, Any]], run: str
) -> None:
    """The user's mean loss and backward as they are; the LR follows one process's schedule."""
    seen = [r["standard"][run]["seen"] for r in ranks]
    assert any([] in s[0] for s in seen)  # an empty share ran, as a stand-in
    lrs: list[float] = []
    want, _ = reference_run(seen, lrs=lrs)
    start = [p.detach() for p in make_model().parameters()]
    for result in ranks:
        got = result["standard"][run]
        assert got["lrs"] == pytest.approx(lrs, rel=1e-12)
        num = sum(float((g - w).norm() ** 2) for g, w in zip(got["params"], want, strict=True))
        den = sum(float((w - s).norm() ** 2) for w, s in zip(want, start, strict=True))
        assert (num / den) ** 0.5 < TOL


@pytest.mark.parametrize("run", ["ranks", "zero"])
def test_gather_for_metrics_gives_each_row_once_in_order(
    ranks: list[dict[str, Any]], run: str
) -> None:
    """Issue 36: Accelerate's gather needs one shape on every rank and drops the rows it
    padded; the uneven loader's rows differ by rank and a stand-in must give none."""
    for result in ranks:
        got = result["standard"][run]["eval"]
        assert got["indices"].tolist() == list(range(9))
        torch.testing.assert_close(got["logits"], got["every"], rtol=1e-6, atol=1e-6)


def test_a_plain_accelerators_scheduler_steps_once_per_optimizer_step(
    ranks: list[dict[str, Any]],
) -> None:
    """Accelerate alone would step it num_processes times per call on the per-rank loader."""
    lrs: list[float] = []
    reference_run([r["seen"] for r in ranks], lrs=lrs)
    for result in ranks:
        assert result["plain_lrs"] == pytest.approx(lrs, rel=1e-12)


def test_refuses_sizes_that_do_not_match_the_processes() -> None:
    from accelerate import Accelerator

    from evendp.integrations.accelerate import uneven_dataloader

    with pytest.raises(evendp.EvendpError, match=r"2 batch sizes \[1, 3\] for 1 processes"):
        uneven_dataloader(Accelerator(cpu=True), Data(), SIZES)
    with pytest.raises(evendp.EvendpError, match="sequence of non-negative ints"):
        uneven_dataloader(Accelerator(cpu=True), Data(), "1,3")  # type: ignore[arg-type]


def test_uneven_backward_needs_the_uneven_loader() -> None:
    from evendp.integrations.accelerate import UnevenAccelerator

    accelerator = UnevenAccelerator(cpu=True)
    loss = torch.ones((), requires_grad=True) * 2
    with pytest.raises(evendp.EvendpError, match="uneven_dataloader"):
        accelerator.backward(loss)
