"""``print`` shows a plan or a report as its table, with each byte count in a readable unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evendp import TrainReport, plan
from evendp._training._report import DeviceStat


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_print_plan_and_its_table_show_the_table_in_mib(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan(_net(), torch.randn(1, 64), "48MiB,24MiB", mode="ddp", cuda_context=0)
    print(p.table())
    print(p)
    out = capsys.readouterr().out
    assert "<rich.table.Table" not in out
    budget = [line for line in out.splitlines() if line.startswith("│ budget")]
    assert len(budget) == 2  # once per print
    assert "MiB" in budget[0] and "0.00" not in budget[0]
    peak_rows = [line for line in out.splitlines() if line.startswith("│ predicted peak")]
    assert len(peak_rows) == 2  # the row, once per print (the caption names it too)


def test_print_report_table() -> None:
    report = TrainReport([DeviceStat("cpu:0", 3, budget_bytes=4 * 2**20)], steps=2, global_batch=3)
    text = str(report.table())
    assert "cpu:0" in text and "4.0 MiB" in text
