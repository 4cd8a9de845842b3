"""``evendp train --balance speed``: torchrun ranks re-split by speed; refused with --mode dp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evendp.cli import main
from tests.cli.test_train import SMALL


@pytest.mark.multiprocess
def test_ddp_speed_balance_trains_the_same_global_batch(tmp_path: Path) -> None:
    code = main(
        ["train", "--mode", "ddp", "--balance", "speed", "--devices", "cpu,cpu", "--batch", "8",
         "--steps", "5", "--out", str(tmp_path), "--no-progress", "--no-plan", *SMALL]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 5 and report["global_batch"] == 8  # whatever the split


def test_speed_balance_needs_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--mode", "dp", "--balance", "speed", "--devices", "cpu,cpu"]) == 2
    err = capsys.readouterr().err
    assert "--balance speed balances ranks; use it with --mode ddp or fsdp2" in err
    assert "Traceback" not in err
