"""What a training run shows: a live progress bar, and a final table, JSON and PNG report.

The PNG puts each device's peak memory beside the figure the planner gives an even split (the
memory ``nn.DataParallel`` would need for the same global batch), and the loss curve.
Measured peaks exist only on CUDA; on CPU virtual devices the table shows the planner's
figure for our split instead, labelled as planned.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["DeviceStat", "TrainProgress", "TrainReport", "format_bytes", "write_report"]


def format_bytes(n: float | None) -> str:
    """Human-readable bytes (binary units); ``None`` is shown as a dash.

    >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(None)
    ('1.5 KiB', '3.00 GiB', '-')
    """
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class DeviceStat:
    """One device's share and memory in a run (memory figures in bytes, ``None`` if unknown)."""

    name: str
    samples_per_step: float
    peak_bytes: int | None = None  # measured by the CUDA allocator
    planned_bytes: int | None = None  # planner, our split
    even_planned_bytes: int | None = None  # planner, an even split of the same batch


@dataclass
class TrainReport:
    """The outcome of a run: per-device figures, the loss curve and the OOM counters.

    >>> r = TrainReport([DeviceStat("cpu:0", 16), DeviceStat("cpu:1", 8)], losses=[4.6, 2.1])
    >>> r.first_loss, r.final_loss
    (4.6, 2.1)
    """

    devices: list[DeviceStat]
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    global_batch: int = 0
    samples_per_s: float = 0.0
    elapsed_s: float = 0.0
    resplits: int = 0
    skipped_steps: int = 0
    micro_batch_size: int | None = None
    interrupted: bool = False
    mode: str = "dp"
    amp: str = "none"
    signal: int | None = None  # what interrupted the run: 2 SIGINT, 15 SIGTERM (None: none)
    #: Evaluations of ``eval_data``: ``[{"step": 100, "metrics": {"loss": 2.31}}, ...]``.
    eval: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first_loss(self) -> float | None:
        """The loss of the first step run (``None`` before any)."""
        return self.losses[0] if self.losses else None

    @property
    def final_loss(self) -> float | None:
        """The loss of the last step run (``None`` before any)."""
        return self.losses[-1] if self.losses else None

    def table(self) -> Any:
        """A ``rich.table.Table``: samples per step and memory for each device."""
        from rich.table import Table

        measured = any(d.peak_bytes is not None for d in self.devices)
        table = Table(title=f"evendp {self.mode}: {self.steps} steps, batch {self.global_batch}")
        table.add_column("device")
        table.add_column("samples/step", justify="right")
        table.add_column("share", justify="right")
        table.add_column("peak memory" if measured else "planned peak", justify="right")
        table.add_column("even split, planned", justify="right")
        total = sum(d.samples_per_step for d in self.devices) or 1.0
        for d in self.devices:
            ours = d.peak_bytes if measured else d.planned_bytes
            table.add_row(
                d.name,
                f"{d.samples_per_step:g}",
                f"{d.samples_per_step / total:.0%}",
                format_bytes(ours),
                format_bytes(d.even_planned_bytes),
            )
        return table

    def summary(self) -> str:
        """Two lines: loss first -> final, throughput, and what OOM handling did."""
        first, final = self.first_loss, self.final_loss
        loss = f"loss {first:.4f} -> {final:.4f}" if first is not None and final is not None else ""
        state = "interrupted" if self.interrupted else "finished"
        return (
            f"{state}: {self.steps} steps in {self.elapsed_s:.1f} s, {loss}, "
            f"{self.samples_per_s:.1f} samples/s\n"
            f"OOM re-splits: {self.resplits}, skipped steps: {self.skipped_steps}, "
            f"micro-batch: {self.micro_batch_size or 'whole batch'}"
        ) + (
            "\nvalidation at step {step}: ".format(**self.eval[-1])
            + ", ".join(f"{k} {v:.4f}" for k, v in self.eval[-1]["metrics"].items())
            if self.eval
            else ""
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``report.json``."""
        data = asdict(self)
        data["first_loss"], data["final_loss"] = self.first_loss, self.final_loss
        return data


def _plot(report: TrainReport, path: Path) -> None:
    # The object API with an Agg canvas: no pyplot, no global backend switch, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    mem, curve = fig.subplots(1, 2)
    names = [d.name for d in report.devices]
    measured = any(d.peak_bytes is not None for d in report.devices)
    ours = [(d.peak_bytes if measured else d.planned_bytes) or 0 for d in report.devices]
    even = [d.even_planned_bytes or 0 for d in report.devices]
    xs = list(range(len(names)))
    width = 0.38
    label = "evendp, measured peak" if measured else "evendp, planned peak"
    mem.bar([x - width / 2 for x in xs], [b / 2**20 for b in ours], width, label=label)
    mem.bar(
        [x + width / 2 for x in xs], [b / 2**20 for b in even], width, label="even split, planned"
    )
    for x, d in zip(xs, report.devices, strict=True):
        mem.annotate(f"{d.samples_per_step:g}/step", (x, 0), ha="center", va="bottom", fontsize=8)
    mem.set_xticks(xs, names)
    mem.set_ylabel("MiB")
    mem.set_title("Per-device peak memory")
    mem.legend(fontsize=8)
    if not any(ours) and not any(even):
        mem.text(
            0.5, 0.5, "no memory figures on this machine", ha="center", transform=mem.transAxes
        )
    curve.plot(range(1, len(report.losses) + 1), report.losses, label="training")
    _plot_validation(curve, report.eval)
    curve.set_xlabel("step")
    curve.set_ylabel("training loss")
    curve.set_title("Loss")
    curve.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def _plot_validation(ax: Any, evals: list[dict[str, Any]]) -> None:
    """The validation loss (else the first metric) at each evaluated step, on the loss axes."""
    if not evals:
        return
    name = "loss" if "loss" in evals[-1]["metrics"] else next(iter(evals[-1]["metrics"]), None)
    points = [(e["step"], e["metrics"][name]) for e in evals if name in e["metrics"]]
    if points:
        ax.plot(*zip(*points, strict=True), "o-", label=f"validation {name}")
        ax.legend(fontsize=8)


def write_report(report: TrainReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.txt`` (the table) and ``report.png``; return the paths.

    >>> import tempfile
    >>> r = TrainReport([DeviceStat("cpu:0", 2)], losses=[3.0, 2.0], steps=2, global_batch=2)
    >>> sorted(write_report(r, tempfile.mkdtemp()))
    ['json', 'png', 'txt']
    """
    from rich.console import Console

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "txt": out / "report.txt", "png": out / "report.png"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(report.table())
    console.print(report.summary())
    paths["txt"].write_text(console.export_text())
    _plot(report, paths["png"])
    return paths


class TrainProgress:
    """A rich progress bar showing step, loss, samples/s and per-device memory.

    Use as a context manager; ``update(step, loss, samples, memory)`` after every step.
    With ``enabled=False`` it does nothing (tests, non-zero ranks). ``console``: a
    ``rich.console.Console`` to draw on (default: the terminal).

    >>> with TrainProgress(total=3, enabled=False) as bar:
    ...     bar.update(1, loss=2.5, samples=32, memory="-")
    """

    def __init__(
        self, total: int, enabled: bool = True, start: int = 0, console: Any = None
    ) -> None:
        self.total = total
        self.console = console
        self.enabled = enabled
        self.start = start
        self._progress: Any = None
        self._task: Any = None
        self._last = time.perf_counter()

    def __enter__(self) -> TrainProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} samples/s"),
                TextColumn("mem {task.fields[memory]}"),
                console=self.console,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "train", total=self.total, completed=self.start, loss="-", speed="-", memory="-"
            )
        self._last = time.perf_counter()
        return self

    def update(self, step: int, loss: float | None, samples: int, memory: str) -> None:
        """Advance to ``step`` (1-based steps done) after a step of ``samples`` samples."""
        now = time.perf_counter()
        speed = samples / max(now - self._last, 1e-9)
        self._last = now
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=step,
                loss="skipped" if loss is None else f"{loss:.4f}",
                speed=f"{speed:.0f}",
                memory=memory,
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
