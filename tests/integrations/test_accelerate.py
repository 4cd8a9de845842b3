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
    make_model,
    reference_update_error,
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
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    evendp.finish_distributed()


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


def test_refuses_sizes_that_do_not_match_the_processes() -> None:
    from accelerate import Accelerator

    from evendp.integrations.accelerate import uneven_dataloader

    with pytest.raises(evendp.EvendpError, match=r"2 batch sizes \[1, 3\] for 1 processes"):
        uneven_dataloader(Accelerator(cpu=True), Data(), SIZES)
    with pytest.raises(evendp.EvendpError, match="sequence of non-negative ints"):
        uneven_dataloader(Accelerator(cpu=True), Data(), "1,3")  # type: ignore[arg-type]
