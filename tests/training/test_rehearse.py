"""evendp.rehearse: a user's own model (a tiny GPT-2, tests/training/_rehearse_model.py) on
CPU virtual devices that enforce 24MiB,12MiB: the even split runs out on the small device,
the planner's split trains within both budgets."""

from __future__ import annotations

from pathlib import Path

import pytest

from evendp import EvendpError, TrainConfig, rehearse
from evendp._training._rehearse import _budgets
from tests.training._rehearse_model import make


def test_a_user_model_rehearses_24mib_12mib(tmp_path: Path) -> None:
    model, data, loss_fn = make()
    lines: list[str] = []
    cfg = TrainConfig(steps=2, batch_size=48, progress=False, out_dir=tmp_path)
    report = rehearse(
        model, data, cfg, memory="24GiB,12GiB", scale=1 / 1024, loss_fn=loss_fn, say=lines.append
    )
    devices = report.devices
    assert [d.budget_bytes for d in devices] == [24 << 20, 12 << 20]
    # The even split does not fit the small device: refused there, with its measured figure.
    assert [d.even_samples for d in devices] == [24, 24]
    assert [d.even_oom for d in devices] == [False, True]
    assert devices[1].even_forward_peak_bytes > devices[1].budget_bytes
    assert "the even split [24, 24] (what nn.DataParallel runs) fails" in lines[1]
    assert "cpu:1 is out of its 12.0 MiB budget" in lines[1]
    # The planner's split trains, every forward within its budget, no OOM re-split needed.
    shares = [d.samples_per_step for d in devices]
    assert sum(shares) == 48 and shares[0] > shares[1]
    assert all(d.forward_peak_bytes <= d.budget_bytes for d in devices)
    assert all(d.planned_bytes and d.even_planned_bytes for d in devices)
    assert report.resplits == 0 and report.steps == 2
    assert (tmp_path / "report.json").is_file() and (tmp_path / "report.png").is_file()


def test_budgets_scale_and_bad_values() -> None:
    assert _budgets("24GiB,12GiB", 1 / 1024) == _budgets("24MiB,12MiB", 1.0) == [24 << 20, 12 << 20]
    assert _budgets(["1MiB", 2048], 1.0) == [1 << 20, 2048]
    with pytest.raises(EvendpError, match="scale"):
        _budgets("24MiB", 0)
    with pytest.raises(EvendpError, match="memory="):
        _budgets("", 1.0)


def test_rehearse_refuses_device_ids() -> None:
    model, data, loss_fn = make()
    cfg = TrainConfig(steps=1, batch_size=4, progress=False)
    with pytest.raises(EvendpError, match="drop device_ids="):
        rehearse(model, data, cfg, memory="24MiB,12MiB", device_ids=["cpu"], loss_fn=loss_fn)


def test_a_batch_past_the_budgets_is_one_plain_line_in_the_python_api() -> None:
    """Issue 36: the error said "does not fit" twice and named the command line's --batch."""
    model, data, loss_fn = make()
    cfg = TrainConfig(steps=1, batch_size=192, progress=False)  # the whole dataset
    with pytest.raises(EvendpError) as info:
        rehearse(model, data, cfg, memory="2MiB,1MiB", loss_fn=loss_fn)
    message = str(info.value)
    assert message.startswith("batch_size=192 on memory 2.0MiB,1.0MiB: a global batch of")
    assert message.count("does not fit") == 1 and "--batch" not in message, message
    assert "the largest that fits is" in message and "\n" not in message
