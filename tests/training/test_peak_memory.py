"""The report's memory figures, one kind per device (issue 50 item 4; issue 51 item 6).

No GPU here: a fake reader stands where the report reads the CUDA allocator
(:mod:`evendp._training._peak_memory`), on replicas of one device named alike, as two
replicas of ``cuda:0`` are in one process. The fake's figures are its own, so a report that
read anything else (the allocated peak, another replica's, nothing) fails.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from evendp import TrainConfig, Trainer
from evendp._training import _peak_memory
from evendp._training._rehearse import attach_budgets
from evendp._training._report import plot_panels, write_report
from tests._helpers import requires_cuda

MIB = 1 << 20
DATA = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20))


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.device]]:
    """The allocator's reads replaced: every device reads 136 MiB reserved; calls recorded."""
    calls: dict[str, list[torch.device]] = {"read": [], "reset": []}

    def read(device: torch.device) -> int:
        calls["read"].append(device)
        return 136 * MIB

    monkeypatch.setattr(_peak_memory, "reserved_peak", read)
    monkeypatch.setattr(_peak_memory, "reset_reserved_peak", calls["reset"].append)
    return calls


def _fit(device_ids: list[str], weights: list[float], steps: int = 3) -> Any:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps, batch_size=6, progress=False)
    trainer = Trainer(nn.Linear(3, 1), DATA, cfg, device_ids=device_ids, weights=weights,
                      loss_fn=_mse)  # fmt: skip
    return trainer, trainer.fit()


def test_a_repeated_device_is_one_row_with_one_reserved_peak_beside_its_summed_plan(
    fake_gpu: dict[str, list[torch.device]], tmp_path: Path
) -> None:
    """The GPU report showed one GPU's peak on two rows beside 3.0 / 1.5 MiB planned: here one
    row says it holds two replicas, its measured peak once, the plan's figures summed."""
    _, report = _fit(["cpu:0", "cpu:0"], [2, 1])
    assert set(fake_gpu["reset"]) == {torch.device("cpu", 0)}  # the run's peak is its own
    assert set(fake_gpu["read"]) == {torch.device("cpu", 0)}  # read once per device
    planned = [3 * MIB, int(1.5 * MIB)]  # what the CLI adds per replica from the plan
    report.devices = [
        replace(d, planned_bytes=p) for d, p in zip(report.devices, planned, strict=True)
    ]
    (row,) = report.device_rows()
    assert (row.name, row.replicas, row.samples_per_step, row.samples) == ("cpu:0", 2, 6, 18)
    assert (row.peak_bytes, row.peak_kind, row.planned_bytes) == (136 * MIB, "reserved",
                                                                   int(4.5 * MIB))  # fmt: skip
    table = str(report.table())
    assert "cpu:0 (2 replicas)" in table and table.count("136.0 MiB") == 1
    assert "peak reserved, measured" in table and "4.5 MiB" in table
    assert "on 1 device (cpu:0 with 2 replicas)" in report.title()
    data = json.loads(write_report(report, tmp_path)["json"].read_text())
    assert [(d["name"], d["replicas"], d["peak_bytes"]) for d in data["devices"]] == [
        ("cpu:0", 2, 136 * MIB)
    ]
    # Each replica's own share of each step stays, its column named by replicas.
    assert data["replicas"] == ["cpu:0", "cpu:0"]
    assert data["batch_sizes_per_step"] == [[4, 2]] * 3


def test_the_progress_bar_shows_each_gpus_peak_once(
    fake_gpu: dict[str, list[torch.device]],
) -> None:
    """Two replicas of one GPU: one figure; two GPUs that read alike: two figures."""
    one, _ = _fit(["cpu:0", "cpu:0"], [2, 1], steps=1)
    two, _ = _fit(["cpu", "cpu"], [2, 1], steps=1)  # cpu:0 and cpu:1, as cuda:0 and cuda:1
    assert one.recorder.memory_text() == "136.0 MiB"
    assert two.recorder.memory_text() == "136.0 MiB 136.0 MiB"


def test_the_picture_names_what_was_measured(fake_gpu: dict[str, list[torch.device]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    import evendp._training._report as rep

    _, report = _fit(["cpu:0", "cpu:0"], [2, 1], steps=1)
    # The split did not move: the memory panel's ticks give each device's share.
    assert [p.__name__ for p in plot_panels(report)] == ["_plot_memory", "_plot_loss"]
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    rep._plot_memory(ax, report)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["evendp split, measured (reserved)"]
    (tick,) = ax.get_xticklabels()
    assert tick.get_text().startswith("cpu:0 (2 replicas)\nevendp: 6/step")


def test_devices_of_their_own_keep_their_rows_and_budgeted_ones_their_forward_peak() -> None:
    """Budgeted virtual devices: each its own budget's enforced forward peak (no allocator on
    a CPU); the JSON has it where the table shows it, and counts as integers."""
    torch.manual_seed(0)
    cfg = TrainConfig(steps=4, batch_size=6, progress=False)  # 20 samples: a short step of 2
    trainer = Trainer(nn.Linear(3, 1), DATA, cfg, device_ids=["cpu", "cpu", "cpu"],
                      weights=[3, 2, 1], loss_fn=_mse)  # fmt: skip
    attach_budgets(trainer, [MIB] * 3)
    data = trainer.fit().to_dict()
    devices = data["devices"]
    assert [d["name"] for d in devices] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(0 < d["peak_bytes"] < MIB and d["peak_kind"] == "forward" for d in devices)
    assert [d["samples"] for d in devices] == [9 + 1, 6 + 1, 3]  # 3 steps of 6, one of 2
    assert data["batch_sizes_per_step"] == [[3, 2, 1]] * 3 + [[1, 1, 0]]
    assert data["replicas"] == ["cpu:0", "cpu:1", "cpu:2"]
    counts = [data["global_batch"], data["steps"], *(d["samples"] for d in devices)]
    assert all(type(n) is int for n in counts)
    assert [type(d["samples_per_step"]) for d in devices] == [float, float, float]  # 2.5 ...


def test_whole_mean_shares_are_written_as_integers(tmp_path: Path) -> None:
    _, report = _fit(["cpu", "cpu"], [2, 1], steps=2)
    data = json.loads(write_report(report, tmp_path)["json"].read_text())
    assert [d["samples_per_step"] for d in data["devices"]] == [4, 2]
    assert all(type(d["samples_per_step"]) is int for d in data["devices"])
    # Nothing was measured on these CPU devices: null, and the table says so.
    assert [d["peak_bytes"] for d in data["devices"]] == [None, None]
    assert str(report.table()).count("not measured") == 2


@requires_cuda
@pytest.mark.gpu
def test_a_repeated_gpu_reports_its_allocators_reserved_peak_once() -> None:
    """On a real GPU: one row for cuda:0's two replicas, its figure the allocator's own peak
    reserved (not allocated), read after the run."""
    torch.manual_seed(0)
    cfg = TrainConfig(steps=2, batch_size=6, progress=False)
    model = nn.Linear(3, 1).cuda()
    report = Trainer(model, DATA, cfg, device_ids=["cuda:0", "cuda:0"], weights=[2, 1],
                     loss_fn=_mse).fit()  # fmt: skip
    (row,) = report.device_rows()
    assert (row.name, row.replicas, row.peak_kind) == ("cuda:0", 2, "reserved")
    assert row.peak_bytes == torch.cuda.max_memory_reserved(0)
    assert row.peak_bytes >= torch.cuda.max_memory_allocated(0) > 0
