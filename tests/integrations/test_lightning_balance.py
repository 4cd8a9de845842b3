"""Lightning's ``SpeedBalance`` callback and ``uneven_dataloader(costs=)`` in one process.

The callback finds evendp's sampler in the fit's own training loader (through the relay
Lightning reaches) and runs beside ``UnevenGradient``; one process has no ranks to balance, so
its split stays. A loader not built by ``uneven_dataloader`` is refused naming the fix.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import evendp
from tests._helpers import require
from tests.integrations._tiny import Data, make_model

require("lightning")


def _fit(loader: Any, callback: Any, optimizer_s: float = 0.0) -> Any:
    import lightning.pytorch as pl

    from evendp.integrations.lightning import UnevenGradient

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.rows: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            self.rows.append(len(y))
            return F.cross_entropy(self.net(x), y, reduction="sum")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            # A slow update (a CPU-offloaded optimizer): after Lightning's closure (the
            # training_step and backward run inside optimizer.step), so a post-hook.
            if optimizer_s:
                optimizer.register_step_post_hook(lambda *_: time.sleep(optimizer_s))
            return optimizer

        def train_dataloader(self) -> Any:
            return loader

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, use_distributed_sampler=False,
        callbacks=[UnevenGradient(reduction="sum"), callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return module


def test_speed_balance_finds_the_sampler_and_costs_reach_it() -> None:
    from evendp.integrations.lightning import SpeedBalance, uneven_dataloader

    lengths = [3, 9, 1, 4, 4, 8, 2, 7, 5, 6]
    loader = uneven_dataloader(Data(), [4], costs=lengths, max_tokens=12, shuffle=False)
    callback = SpeedBalance(warmup=2)
    module = _fit(loader, callback)
    steps = [len(b) for b in evendp.UnevenBatchSampler(10, [1], rank=0, shuffle=False,
                                                       costs=lengths, max_tokens=12)]  # fmt: skip
    assert module.rows == steps  # the token budget cut the steps, not batch_sizes=[4]
    assert callback.balancer.history == []  # one process: nothing moved


def test_speed_balance_refuses_a_foreign_loader() -> None:
    from evendp.integrations.lightning import SpeedBalance

    plain = torch.utils.data.DataLoader(Data(), batch_size=4)
    with pytest.raises(evendp.EvendpError, match="uneven_dataloader"):
        _fit(plain, SpeedBalance())


def test_speed_balance_times_the_optimizer_step_too() -> None:
    """Issue 37: a rank slow only in its update must look slow; the callback times the update
    beside ``training_step`` (before, the forward alone: the sleep below went unseen)."""
    from evendp.integrations.lightning import SpeedBalance, uneven_dataloader

    seen: list[tuple[float, float]] = []  # each exchange's (seconds, samples) of this rank

    def gather(mine: tuple[float, float]) -> list[tuple[float, float]]:
        seen.append(mine)
        return [mine]

    class Recording(SpeedBalance):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # One process has no ranks to balance: a balancer that records what it is given.
            from evendp.integrations._speed import resizable

            sampler = resizable(trainer.train_dataloader)
            self.balancer = evendp.SpeedBalancer(sampler.batch_sizes, warmup=10**6, gather=gather)

    loader = uneven_dataloader(Data(), [4], shuffle=False)
    _fit(loader, Recording(), optimizer_s=0.05)
    assert len(seen) >= 2  # exchanges after the first (dropped) step
    # From the second exchange on, each holds one update (timed until its batch ends).
    assert all(seconds >= 0.05 for seconds, _ in seen[1:])
