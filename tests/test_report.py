"""The final report (table, JSON, PNG) and the progress bar."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from evendp._report import DeviceStat, TrainProgress, TrainReport, format_bytes, write_report


def _report(measured: bool) -> TrainReport:
    devices = [
        DeviceStat(
            "cuda:0" if measured else "cpu:0",
            16,
            3 * 2**30 if measured else None,
            2 * 2**30,
            4 * 2**30,
        ),
        DeviceStat(
            "cuda:1" if measured else "cpu:1", 8, 2**30 if measured else None, 2**30, 4 * 2**30
        ),
    ]
    return TrainReport(
        devices,
        losses=[4.5, 3.0, 2.2],
        steps=3,
        global_batch=24,
        samples_per_s=120.0,
        resplits=1,
        skipped_steps=0,
        micro_batch_size=12,
    )


def _text(table: object) -> str:
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_table_rows_and_memory_columns() -> None:
    text = _text(_report(measured=True).table())
    assert "cuda:0" in text and "cuda:1" in text
    assert "peak memory" in text and "3.00 GiB" in text and "4.00 GiB" in text
    assert "67%" in text and "33%" in text
    cpu = _text(_report(measured=False).table())
    assert "planned peak" in cpu and "2.00 GiB" in cpu


def test_write_report_files(tmp_path: Path) -> None:
    paths = write_report(_report(measured=False), tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["losses"] == [4.5, 3.0, 2.2] and data["final_loss"] == 2.2
    assert data["devices"][1]["samples_per_step"] == 8
    assert "cpu:1" in paths["txt"].read_text() and "OOM re-splits: 1" in paths["txt"].read_text()
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_without_memory_figures(tmp_path: Path) -> None:
    report = TrainReport([DeviceStat("cpu:0", 4)], losses=[1.0])
    paths = write_report(report, tmp_path)
    assert paths["png"].stat().st_size > 0
    assert report.summary().startswith("finished: 0 steps")


def test_progress_bar_shows_step_loss_speed_and_memory() -> None:
    out = io.StringIO()
    with TrainProgress(total=2, console=Console(file=out, width=160)) as bar:
        bar.update(1, loss=2.0, samples=8, memory="cpu:0 -")
        bar.update(2, loss=1.25, samples=8, memory="12.0 MiB")
    text = out.getvalue()
    assert "2/2" in text and "loss 1.2500" in text and "mem 12.0 MiB" in text
    assert " samples/s" in text
    quiet = io.StringIO()
    with TrainProgress(total=2, enabled=False, console=Console(file=quiet)) as bar:
        bar.update(1, loss=None, samples=8, memory="-")
    assert quiet.getvalue() == ""


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(5 * 2**20) == "5.0 MiB"
