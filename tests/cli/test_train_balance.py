"""``evendp train --balance speed``: torchrun ranks re-split by speed; refused with --mode dp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evendp.cli import main
from tests._helpers import free_port
from tests.cli.test_train import SMALL


@pytest.mark.multiprocess
def test_ddp_speed_balance_trains_the_same_global_batch_on_two_machines(tmp_path: Path) -> None:
    """Two nodes of one rank each (issue 35: evendp train on several machines), as two
    machines run it: the same command, each with its --node-rank and its own --out. The speed
    balancer moves samples between the nodes' ranks; the global batch stays 8. One launch
    pair: the single-node speed balance runs in tests/planning/test_balance.py's pool."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        argv = ["train", "--mode", "ddp", "--balance", "speed", "--devices", "cpu", "--batch",
                "8", "--steps", "5", "--out", str(tmp_path / f"node{node}"), "--no-progress",
                "--no-plan", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                "127.0.0.1", "--master-port", port, *SMALL]  # fmt: skip
        command = [sys.executable, "-m", "evendp", *argv]
        out = subprocess.PIPE
        procs.append(subprocess.Popen(command, text=True, stdout=out, stderr=subprocess.STDOUT))
    said = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], said
    report = json.loads((tmp_path / "node0" / "report.json").read_text())
    assert report["steps"] == 5 and report["global_batch"] == 8  # whatever the split
    assert len(report["devices"]) == 2 and report["mode"] == "ddp"


def test_speed_balance_needs_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--mode", "dp", "--balance", "speed", "--devices", "cpu,cpu"]) == 2
    err = capsys.readouterr().err
    assert "--balance speed balances ranks; use it with --mode ddp, fsdp2, zero1 or" in err
    assert "Traceback" not in err
