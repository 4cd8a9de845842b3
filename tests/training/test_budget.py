"""Budgeted virtual devices: the even split really runs out on the small device, the planned
split does not, and only the replica's own forward allocations count."""

from __future__ import annotations

import threading

import pytest
import torch

from evendp import BalancedDataParallel, EvendpError
from evendp._core._oom_errors import is_oom_error
from evendp._planning._planner import plan
from evendp._training._budget import MemoryBudgets, ReplicaMemory, tensor_bytes
from evendp._training._trainer import _LossModule, default_loss
from evendp.cli._model_spec import gpt_batch
from evendp.examples.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)
MEMORY = "4MiB,4MiB,2MiB"


@pytest.fixture(scope="module")
def planned() -> object:
    return plan(lambda: GPT(CONFIG), gpt_batch(CONFIG), MEMORY, batch_size=72, cuda_context=0)


def _budgeted_dp() -> tuple[BalancedDataParallel, MemoryBudgets]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    params = tensor_bytes(list(model.parameters()))
    dp = BalancedDataParallel(_LossModule(model, default_loss), ["cpu"] * 3)
    budgets = MemoryBudgets(MEMORY.split(","), resident=[params] * 3).attach(dp)
    return dp, budgets


def _run(dp: BalancedDataParallel, sizes: list[int]) -> torch.Tensor:
    x = torch.randint(0, CONFIG.vocab_size, (sum(sizes), CONFIG.block_size))
    with dp.fixed_sizes(sizes):
        loss = dp(x, x)
    loss.backward()
    return loss


def test_even_split_runs_out_on_the_small_device_and_the_planned_split_fits(
    planned: object,
) -> None:
    split = planned.split  # type: ignore[attr-defined]
    assert sum(split) == 72 and split[2] < 24 < max(split)
    dp, budgets = _budgeted_dp()
    _run(dp, split)  # within every budget
    peaks = budgets.peaks
    assert all(p is not None and p <= b for p, b in zip(peaks, budgets.budgets, strict=True))
    with pytest.raises(torch.OutOfMemoryError, match="virtual device vdev:2") as caught:
        _run(dp, [24, 24, 24])  # what nn.DataParallel would run
    assert is_oom_error(caught.value) and caught.value.evendp_device_index == 2  # type: ignore[attr-defined]
    assert budgets.ooms == [0, 0, 1]


def test_planned_peak_is_close_to_the_enforced_forward_peak(planned: object) -> None:
    # The planner's forward+backward peak for a replica vs what its forward really held.
    dp, budgets = _budgeted_dp()
    split = planned.split  # type: ignore[attr-defined]
    _run(dp, split)
    for device, peak in zip(planned.devices[1:], budgets.peaks[1:], strict=True):  # type: ignore[attr-defined]
        assert peak is not None and peak <= device.peak * 1.05


def test_only_this_threads_allocations_count() -> None:
    other: list[torch.Tensor] = []
    with ReplicaMemory("d", budget=None, resident=100) as mem:
        t = threading.Thread(target=lambda: other.append(torch.zeros(1000)))
        t.start()
        t.join()
        mine = torch.zeros(10)  # 40 bytes
        view = mine[:5]  # a view allocates nothing
        mine.add_(1)  # in place: nothing new
    assert mem.live == 140 and mem.peak == 140
    del mine, view
    assert mem.live == 100  # freed storages leave the count


def test_bad_budgets_are_named() -> None:
    with pytest.raises(EvendpError, match="one per device"):
        MemoryBudgets("24MiB")
    dp = BalancedDataParallel(torch.nn.Linear(2, 2), ["cpu"] * 2)
    with pytest.raises(EvendpError, match="3 budgets for 2 devices"):
        MemoryBudgets(["1MiB"] * 3).attach(dp)
