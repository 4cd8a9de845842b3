"""Trainer callbacks: every hook point, in order, with the loss read only on logged steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from evendp import Callback, EvendpError, TrainConfig, Trainer

DATA = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.randn(24))


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return ((model(batch[0]).squeeze(1) - batch[1]) ** 2).mean()


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_fit_start(self, trainer: Any) -> None:
        self.calls.append(("fit_start",))

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.calls.append(("step", step))

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.calls.append(("log", step, sorted(metrics)))

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.calls.append(("eval", step, sorted(metrics)))

    def on_save(self, trainer: Any, step: int, path: Any) -> None:
        self.calls.append(("save", step, Path(path).name))

    def on_fit_end(self, trainer: Any, report: Any) -> None:
        self.calls.append(("fit_end", report.steps))


def test_every_hook_runs_at_its_point_in_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(
        steps=4, batch_size=6, progress=False, log_every=2, eval_every=2, checkpoint_every=3,
        out_dir=tmp_path,
    )  # fmt: skip
    rec = Recorder()
    report = Trainer(
        nn.Linear(3, 1), DATA, cfg, device_ids=["cpu", "cpu"], loss_fn=_mse,
        eval_data=DATA, callbacks=[rec],
    ).fit()  # fmt: skip
    logged = ["loss", "lr"]
    assert rec.calls == [
        ("fit_start",),
        ("log", 1, logged), ("step", 1),
        ("log", 2, logged), ("step", 2), ("eval", 2, ["loss"]),
        ("step", 3), ("save", 3, "ckpt.pt"),
        ("log", 4, logged), ("step", 4), ("eval", 4, ["loss"]), ("save", 4, "ckpt.pt"),
        ("fit_end", 4),
    ]  # fmt: skip
    assert report.steps == 4


def test_on_log_gets_the_steps_loss_as_the_report_has_it() -> None:
    torch.manual_seed(0)
    seen: dict[int, float] = {}

    class Losses:  # no base class needed: any object with some hooks
        def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            seen[step] = metrics["loss"]

    cfg = TrainConfig(steps=3, batch_size=6, progress=False, log_every=1, lr=0.1)
    report = Trainer(nn.Linear(3, 1), DATA, cfg, loss_fn=_mse, callbacks=[Losses()]).fit()
    assert [seen[s] for s in (1, 2, 3)] == pytest.approx(report.losses, rel=1e-6)


@pytest.mark.parametrize(
    ("callbacks", "words"),
    [("tb", "must be a list"), ([object()], "has none of the hooks")],
)
def test_bad_callbacks_are_refused_naming_the_fix(callbacks: Any, words: str) -> None:
    cfg = TrainConfig(steps=1, batch_size=6, progress=False)
    with pytest.raises(EvendpError, match=words):
        Trainer(nn.Linear(3, 1), DATA, cfg, loss_fn=_mse, callbacks=callbacks)
