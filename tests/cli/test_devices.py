"""``evendp devices`` with NVML replaced by a stub: no driver, 0, 1 and 8 GPUs."""

from __future__ import annotations

import json

import pytest

import evendp._planning._devices as devices_mod
from evendp._core._units import format_bytes
from evendp.cli import main
from tests.planning.test_devices import FakeNvml, mixed_gpus


def _use(monkeypatch: pytest.MonkeyPatch, stub: FakeNvml) -> None:
    monkeypatch.setattr(devices_mod, "load_nvml", lambda: stub)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal width


def test_no_driver_says_so_and_exits_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _use(monkeypatch, FakeNvml(None))
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "No NVIDIA driver found" in out
    assert "CPU" in out


def test_no_driver_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _use(monkeypatch, FakeNvml(None))
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["driver"] is False and data["devices"] == []


def test_real_machine_without_driver_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    # Whatever this machine has, the command must succeed and print something.
    assert main(["devices"]) == 0
    assert capsys.readouterr().out.strip()


def test_zero_gpus(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, FakeNvml([]))
    assert main(["devices"]) == 0
    assert "reports no GPUs" in capsys.readouterr().out


def test_one_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _use(monkeypatch, FakeNvml(mixed_gpus(1)))
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out
    assert "00000000:10:00.0" in out
    assert "1 GPU(s), 80.00 GiB free in all" in out


def test_eight_mixed_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = mixed_gpus(8)
    _use(monkeypatch, FakeNvml(gpus))
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "00000000:" in line]
    assert len(rows) == 8
    for i, (row, gpu) in enumerate(zip(rows, gpus, strict=True)):
        assert f"00000000:{0x10 + i:02X}:00.0" in row
        assert gpu.name in row
        assert format_bytes(gpu.free) in row  # with its unit (a column had GiB fixed)
        for pid, _ in gpu.pids:
            assert str(pid) in row


def test_eight_gpus_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = mixed_gpus(8)
    _use(monkeypatch, FakeNvml(gpus))
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["driver"] is True
    assert [d["index"] for d in data["devices"]] == list(range(8))
    assert [d["free_memory"] for d in data["devices"]] == [g.free for g in gpus]
    assert [d["total_memory"] for d in data["devices"]] == [g.total for g in gpus]
    assert data["devices"][1]["processes"] == [{"pid": 1001, "used_memory": 7 * 2**30}]
