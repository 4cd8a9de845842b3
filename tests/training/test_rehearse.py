"""evendp.rehearse: a user's own model (a tiny GPT-2, tests/training/_rehearse_model.py) on
CPU virtual devices that enforce 24MiB,12MiB: the even split runs out on the small device,
the planner's split trains within both budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

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
    even = next(line for line in lines if line.startswith("the even split"))
    assert "the even split [24, 24] (what nn.DataParallel runs) fails" in even
    assert "cpu:1 is out of its 12.0 MiB budget" in even
    # The planner's split trains, every forward within its budget, no OOM re-split needed.
    shares = [d.samples_per_step for d in devices]
    assert sum(shares) == 48 and shares[0] > shares[1]
    assert all(d.peak_bytes <= d.budget_bytes and d.peak_kind == "forward" for d in devices)
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


class _CountingData(torch.utils.data.Dataset):
    """A dataset that counts its reads: how many samples the rehearsal fed."""

    def __init__(self, data: Any) -> None:
        self.data, self.reads = data, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return self.data[i]


def test_planning_at_a_cards_real_size_reads_no_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37, item 5: at 24GiB,12GiB the planner measures a fake step at the small card's
    capacity (tens of thousands of samples); the old rehearsal collated that many samples
    one by one (minutes). It now grows the first batch's shapes, reading nothing."""
    import evendp._planning._planner as plan_mod

    model, data, loss_fn = make()
    counted = _CountingData(data)
    during: dict[str, Any] = {}
    real_plan = plan_mod.plan

    def counting_plan(*args: Any, **kwargs: Any) -> Any:
        before = counted.reads
        result = real_plan(*args, **kwargs)
        during.update(reads=counted.reads - before, sizes=result.measured_sizes)
        return result

    monkeypatch.setattr(plan_mod, "plan", counting_plan)
    cfg = TrainConfig(steps=1, batch_size=48, progress=False)
    report = rehearse(model, counted, cfg, memory="24GiB,12GiB", loss_fn=loss_fn, say=None)
    assert max(during["sizes"]) > 10_000  # it measured a card's capacity...
    assert during["reads"] == 0  # ...without reading a sample for it
    assert sum(d.samples_per_step for d in report.devices) == 48


def test_rehearse_says_what_the_planner_measures(capsys: pytest.CaptureFixture) -> None:
    model, data, loss_fn = make()
    lines: list[str] = []
    cfg = TrainConfig(steps=1, batch_size=48, progress=False)
    rehearse(model, data, cfg, memory="24MiB,12MiB", loss_fn=loss_fn, say=lines.append)
    start = lines.index("planning the split of 48 samples over 2 devices (fake steps at a few "
                        "sizes) ...")  # fmt: skip
    split = next(i for i, line in enumerate(lines) if "virtual devices" in line)
    probes = lines[start + 1 : split]
    # One line before each fake step, each naming its size: 2 and 4, then where it landed.
    assert probes[:2] == [f"planning: a fake step of {n} samples on one device" for n in (2, 4)]
    assert len(probes) >= 3 and all(line.startswith("planning: a fake step of ") for line in probes)
    assert "the even split [24, 24]" in lines[split + 1]
    rehearse(*make()[:2], cfg, memory="24MiB,12MiB", loss_fn=loss_fn, say=None)
    assert capsys.readouterr().out == ""  # say=None: silent
