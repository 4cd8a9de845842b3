"""The final report (table, JSON, PNG) and the progress bar."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

from rich.console import Console

from evendp._training._recorder import TrainProgress
from evendp._training._report import DeviceStat, TrainReport, format_bytes, write_report


def _report(measured: bool) -> TrainReport:
    devices = [
        DeviceStat(
            "cuda:0" if measured else "cpu:0",
            16,
            3 * 2**30 if measured else None,
            2 * 2**30,
            4 * 2**30,
            peak_kind="reserved" if measured else None,
        ),
        DeviceStat(
            "cuda:1" if measured else "cpu:1",
            8,
            2**30 if measured else None,
            2**30,
            4 * 2**30,
            peak_kind="reserved" if measured else None,
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


def _text(table: object, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_table_rows_and_memory_columns() -> None:
    text = _text(_report(measured=True).table())
    assert "cuda:0" in text and "cuda:1" in text
    assert "peak reserved, measured" in text and "3.00 GiB" in text and "4.00 GiB" in text
    assert "67%" in text and "33%" in text
    cpu = _text(_report(measured=False).table())
    # No measured figure: the measured column says so, the planned one keeps its name.
    assert "reserved" not in cpu and "peak, planned" in cpu and "2.00 GiB" in cpu
    assert cpu.count("not measured") == 2


def test_write_report_files(tmp_path: Path) -> None:
    paths = write_report(_report(measured=False), tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["losses"] == [4.5, 3.0, 2.2] and data["final_loss"] == 2.2
    assert data["devices"][1]["samples_per_step"] == 8
    assert "cpu:1" in paths["txt"].read_text() and "OOM re-splits: 1" in paths["txt"].read_text()
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _plant_links(out: Path, theirs: Path) -> list[Path]:
    """report.json and report.png as symbolic links, report.txt and metrics.csv as hard
    links, each to a file of ``theirs``; the files linked to."""
    targets = []
    links = [("report.json", False), ("report.txt", True), ("report.png", False),
             ("metrics.csv", True)]  # fmt: skip
    for name, hard in links:
        target = theirs / f"{name}.theirs"
        target.write_text("theirs")
        (os.link if hard else os.symlink)(target, out / name)
        targets.append(target)
    return targets


def test_reports_replace_links_planted_in_out_never_write_through_them(tmp_path: Path) -> None:
    """Issue 34: links in place of the report files to another user's files. The links are
    replaced by the reports (private, 0600 like the checkpoints); the files stay as they were."""
    out, theirs = tmp_path / "out", tmp_path / "theirs"
    out.mkdir(), theirs.mkdir()
    targets = _plant_links(out, theirs)
    paths = write_report(_report(measured=False), out)
    assert [t.read_text() for t in targets] == ["theirs"] * 4
    for path in paths.values():
        info = path.lstat()
        assert stat.S_ISREG(info.st_mode) and info.st_nlink == 1, path
        assert info.st_mode & 0o777 == 0o600, oct(info.st_mode)
    assert json.loads(paths["json"].read_text())["losses"] == [4.5, 3.0, 2.2]
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    names = ["metrics.csv", "report.json", "report.png", "report.txt"]
    assert sorted(p.name for p in out.iterdir()) == names


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


def _budgeted() -> TrainReport:
    mib = 2**20
    devices = [
        DeviceStat("cpu:0", 12, 31 * mib, 33 * mib, 30 * mib, 48 * mib, "forward", 11, 27 * mib),
        DeviceStat("cpu:1", 12, 29 * mib, 30 * mib, 28 * mib, 48 * mib, "forward", 11, 27 * mib),
        DeviceStat(
            "cpu:2", 8, 20 * mib, 20 * mib, 25 * mib, 24 * mib, "forward", 10, 24.3 * mib, True
        ),
    ]
    return TrainReport(devices, losses=[4.0, 3.0], steps=2, global_batch=32, model="GPT 3x64")


def test_budgeted_table_names_each_figure_and_the_oom() -> None:
    text = _text(_budgeted().table(), width=200)
    for column in ("budget", "fwd peak, measured", "peak, planned", "even split",
                   "even fwd, measured", "even peak, planned"):  # fmt: skip
        assert column in text
    assert "OOM" in text.splitlines()[-3] + text.splitlines()[-2]  # cpu:2's row
    assert "GPT 3x64 on 3 devices" in text and "global batch 32, 2 steps" in text


def test_png_has_title_budget_lines_and_no_label_on_the_axis(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    import evendp._training._report as rep

    report = _budgeted()
    report.eval = [{"step": 2, "metrics": {"loss": 3.1}}]
    fig = Figure()
    FigureCanvasAgg(fig)
    mem, curve = fig.subplots(1, 2)
    rep._plot_memory(mem, report)
    rep._plot_loss(curve, report)
    labels = [t.get_text() for t in mem.get_legend().get_texts()]
    assert "budget" in labels and "evendp split, planned" in labels
    assert "even split, measured (forward, until OOM)" in labels
    assert [c for c in mem.collections if c.get_label() == "budget"]  # the budget line
    # Shares are tick labels under the axis, not text sitting on the axis line (y=0).
    assert all(t.xy[1] > 0 for t in mem.texts if hasattr(t, "xy"))
    assert "evendp: 8/step" in mem.get_xticklabels()[2].get_text()
    assert curve.get_legend() is not None  # the validation curve is labelled
    paths = write_report(report, tmp_path)
    assert json.loads(paths["json"].read_text())["devices"][2]["even_oom"] is True
