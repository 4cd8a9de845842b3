"""The shipped loggers from a library Trainer run: TensorBoard event files read back, CSV,
MLflow on a local file store, and W&B's missing-package line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from evendp import (
    CSVLogger,
    EvendpError,
    MLflowLogger,
    TensorBoardLogger,
    TrainConfig,
    Trainer,
    WandbLogger,
)

DATA = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.randn(24))


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return ((model(batch[0]).squeeze(1) - batch[1]) ** 2).mean()


def _fit(callback: Any, steps: int = 4, **kw: Any) -> Any:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps, batch_size=6, progress=False, log_every=1, lr=0.1, **kw)
    return Trainer(
        nn.Linear(3, 1), DATA, cfg, device_ids=["cpu", "cpu"], weights=[2, 1], loss_fn=_mse,
        eval_data=DATA, callbacks=[callback],
    ).fit()  # fmt: skip


def test_tensorboard_logger_writes_the_runs_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = _fit(TensorBoardLogger(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx(report.losses, rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.1] * 4)
    (val,) = events.Scalars("val/loss")
    assert val.step == 4 and val.value == pytest.approx(report.eval[-1]["metrics"]["loss"])


def test_csv_logger_rows_and_a_resumed_run_keeps_the_earlier_ones(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    report = _fit(CSVLogger(path), steps=3)
    rows = path.read_text().splitlines()
    assert rows[0] == "step,loss,lr,val/loss"
    assert [float(r.split(",")[1]) for r in rows[1:]] == pytest.approx(report.losses, rel=1e-6)
    assert rows[-1].split(",")[3] != "" and rows[1].split(",")[3] == ""
    # A resumed run writing from step 3 on: steps 1-2 stay, step 3 is the new run's.
    log = CSVLogger(path)
    log.log_metrics({"loss": 9.0}, step=3)
    assert [r.split(",")[:2] for r in path.read_text().splitlines()[1:]] == [
        rows[1].split(",")[:2], rows[2].split(",")[:2], ["3", "9.0"],
    ]  # fmt: skip


def test_csv_logger_replaces_a_link_at_its_path_never_writes_through_it(tmp_path: Path) -> None:
    """Issue 34: metrics.csv planted as a symbolic or a hard link to another user's file."""
    for plant in (os.symlink, os.link):
        theirs, path = tmp_path / f"theirs.{plant.__name__}", tmp_path / f"{plant.__name__}.csv"
        theirs.write_text("step,theirs\n1,2\n")
        plant(theirs, path)
        log = CSVLogger(path)
        for step in (1, 2, 3):  # the first row writes the file anew, the next ones append
            log.log_metrics({"loss": 1.0 / step}, step=step)
        assert theirs.read_text() == "step,theirs\n1,2\n", plant
        assert not path.is_symlink() and path.stat().st_nlink == 1
        assert [r.split(",")[0] for r in path.read_text().splitlines()] == ["step", "1", "2", "3"]


@pytest.mark.timeout(60)
def test_a_resumed_csv_logger_keeps_no_rows_from_a_link_or_a_fifo(tmp_path: Path) -> None:
    """A resumed run keeps the earlier rows of its own metrics.csv; a hard link planted there
    (to another user's file) is not read into ours, and a FIFO there does not hang it."""
    own = tmp_path / "own.csv"
    own.write_text("step,loss\n1,0.5\n2,0.4\n")
    theirs, linked, fifo = tmp_path / "theirs.csv", tmp_path / "linked.csv", tmp_path / "fifo.csv"
    theirs.write_text("step,secret\n1,hunter2\n")
    os.link(theirs, linked)
    os.mkfifo(fifo)
    for path, kept in ((own, ["1", "2"]), (linked, []), (fifo, [])):
        CSVLogger(path).log_metrics({"loss": 0.3}, step=3)  # resumed at step 3
        rows = path.read_text().splitlines()
        assert [r.split(",")[0] for r in rows[1:]] == [*kept, "3"], (path, rows)
        assert "hunter2" not in path.read_text()
    assert theirs.read_text() == "step,secret\n1,hunter2\n"


def test_mlflow_logger_on_a_local_file_store(tmp_path: Path) -> None:
    uri = (tmp_path / "mlruns").as_uri()
    with mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true"):
        log = MLflowLogger(tracking_uri=uri, experiment="test", run_name="r")
        report = _fit(log)
        history = log.client.get_metric_history(log.run_id, "train/loss")
        run = log.client.get_run(log.run_id)
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert [m.value for m in history] == pytest.approx(report.losses, rel=1e-6)
    assert run.data.params["batch_size"] == "6" and run.info.status == "FINISHED"


def test_wandb_logger_without_wandb_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(EvendpError, match="pip install wandb"):
        WandbLogger(project="x", mode="offline")


def test_budgeted_devices_log_their_measured_peaks(tmp_path: Path) -> None:
    from evendp._training._rehearse import attach_budgets

    torch.manual_seed(0)
    cfg = TrainConfig(steps=2, batch_size=6, progress=False, log_every=1)
    log = CSVLogger(tmp_path / "m.csv")
    trainer = Trainer(
        nn.Linear(3, 1), DATA, cfg, device_ids=["cpu", "cpu"], loss_fn=_mse, callbacks=[log]
    )
    attach_budgets(trainer, [2**20, 2**20])
    report = trainer.fit()
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    assert header == ["step", "loss", "lr", "memory/cpu:0", "memory/cpu:1"]
    peaks = [d.peak_bytes for d in report.devices]
    assert all(p and p < 2**20 for p in peaks)
    assert [d.budget_bytes for d in report.devices] == [2**20, 2**20]
    assert (
        "-" not in trainer.recorder.memory_text() and trainer.recorder.memory_text().count("/") == 1
    )
