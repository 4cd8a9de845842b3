"""Reports after a resume count this run only: steps run, samples per device per step, global
batch, samples/s and time; on the same and on another device count, one process and DDP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from evendp._core._split import split_sizes
from evendp._distributed._group import finish_distributed
from evendp._training._report import TrainReport
from evendp._training._trainer import TrainConfig, Trainer
from tests._helpers import run_ranks
from tests.training.test_trainer import TinyLM, _data

BATCH = 12


def _fit(out: Path, steps: int, devices: int, resume: bool, **config: Any) -> TrainReport:
    torch.manual_seed(0)
    cfg = TrainConfig(
        steps=steps, batch_size=BATCH, out_dir=out, resume=resume, progress=False, **config
    )
    weights = [2.0] + [1.0] * (devices - 1)
    return Trainer(TinyLM(), _data(), cfg, device_ids=["cpu"] * devices, weights=weights).fit()


def _check_this_run(report: TrainReport, steps: int, ran: int, shares: list[int]) -> None:
    assert report.steps == steps and report.steps_run == report.ran == ran
    assert [d.samples_per_step for d in report.devices] == shares
    assert report.global_batch == sum(shares)
    # samples/s over this run's own samples and time
    assert report.samples_per_s * report.elapsed_s == pytest.approx(ran * sum(shares))
    assert f"{ran} steps (resumed at step {steps - ran}, now {steps})" in report.summary()
    assert f"{steps} steps ({ran} this run)" in report.title()


@pytest.mark.parametrize("devices", [3, 2], ids=["same-devices", "other-devices"])
def test_one_process_resume_reports_this_run(tmp_path: Path, devices: int) -> None:
    first = _fit(tmp_path, 6, 3, resume=False)
    assert first.ran == first.steps == 6 and "resumed" not in first.summary()
    again = _fit(tmp_path, 8, devices, resume=True)
    _check_this_run(again, 8, 2, split_sizes(BATCH, [2.0] + [1.0] * (devices - 1)))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["steps"] == 8 and saved["steps_run"] == 2 and saved["global_batch"] == BATCH


def _rank_worker(rank: int, port: int, out: str) -> None:
    phase = json.loads((Path(out) / "phase.json").read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=len(phase["sizes"]))
    torch.manual_seed(0)
    cfg = TrainConfig(
        steps=phase["steps"], batch_sizes=phase["sizes"], out_dir=str(Path(out) / "run"),
        resume=phase["resume"], progress=False, checkpoint_every=0,
    )  # fmt: skip
    report = Trainer(TinyLM(), _data(), cfg).fit()
    finish_distributed()  # frees the Trainer's DDP wrapper while the group is alive, then ends it
    torch.save(report, Path(out) / f"rank{rank}.pt")


def _ddp(out: Path, steps: int, sizes: list[int], resume: bool) -> TrainReport:
    (out / "phase.json").write_text(json.dumps({"steps": steps, "sizes": sizes, "resume": resume}))
    reports = run_ranks(_rank_worker, len(sizes), out, 150, "DDP resume workers")
    return reports[0]  # type: ignore[no-any-return]


@pytest.mark.multiprocess
def test_ddp_resume_reports_this_run_on_another_rank_count(tmp_path: Path) -> None:
    # The same rank count is checked through the CLI (tests/cli/test_train.py's DDP resume).
    first = _ddp(tmp_path, 4, [6, 6], resume=False)
    assert [d.samples_per_step for d in first.devices] == [6, 6] and first.ran == 4
    _check_this_run(_ddp(tmp_path, 6, [7, 3, 2], resume=True), 6, 2, [7, 3, 2])
