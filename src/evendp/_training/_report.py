"""A run's final report: a table, ``report.json``, ``report.txt`` and ``report.png``.

The PNG shows per device its budget as a line and the memory of evendp's split and of an even
split (what ``nn.DataParallel`` runs) as bars, then the loss. Every figure is *measured* (a
GPU's peak reserved bytes, or a budgeted virtual device's enforced forward peak) or *planned*
(the planner's peak), never one under the other's name. The replicas of one GPU share its
allocator: they show as one row (:meth:`TrainReport.device_rows`); each replica's share of
every step stays in ``batch_sizes_per_step``, named by ``replicas``.
"""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from .._core._files import mkdir_private, replace_file
from .._core._units import byte_unit, format_bytes

__all__ = [
    "FORWARD",
    "RESERVED",
    "DeviceStat",
    "TrainReport",
    "format_bytes",
    "on_devices",
    "plot_panels",
    "write_report",
]


def _count(x: float) -> str:
    """A per-step sample count: whole when it is, else one decimal (an epoch's short step).

    >>> _count(12.0), _count(11.9333)
    ('12', '11.9')
    """
    return f"{x:g}" if float(x).is_integer() else f"{x:.1f}"


#: The kinds of measured peak (``DeviceStat.peak_kind``): the CUDA allocator's peak reserved
#: bytes (:mod:`evendp._training._peak_memory`), or a budgeted virtual device's enforced
#: forward peak (:mod:`evendp._training._budget`).
RESERVED, FORWARD = "reserved", "forward"
PEAK_KINDS = (RESERVED, FORWARD)

# What a cell says where nothing was measured (a CPU device without a budget, another rank's).
NOT_MEASURED = "not measured"


@dataclass
class DeviceStat:
    """One device's share and memory in a run (memory figures in bytes, ``None`` if unknown)."""

    name: str
    samples_per_step: float  # the mean over the steps run
    peak_bytes: int | None = None  # measured, of kind peak_kind
    planned_bytes: int | None = None  # planner, our split
    even_planned_bytes: int | None = None  # planner, an even split of the same batch
    budget_bytes: int | None = None  # the device's declared memory (a virtual device's budget)
    peak_kind: str | None = None  # what peak_bytes measures: one of PEAK_KINDS
    even_samples: int | None = None  # an even split's share of the same batch
    even_forward_peak_bytes: int | None = None  # measured for the even split (at the OOM: so far)
    even_oom: bool = False  # the even split ran out of this device's budget
    samples: int | None = None  # samples trained in the steps run (None: not counted)
    replicas: int = 1  # the run's replicas on this device (one GPU repeated in device_ids)


def _total(values: list[int | None]) -> int | None:
    """The sum of the replicas' figures, ``None`` unless every replica has one."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _merged(group: list[DeviceStat]) -> DeviceStat:
    """The replicas of one device as one row: shares and planned figures summed, the
    device's one measured peak (every replica reads the same allocator) kept once."""
    peaks = [d.peak_bytes for d in group if d.peak_bytes is not None]
    first = group[0]
    return replace(
        first,
        samples_per_step=sum(d.samples_per_step for d in group),
        peak_bytes=max(peaks) if peaks else None,
        planned_bytes=_total([d.planned_bytes for d in group]),
        even_planned_bytes=_total([d.even_planned_bytes for d in group]),
        budget_bytes=_total([d.budget_bytes for d in group]),
        even_samples=_total([d.even_samples for d in group]),
        even_forward_peak_bytes=_total([d.even_forward_peak_bytes for d in group]),
        even_oom=any(d.even_oom for d in group),
        samples=_total([d.samples for d in group]),
        replicas=sum(d.replicas for d in group),
    )


def on_devices(replicas: list[DeviceStat]) -> list[DeviceStat]:
    """One row per device: the replicas that share a name (one GPU repeated in
    ``device_ids``) merged, in the order each device first appears.

    >>> rows = on_devices([DeviceStat("cuda:0", 12, 2**27, 3 << 20, peak_kind="reserved"),
    ...                    DeviceStat("cuda:0", 4, 2**27, 1 << 20, peak_kind="reserved")])
    >>> [(d.name, d.replicas, d.samples_per_step, d.peak_bytes, d.planned_bytes) for d in rows]
    [('cuda:0', 2, 16, 134217728, 4194304)]
    """
    groups: dict[Any, list[DeviceStat]] = {}
    for i, d in enumerate(replicas):
        # A budgeted virtual device is its own device, whatever its name: its own budget.
        groups.setdefault(i if d.peak_kind == FORWARD else d.name, []).append(d)
    return [g[0] if len(g) == 1 else _merged(g) for g in groups.values()]


def _row_name(d: DeviceStat) -> str:
    """A device's name in the table and the picture; a repeated GPU says it is one.

    >>> _row_name(DeviceStat("cuda:0", 16, replicas=2)), _row_name(DeviceStat("cpu:1", 8))
    ('cuda:0 (2 replicas)', 'cpu:1')
    """
    return d.name if d.replicas == 1 else f"{d.name} ({d.replicas} replicas)"


@dataclass
class TrainReport:
    """The outcome of a run: per-device figures, the loss curve and the OOM counters.

    ``devices`` holds one :class:`DeviceStat` per replica (each entry of ``device_ids`` in
    one process; each rank across ranks); what is shown and written has one row per device
    (:meth:`device_rows`).

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
    #: Per step this call ran, each replica's batch size: in one process each device's share
    #: of the step (one entry per entry of ``device_ids``), across ranks each rank's (the
    #: split, which ``balance="speed"`` changes at step boundaries). Short steps included.
    batch_sizes_per_step: list[list[int]] = field(default_factory=list)

    @property
    def replicas(self) -> list[str]:
        """What each column of :attr:`batch_sizes_per_step` is: the replica's device name
        (``rank<r>`` across ranks), one per entry of :attr:`devices`.

        >>> TrainReport([DeviceStat("cuda:0", 3), DeviceStat("cuda:0", 1)]).replicas
        ['cuda:0', 'cuda:0']
        """
        return [d.name for d in self.devices]

    def device_rows(self) -> list[DeviceStat]:
        """One row per device (the table's, the picture's, ``report.json``'s ``devices``):
        :attr:`devices` with the replicas of one GPU merged (:func:`on_devices`)."""
        return on_devices(self.devices)

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
        rows = self.device_rows()
        shown = _memory_columns(rows)
        for name, _ in shown:
            table.add_column(name, justify="right")
        total = sum(d.samples_per_step for d in rows) or 1.0
        for d in rows:
            cells = []
            for name, get in shown:
                value = get(d)
                if name == "even split":
                    cells.append("-" if value is None else f"{value:g}")
                elif value is None and name in _MEASURED:
                    cells.append(NOT_MEASURED)
                else:
                    oom = name.startswith("even fwd") and d.even_oom
                    cells.append(format_bytes(value) + (" OOM" if oom else ""))
            table.add_row(
                _row_name(d),
                _count(d.samples_per_step),
                f"{d.samples_per_step / total:.0%}",
                *cells,
            )
        return table

    def title(self) -> str:
        """One line naming the run: model, devices, global batch, steps.

        >>> TrainReport([DeviceStat("cpu:0", 2)], steps=5, global_batch=2, model="GPT").title()
        'evendp dp: GPT on 1 device (cpu:0), global batch 2, 5 steps'
        >>> TrainReport([DeviceStat("cuda:0", 3), DeviceStat("cuda:0", 1)], global_batch=4).title()
        'evendp dp: on 1 device (cuda:0 with 2 replicas), global batch 4, 0 steps'
        """
        rows = self.device_rows()
        names = ", ".join(
            d.name if d.replicas == 1 else f"{d.name} with {d.replicas} replicas" for d in rows
        )
        what = f"{self.model} on " if self.model else "on "
        count = len(rows)
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
        data["devices"] = [asdict(d) for d in self.device_rows()]
        for d in data["devices"]:  # an integer when whole (every step the same)
            x = d["samples_per_step"]
            d["samples_per_step"] = int(x) if float(x).is_integer() else x
        data["replicas"] = self.replicas
        data["first_loss"], data["final_loss"] = self.first_loss, self.final_loss
        return data


# The measured columns: a cell without a figure there says "not measured", never a dash.
_MEASURED = ("peak reserved, measured", "fwd peak, measured", "peak, measured")


def _memory_columns(rows: list[DeviceStat]) -> list[tuple[str, Any]]:
    """The memory columns some row has a figure for, measured ones by their kind; when no
    row measured anything, one "peak, measured" column saying so (it also holds a peak of
    no known kind).

    >>> [n for n, _ in _memory_columns([DeviceStat("rank0", 16), DeviceStat("rank1", 16)])]
    ['peak, measured']
    """

    def measured(kind: str) -> Any:
        return lambda d: d.peak_bytes if d.peak_kind == kind else None

    columns = [
        ("budget", lambda d: d.budget_bytes),
        ("peak reserved, measured", measured(RESERVED)),
        ("fwd peak, measured", measured(FORWARD)),
        ("peak, planned", lambda d: d.planned_bytes),
        ("even split", lambda d: d.even_samples),
        ("even fwd, measured", lambda d: d.even_forward_peak_bytes),
        ("even peak, planned", lambda d: d.even_planned_bytes),
    ]
    shown = [(n, f) for n, f in columns if any(f(d) is not None for d in rows)]
    unnamed = [d for d in rows if d.peak_bytes is not None and d.peak_kind not in PEAK_KINDS]
    if unnamed or all(d.peak_bytes is None for d in rows):  # a figure of no known kind, or none
        after_budget = int(any(d.budget_bytes is not None for d in rows))
        shown.insert(
            after_budget,
            ("peak, measured", lambda d: None if d.peak_kind in PEAK_KINDS else d.peak_bytes),
        )
    return shown


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
    CPU's ranks), the split over steps where several replicas share a step and the split
    moved (or no memory panel shows each device's share), the loss always.

    >>> r = TrainReport([DeviceStat("cpu:0", 3), DeviceStat("cpu:1", 1)], losses=[2.0, 1.0],
    ...                 steps=2, batch_sizes_per_step=[[2, 2], [3, 1]])
    >>> [panel.__name__ for panel in plot_panels(r)]
    ['_plot_split', '_plot_loss']
    """
    rows, split = report.device_rows(), report.batch_sizes_per_step
    memory = any(v is not None for d in rows for v in [*_memory_bars(d).values(), d.budget_bytes])
    several = any(len(sizes) > 1 for sizes in split)
    moved = several and (_split_changes(split) > 0 or not memory)
    return [_plot_memory] * memory + [_plot_split] * moved + [_plot_loss]


def _plot_loss(ax: Any, report: TrainReport) -> None:
    """The training loss per step, and the validation curve where evaluated."""
    ax.plot(range(1, len(report.losses) + 1), report.losses, label="training")
    if report.eval:  # the validation loss (else the first metric) at each evaluated step
        metrics = report.eval[-1]["metrics"]
        name = "loss" if "loss" in metrics else next(iter(metrics), None)
        points = [(e["step"], e["metrics"][name]) for e in report.eval if name in e["metrics"]]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=f"validation {name}")
            ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)


def _plot_split(ax: Any, report: TrainReport) -> None:
    """Each rank's batch size at each step this run trained, stacked (the global batch on
    top): a speed re-split, or a split by cost, shows as a step where the bands change
    width."""
    split = report.batch_sizes_per_step
    first = report.steps - len(split) + 1  # a resumed run's steps keep their numbers
    # Step k spans [k, k + 1): the last step (a short one too) gets its width.
    steps = range(first, first + len(split) + 1)
    ranks = list(zip(*split, split[-1], strict=True))
    names = report.replicas  # numbered where one device holds several
    if len(set(names)) < len(names):
        names = [f"{name} #{i}" for i, name in enumerate(names)]
    ax.stackplot(steps, ranks, labels=names, step="post")
    changes = _split_changes(split)
    # A change: a speed re-split, or a split by cost that moves with the step's samples.
    ax.set_title("Split over steps" + (f" ({changes} change{'s' * (changes != 1)})"))
    ax.set_xlabel("step")
    ax.set_ylabel("samples per step")
    ax.set_ylim(0, max(sum(s) for s in split) * 1.25)  # room for the legend
    ax.legend(fontsize=8, loc="upper right", ncols=min(len(ranks), 4))
    ax.grid(alpha=0.3)


def _split_changes(split: list[list[int]]) -> int:
    """How often the split of a whole step changed (an epoch's short step is no change).

    >>> _split_changes([[6, 6], [9, 3], [9, 3], [2, 1]])
    1
    """
    return sum(a != b and sum(a) == sum(b) for a, b in itertools.pairwise(split))


# (label, colour, hatch) per bar kind; measured bars are solid, planned ones hatched.
_BARS = {
    "ours_measured": ("evendp split, measured", "tab:blue", None),
    "ours_planned": ("evendp split, planned", "tab:blue", "//"),
    "even_measured": ("even split, measured", "tab:orange", None),
    "even_planned": ("even split, planned", "tab:orange", "//"),
}


def _memory_bars(d: DeviceStat) -> dict[str, int | None]:
    return {
        "ours_measured": d.peak_bytes,
        "ours_planned": d.planned_bytes,
        "even_measured": d.even_forward_peak_bytes,
        "even_planned": d.even_planned_bytes,
    }


def _plot_memory(ax: Any, report: TrainReport) -> None:
    """Per device: the budget as a line, evendp's split and the even split as bars."""
    rows = report.device_rows()
    bars = [_memory_bars(d) for d in rows]
    kinds = [k for k in _BARS if any(b[k] is not None for b in bars)]
    xs = range(len(rows))
    figures = [v or 0 for b in bars for v in b.values()] + [d.budget_bytes or 0 for d in rows]
    unit, scale = byte_unit(max(figures))  # the axis in the unit of its largest figure
    width = 0.8 / max(len(kinds), 1)
    top = 0.0
    for j, kind in enumerate(kinds):
        label, colour, hatch = _BARS[kind]
        if kind == "ours_measured":  # what was measured: "reserved", "forward" or both
            measured = dict.fromkeys(d.peak_kind for d in rows if d.peak_kind is not None)
            label = f"evendp split, measured ({', '.join(measured)})"
        if kind == "even_measured":
            oom = any(d.even_oom for d in rows)
            label = "even split, measured (forward" + (", until OOM)" if oom else ")")
        offsets = [x - 0.4 + width * (j + 0.5) for x in xs]
        heights = [(b[kind] or 0) / scale for b in bars]
        top = max(top, *heights)
        ax.bar(
            offsets, heights, width * 0.92, label=label, color=colour if hatch is None else "white",
            edgecolor=colour, hatch=hatch, linewidth=1.2,
        )  # fmt: skip
        if kind == "even_measured":
            for x, d, h in zip(offsets, rows, heights, strict=True):
                if d.even_oom:
                    ax.annotate("OOM", (x, h), ha="center", va="bottom", fontsize=8,
                                color="tab:red", fontweight="bold", xytext=(0, 6),
                                textcoords="offset points")  # fmt: skip
    budget_drawn = False
    for x, d in zip(xs, rows, strict=True):
        if d.budget_bytes is not None:
            y = d.budget_bytes / scale
            top = max(top, y)
            ax.hlines(y, x - 0.45, x + 0.45, colors="tab:red", linewidth=2,
                      label=None if budget_drawn else "budget")  # fmt: skip
            budget_drawn = True
    labels = []
    for d in rows:
        even = "" if d.even_samples is None else f"\neven: {d.even_samples:g}"
        labels.append(f"{_row_name(d)}\nevendp: {_count(d.samples_per_step)}/step{even}")
    ax.set_xticks(list(xs), labels, fontsize=9)
    ax.set_ylabel(unit)
    ax.set_ylim(0, top * 1.4 if top else 1)  # room for the legend above the budget lines
    ax.set_title("Per-device memory for one step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncols=2)  # drawn only with figures (_shows)


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
