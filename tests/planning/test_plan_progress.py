"""The planner's progress lines: one before each fake step it measures, only where asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from evendp._planning._planner import plan, progress_to
from evendp.examples.lm_head import LMHead, lm_loss


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def test_a_line_before_each_measured_size(capsys: pytest.CaptureFixture) -> None:
    lines: list[str] = []
    with progress_to(lines.append):
        p = plan(_net(), torch.randn(1, 64), "64MiB,32MiB", mode="ddp", cuda_context=0)
    assert lines == [f"planning: a fake step of {n} samples on one device"
                     for n in p.measured_sizes]  # fmt: skip
    plan(_net(), torch.randn(1, 64), "64MiB,32MiB", mode="ddp", cuda_context=0)
    assert capsys.readouterr().out == ""  # outside the block: silent, as plan always was


def test_forward_only_and_the_criterion_on_the_output_device_are_named() -> None:
    lines: list[str] = []
    batch = (torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))
    with progress_to(lines.append):
        plan(LMHead(100, 16), batch, "64MiB,32MiB", criterion=lm_loss, cuda_context=0,
             no_grad=True)  # fmt: skip
    assert "planning: a fake forward of 2 samples on one device" in lines
    assert "planning: the criterion on 4 gathered samples" in lines
    assert "planning: a fake step of 2 samples on one device" in lines  # the training plan


def test_progress_to_restores_the_outer_sink_after_an_error() -> None:
    outer: list[str] = []
    with progress_to(outer.append):
        with pytest.raises(RuntimeError), progress_to(None):
            raise RuntimeError("boom")
        plan(_net(), torch.randn(1, 64), "64MiB", mode="ddp", cuda_context=0)
    assert outer and all(line.startswith("planning: ") for line in outer)
