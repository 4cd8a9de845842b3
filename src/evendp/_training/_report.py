"""What a training run shows: a live progress bar, and a final table, JSON and PNG report.

The PNG's left panel shows, per device, its memory budget as a line, evendp's split under it
and an even split of the same global batch (what ``nn.DataParallel`` runs) beside it; the
right panel the loss curve (and the validation curve when there is one). Every figure says
where it comes from: *measured* (the CUDA allocator's peak on a GPU; on budgeted virtual CPU
devices the enforced forward peak of :mod:`evendp._training._budget`) or *planned* (the memory
planner's forward+backward peak). One is never shown under the other's name.
"""

from __future__ import annotations

import io
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from .._core._files import mkdir_private, replace_file
from .._core._table import format_bytes

__all__ = [
    "DeviceStat",
    "TrainProgress",
    "TrainReport",
    "format_bytes",
    "plot_panels",
    "write_report",
]


def _count(x: float) -> str:
    """A per-step sample count: whole when it is, else one decimal (an epoch's short step).

    >>> _count(12.0), _count(11.9333)
    ('12', '11.9')
    """
    return f"{x:g}" if float(x).is_integer() else f"{x:.1f}"


@dataclass
class DeviceStat:
    """One device's share and memory in a run (memory figures in bytes, ``None`` if unknown)."""

    name: str
    samples_per_step: float
    peak_bytes: int | None = None  # measured by the CUDA allocator
    planned_bytes: int | None = None  # planner, our split
    even_planned_bytes: int | None = None  # planner, an even split of the same batch
    budget_bytes: int | None = None  # the device's declared memory (a virtual device's budget)
    forward_peak_bytes: int | None = None  # measured: enforced forward peak, budgeted devices
    even_samples: int | None = None  # an even split's share of the same batch
    even_forward_peak_bytes: int | None = None  # measured for the even split (at the OOM: so far)
    even_oom: bool = False  # the even split ran out of this device's budget


@dataclass
class TrainReport:
    """The outcome of a run: per-device figures, the loss curve and the OOM counters.

    >>> r = TrainReport([DeviceStat("cpu:0", 16), DeviceStat("cpu:1", 8)], losses=[4.6, 2.1])
    >>> r.first_loss, r.final_loss
    (4.6, 2.1)
    """

    devices: list[DeviceStat]
    losses: list[float] = field(default_factory=list)
    steps: int = 0  # the run's position: optimizer steps done in all, resumed ones included
    global_batch: int = 0
    samples_per_s: float = 0.0
    elapsed_s: float = 0.0
    resplits: int = 0
    skipped_steps: int = 0
    micro_batch_size: int | None = None
    interrupted: bool = False
    mode: str = "dp"
    amp: str = "none"
    #: What was trained, for titles: e.g. ``"GPT 3x64, 128 chars"`` (empty: not named).
    model: str = ""
    signal: int | None = None  # what interrupted the run: 2 SIGINT, 15 SIGTERM (None: none)
    #: Evaluations of ``eval_data``: ``[{"step": 100, "metrics": {"loss": 2.31}}, ...]``.
    eval: list[dict[str, Any]] = field(default_factory=list)
    #: Steps this call ran (``None``: all of ``steps``); the per-step figures, samples/s and
    #: ``elapsed_s`` are over these only.
    steps_run: int | None = None
    #: Per step this call ran, each rank's batch size (the split, which ``balance="speed"``
    #: changes at step boundaries; one process: one entry, the global batch).
    batch_sizes_per_step: list[list[int]] = field(default_factory=list)

    @property
    def first_loss(self) -> float | None:
        """The loss of the first step run (``None`` before any)."""
        return self.losses[0] if self.losses else None

    @property
    def final_loss(self) -> float | None:
        """The loss of the last step run (``None`` before any)."""
        return self.losses[-1] if self.losses else None

    def table(self) -> Any:
        """A ``rich.table.Table``: samples per step and memory for each device (``print``
        shows it as text)."""
        from .._core._table import PrintableTable as Table

        table = Table(title=self.title())
        table.add_column("device")
        table.add_column("samples/step", justify="right")
        table.add_column("share", justify="right")
        columns = [  # only the columns some device has a figure for
            ("budget", lambda d: d.budget_bytes),
            ("peak, measured", lambda d: d.peak_bytes),
            ("fwd peak, measured", lambda d: d.forward_peak_bytes),
            ("peak, planned", lambda d: d.planned_bytes),
            ("even split", lambda d: d.even_samples),
            ("even fwd, measured", lambda d: d.even_forward_peak_bytes),
            ("even peak, planned", lambda d: d.even_planned_bytes),
        ]
        shown = [(n, f) for n, f in columns if any(f(d) is not None for d in self.devices)]
        for name, _ in shown:
            table.add_column(name, justify="right")
        total = sum(d.samples_per_step for d in self.devices) or 1.0
        for d in self.devices:
            cells = []
            for name, get in shown:
                value = get(d)
                if name == "even split":
                    cells.append("-" if value is None else f"{value:g}")
                else:
                    oom = name.startswith("even fwd") and d.even_oom
                    cells.append(format_bytes(value) + (" OOM" if oom else ""))
            table.add_row(
                d.name, _count(d.samples_per_step), f"{d.samples_per_step / total:.0%}", *cells
            )
        return table

    def title(self) -> str:
        """One line naming the run: model, devices, global batch, steps.

        >>> TrainReport([DeviceStat("cpu:0", 2)], steps=5, global_batch=2, model="GPT").title()
        'evendp dp: GPT on 1 device (cpu:0), global batch 2, 5 steps'
        """
        names = ", ".join(d.name for d in self.devices)
        what = f"{self.model} on " if self.model else "on "
        count = len(self.devices)
        resumed = "" if self.ran == self.steps else f" ({self.ran} this run)"
        precision = "" if self.amp == "none" else f", {self.amp} autocast"
        return (
            f"evendp {self.mode}: {what}{count} device{'s' if count != 1 else ''} ({names}), "
            f"global batch {self.global_batch}{precision}, {self.steps} steps{resumed}"
        )

    @property
    def ran(self) -> int:
        """Steps this run trained (after a resume, fewer than :attr:`steps`).

        >>> TrainReport([], steps=80, steps_run=20).ran
        20
        """
        return self.steps if self.steps_run is None else self.steps_run

    def summary(self) -> str:
        """Two lines: loss first -> final, throughput, and what OOM handling did."""
        first, final = self.first_loss, self.final_loss
        loss = f"loss {first:.4f} -> {final:.4f}" if first is not None and final is not None else ""
        state = "interrupted" if self.interrupted else "finished"
        steps = f"{self.steps} steps"
        if self.ran != self.steps:
            steps = f"{self.ran} steps (resumed at step {self.steps - self.ran}, now {self.steps})"
        return (
            f"{state}: {steps} in {self.elapsed_s:.1f} s, {loss}, "
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


def _plot(report: TrainReport, png: IO[bytes]) -> None:
    # The object API with an Agg canvas: no pyplot, no global backend switch, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = plot_panels(report)
    ratios = {_plot_memory: 1.25, _plot_split: 1.0, _plot_loss: 1.0}
    fig = Figure(figsize=(5.5 + 3.5 * len(panels), 5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), gridspec_kw={"width_ratios": [ratios[p] for p in panels]})
    fig.suptitle(report.title(), fontsize=11)
    for panel, ax in zip(panels, [axes] if len(panels) == 1 else axes, strict=True):
        panel(ax, report)
    fig.tight_layout()
    fig.savefig(png, format="png")


def plot_panels(report: TrainReport) -> list[Any]:
    """``report.png``'s panels, left to right: memory where measured or planned (not on a
    CPU's ranks), the split over steps where several ranks share a step, the loss always.

    >>> r = TrainReport([DeviceStat("cpu:0", 3), DeviceStat("cpu:1", 1)], losses=[2.0, 1.0],
    ...                 steps=2, batch_sizes_per_step=[[2, 2], [3, 1]])
    >>> [panel.__name__ for panel in plot_panels(r)]
    ['_plot_split', '_plot_loss']
    """
    return [p for p in (_plot_memory, _plot_split) if _shows(p, report)] + [_plot_loss]


def _shows(panel: Any, report: TrainReport) -> bool:
    """Whether an optional panel has figures for this run."""
    if panel is _plot_split:
        return any(len(sizes) > 1 for sizes in report.batch_sizes_per_step)
    bars = [_memory_bars(d) for d in report.devices]
    return any(v is not None for b in bars for v in b.values()) or any(
        d.budget_bytes is not None for d in report.devices
    )


def _plot_loss(ax: Any, report: TrainReport) -> None:
    """The training loss per step, and the validation loss where evaluated."""
    ax.plot(range(1, len(report.losses) + 1), report.losses, label="training")
    _plot_validation(ax, report.eval)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)


def _plot_split(ax: Any, report: TrainReport) -> None:
    """Each rank's batch size at each step this run trained, stacked (the global batch on
    top): a speed re-split shows as a step where the bands change width."""
    split = report.batch_sizes_per_step
    first = report.steps - len(split) + 1  # a resumed run's steps keep their numbers
    steps = range(first, first + len(split))
    ranks = list(zip(*split, strict=True))
    ax.stackplot(steps, ranks, labels=[f"rank {r}" for r in range(len(ranks))], step="post")
    changes = sum(a != b for a, b in itertools.pairwise(split))
    ax.set_title("Split over steps" + (f" ({changes} re-split{'s' * (changes != 1)})"))
    ax.set_xlabel("step")
    ax.set_ylabel("samples per step")
    ax.set_ylim(0, max(sum(s) for s in split) * 1.25)  # room for the legend
    ax.legend(fontsize=8, loc="upper right", ncols=min(len(ranks), 4))
    ax.grid(alpha=0.3)


# (label, colour, hatch) per bar kind; measured bars are solid, planned ones hatched.
_BARS = {
    "ours_measured": ("evendp split, measured", "tab:blue", None),
    "ours_planned": ("evendp split, planned", "tab:blue", "//"),
    "even_measured": ("even split, measured", "tab:orange", None),
    "even_planned": ("even split, planned", "tab:orange", "//"),
}


def _memory_bars(d: DeviceStat) -> dict[str, int | None]:
    measured = d.peak_bytes if d.peak_bytes is not None else d.forward_peak_bytes
    return {
        "ours_measured": measured,
        "ours_planned": d.planned_bytes,
        "even_measured": d.even_forward_peak_bytes,
        "even_planned": d.even_planned_bytes,
    }


def _plot_memory(ax: Any, report: TrainReport) -> None:
    """Per device: the budget as a line, evendp's split and the even split as bars (MiB)."""
    bars = [_memory_bars(d) for d in report.devices]
    kinds = [k for k in _BARS if any(b[k] is not None for b in bars)]
    xs = range(len(report.devices))
    width = 0.8 / max(len(kinds), 1)
    top = 0.0
    for j, kind in enumerate(kinds):
        label, colour, hatch = _BARS[kind]
        if kind == "ours_measured" and all(d.peak_bytes is None for d in report.devices):
            label = "evendp split, measured (forward)"
        if kind == "even_measured":
            oom = any(d.even_oom for d in report.devices)
            label = "even split, measured (forward" + (", until OOM)" if oom else ")")
        offsets = [x - 0.4 + width * (j + 0.5) for x in xs]
        heights = [(b[kind] or 0) / 2**20 for b in bars]
        top = max(top, *heights)
        ax.bar(
            offsets, heights, width * 0.92, label=label, color=colour if hatch is None else "white",
            edgecolor=colour, hatch=hatch, linewidth=1.2,
        )  # fmt: skip
        if kind == "even_measured":
            for x, d, h in zip(offsets, report.devices, heights, strict=True):
                if d.even_oom:
                    ax.annotate("OOM", (x, h), ha="center", va="bottom", fontsize=8,
                                color="tab:red", fontweight="bold", xytext=(0, 6),
                                textcoords="offset points")  # fmt: skip
    budget_drawn = False
    for x, d in zip(xs, report.devices, strict=True):
        if d.budget_bytes is not None:
            y = d.budget_bytes / 2**20
            top = max(top, y)
            ax.hlines(y, x - 0.45, x + 0.45, colors="tab:red", linewidth=2,
                      label=None if budget_drawn else "budget")  # fmt: skip
            budget_drawn = True
    labels = []
    for d in report.devices:
        even = "" if d.even_samples is None else f"\neven: {d.even_samples:g}"
        labels.append(f"{d.name}\nevendp: {_count(d.samples_per_step)}/step{even}")
    ax.set_xticks(list(xs), labels, fontsize=9)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, top * 1.4 if top else 1)  # room for the legend above the budget lines
    ax.set_title("Per-device memory for one step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncols=2)  # drawn only with figures (_shows)


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
    mkdir_private(out)  # 0700 when new, like every folder of a run
    paths = {"json": out / "report.json", "txt": out / "report.txt", "png": out / "report.png"}
    replace_file(paths["json"], (json.dumps(report.to_dict(), indent=2) + "\n").encode())
    console = Console(record=True, width=130, file=io.StringIO())
    console.print(report.table())
    console.print(report.summary())
    replace_file(paths["txt"], console.export_text().encode())
    png = io.BytesIO()
    _plot(report, png)
    replace_file(paths["png"], png.getvalue())
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

    def say(self, line: str) -> None:
        """``line`` above the bar while it is drawn (printing past it would tear it), else on
        stderr.

        >>> with TrainProgress(total=3, enabled=False) as bar:
        ...     bar.say("evendp: step 2: speed re-split [4, 4] -> [6, 2]")
        """
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
