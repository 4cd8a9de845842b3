"""The planner's answer: :class:`Plan` and :class:`DevicePlan`, as a table, JSON or a chart."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from .._core._units import byte_unit
from ._solve import Mode

__all__ = ["KINDS", "DevicePlan", "DeviceRows", "Plan"]

#: Above this many devices the table and the chart show one column per run of alike devices.
GROUP_ABOVE = 16

#: Row order of every breakdown (table, JSON, plot).
KINDS: tuple[str, ...] = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "outputs",
    "gathered_outputs",
    "gathered_grad",
    "loss",
    "buckets",
    "allocator",
    "cuda_context",
)


def _in_kind_order(breakdown: dict[str, int]) -> dict[str, int]:
    """``breakdown`` with its keys in :data:`KINDS`' order (the planner adds them as its phases
    meet them, which varies between runs), any other after them."""
    rank = {kind: i for i, kind in enumerate(KINDS)}
    return dict(sorted(breakdown.items(), key=lambda kv: rank.get(kv[0], len(KINDS))))


#: How the table and the chart name a kind, where its key alone would mislead: the rows are
#: what is live at the peak moment, and few gradients exist yet then (JSON keeps the keys).
KIND_LABELS: dict[str, str] = {"grads": "grads at peak", "allocator": "allocator (CUDA)"}


@dataclass(frozen=True)
class DevicePlan:
    """One device in a :class:`Plan`: its memory, share and predicted peak, by kind."""

    name: str
    free: int
    budget: int
    samples: int
    breakdown: dict[str, int]
    peak: int
    max_batch_alone: int
    even_samples: int
    even_breakdown: dict[str, int]
    even_peak: int
    max_tokens: int | None = None  # padded tokens this device holds (plan(seq_len=...))

    @property
    def fits(self) -> bool:
        """Whether the chosen share's predicted peak is within the budget."""
        return self.peak <= self.budget

    @property
    def even_fits(self) -> bool:
        """Whether the even split's predicted peak is within the budget."""
        return self.even_peak <= self.budget


class DeviceRows(Sequence[DevicePlan]):
    """``Plan.devices``: one :class:`DevicePlan` per device, made when read from runs of alike
    devices, so a plan over a million copies of one card holds a handful of objects.

    It is a read-only sequence (``len``, indexing, iteration) equal to the tuple of its
    items. ``runs`` are ``(start, count, prototype)``; ``name(i)`` is device ``i``'s name.

    >>> proto = DevicePlan("", 8, 8, 2, {}, 2, 4, 2, {}, 2)
    >>> rows = DeviceRows([(0, 3, proto)], lambda i: f"dev{i}")
    >>> len(rows), rows[2].name, [d.samples for d in rows]
    (3, 'dev2', [2, 2, 2])
    """

    def __init__(self, runs: list[tuple[int, int, DevicePlan]], name: Callable[[int], str]) -> None:
        self.runs = runs
        self._name = name
        self._len = sum(count for _, count, _ in runs)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> DevicePlan: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[DevicePlan, ...]: ...
    def __getitem__(self, index: int | slice) -> DevicePlan | tuple[DevicePlan, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._len)))
        i = index + self._len if index < 0 else index
        if not 0 <= i < self._len:
            raise IndexError(f"device {index} of {self._len}")
        for start, count, proto in self.runs:
            if i < start + count:
                return dataclasses.replace(proto, name=self._name(i))
        raise IndexError(index)  # unreachable: the runs cover 0..len-1

    def __iter__(self) -> Iterator[DevicePlan]:  # one pass over the runs, not one per item
        for start, count, proto in self.runs:
            for i in range(start, start + count):
                yield dataclasses.replace(proto, name=self._name(i))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple, so not hashable like one

    def __repr__(self) -> str:
        return f"DeviceRows({len(self)} devices in {len(self.runs)} runs)"


@dataclass(frozen=True)
class Plan:
    """Per-device memory for one training step and the split that maximizes the global batch.

    ``split`` is the per-device sample counts: pass it as
    ``BalancedDataParallel(weights=plan.split)`` or
    ``UnevenBatchSampler(batch_sizes=plan.split)``.

    ``extrapolated`` is ``True`` when a recommended size lies beyond the largest measured
    batch size (``measured_sizes``): there the prediction is a lower bound, not a guarantee.

    ``no_grad`` is ``True`` for a forward-only plan (``plan(..., no_grad=True)``: inference,
    evaluation); then ``training`` is the training plan on the same devices (its largest
    batch), or ``None`` when not even one training sample fits.

    ``max_tokens`` (with ``plan(..., seq_len=L)``, else ``None``) is each device's cap in
    padded tokens (rows x the longest row) for steps of rows at most ``L`` long: pass it as
    ``UnevenBatchSampler(costs=lengths, max_costs=plan.max_tokens)`` or
    ``Trainer(costs=lengths, max_costs=plan.max_tokens)``. ``token_cost`` is the fitted
    replica step bytes, ``fixed + tokens * (per_token + per_token_width * width)``.
    """

    mode: Mode
    devices: DeviceRows
    split: list[int]
    global_batch: int
    eta_mem: float
    even_split: list[int]
    even_global_batch: int
    even_eta_mem: float
    activation_bytes_per_sample: float
    output_bytes_per_sample: float
    measured_sizes: list[int]
    safety_margin: float
    seconds: float
    options: dict[str, Any] = field(default_factory=dict)
    extrapolated: bool = False
    no_grad: bool = False
    training: Plan | None = None
    max_tokens: list[int] | None = None
    seq_len: int | None = None
    token_cost: dict[str, float] | None = None

    @property
    def step(self) -> str:
        """What was planned, in words: ``"training step"`` or ``"forward only (no_grad)"``."""
        return "forward only (no_grad)" if self.no_grad else "training step"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (bytes as ints)."""
        return {
            "mode": self.mode,
            "split": list(self.split),
            "global_batch": self.global_batch,
            "eta_mem": self.eta_mem,
            "even_split": list(self.even_split),
            "even_global_batch": self.even_global_batch,
            "even_eta_mem": self.even_eta_mem,
            "activation_bytes_per_sample": self.activation_bytes_per_sample,
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "measured_sizes": list(self.measured_sizes),
            "safety_margin": self.safety_margin,
            "seconds": self.seconds,
            "extrapolated": self.extrapolated,
            "no_grad": self.no_grad,
            "max_tokens": None if self.max_tokens is None else list(self.max_tokens),
            "seq_len": self.seq_len,
            "token_cost": None if self.token_cost is None else dict(self.token_cost),
            **self._training_dict(),
            "options": dict(self.options),
            "devices": [
                {
                    "name": d.name,
                    "free": d.free,
                    "budget": d.budget,
                    "samples": d.samples,
                    "peak": d.peak,
                    "fits": d.fits,
                    "max_batch_alone": d.max_batch_alone,
                    "breakdown": _in_kind_order(d.breakdown),
                    "even_samples": d.even_samples,
                    "even_peak": d.even_peak,
                    "even_fits": d.even_fits,
                    "even_breakdown": _in_kind_order(d.even_breakdown),
                    "max_tokens": d.max_tokens,
                }
                for d in self.devices
            ],
        }

    def _training_dict(self) -> dict[str, Any]:
        """Under ``no_grad``: training's largest batch beside inference's (JSON key
        ``training``, ``None`` when no training sample fits); nothing for a training plan."""
        if not self.no_grad:
            return {}
        t = self.training
        if t is None:
            return {"training": None}
        return {
            "training": {
                "split": list(t.split),
                "global_batch": t.global_batch,
                "eta_mem": t.eta_mem,
                "max_batch_alone": [d.max_batch_alone for d in t.devices],
                "peak": [d.peak for d in t.devices],
            }
        }

    def _title(self) -> str:
        # Two short lines: rich wraps a title to the table's width, and a plan of one or
        # three devices is narrower than one long line (it came out as a ragged column).
        title = (
            f"evendp plan ({self.mode}, {self.step})\n"
            f"global batch {self.global_batch} (eta_mem {self.eta_mem:.3f}), "
            f"even split {self.even_global_batch} (eta_mem {self.even_eta_mem:.3f})"
        )
        if self.no_grad:
            trained = "nothing fits" if self.training is None else self.training.global_batch
            title += f"\ntraining: {trained}"
        return title

    def _caption(self) -> str:
        # Short lines: a terminal is often 80 columns, and rich wraps a caption to the table.
        lines = [
            "rows: what each device holds at its predicted peak",
            "eta_mem: the batch over the sum of what each device holds alone",
        ]
        if any(d.breakdown.get("grads", 0) for _, d, _ in self.columns()):
            lines.append("grads at peak: the gradients that exist then (few early in backward)")
        if any(d.breakdown.get("allocator", 0) for _, d, _ in self.columns()):
            lines.append("allocator: CUDA's caching allocator reserves it beyond the tensors")
        lines.append(
            f"budget = free x (1 - {self.safety_margin:g}); "
            f"planned in {self.seconds:.1f} s from batch sizes {self.measured_sizes}"
        )
        if self.extrapolated:
            lines += [
                "extrapolated: a recommended size lies beyond the largest measured one,",
                "where the predicted peak is a lower bound",
            ]
        return "\n".join(lines)

    def table(self) -> Any:
        """A ``rich.table.Table``: one column per device, one row per kind of memory live at
        the device's predicted peak (each figure in a readable binary unit: ``48.0 MiB``,
        ``24.00 GiB``); ``print`` shows it.

        The ``grads`` row is labelled "grads at peak": when a device peaks early in the
        backward, few gradients exist yet, and the row is far below the parameters' size.
        """
        from .._core._table import PrintableTable as Table
        from .._core._units import format_bytes as gib

        title, caption = self._title(), self._caption()
        lines = [*title.splitlines(), *caption.splitlines()]
        # Wide enough that the title and caption lines never wrap (up to 80 columns).
        table = Table(title=title, caption=caption, min_width=min(80, max(map(len, lines))))
        columns = self.columns()
        shown = [d for _, d, _ in columns]
        table.add_column("")
        for label, _, _ in columns:
            table.add_column(label, justify="right")
        table.add_row("samples", *[str(d.samples) for d in shown], style="bold")
        for kind in KINDS:
            if any(d.breakdown.get(kind, 0) for d in shown):
                label = KIND_LABELS.get(kind, kind)
                table.add_row(label, *[gib(d.breakdown.get(kind, 0)) for d in shown])
        table.add_row("predicted peak", *[gib(d.peak) for d in shown], style="bold")
        table.add_row("budget", *[gib(d.budget) for d in shown])
        table.add_row("max batch alone", *[str(d.max_batch_alone) for d in shown])
        if self.training is not None:
            t = [self.training.devices[i] for _, _, i in columns]
            table.add_row("training: samples", *[str(d.samples) for d in t])
            table.add_row("training: max batch alone", *[str(d.max_batch_alone) for d in t])
        table.add_row("even: samples", *[str(d.even_samples) for d in shown])
        table.add_row(
            "even: peak",
            *[gib(d.even_peak) + ("" if d.even_fits else " (OOM)") for d in shown],
        )
        return table

    def columns(self) -> list[tuple[str, DevicePlan, int]]:
        """What the table and the chart show: ``(label, device, first index)``, one per device
        up to :data:`GROUP_ABOVE` devices, beyond that one per run of alike devices (equal
        share, memory and peak here and in ``training``), labelled ``dev1..dev7 (x7)``."""
        n = len(self.devices)
        if n <= GROUP_ABOVE:
            return [(d.name, d, i) for i, d in enumerate(self.devices)]
        cuts = {start for start, _, _ in self.devices.runs}
        if self.training is not None:
            cuts |= {start for start, _, _ in self.training.devices.runs}
        bounds = [*sorted(cuts), n]
        out = []
        for a, b in itertools.pairwise(bounds):
            first = self.devices[a]
            label = (
                first.name if b - a == 1 else f"{first.name}..{self.devices[b - 1].name} (x{b - a})"
            )
            out.append((label, first, a))
        return out

    def __str__(self) -> str:
        """The table as text: ``print(plan)`` (and ``print(plan.table())``) show it."""
        return str(self.table())

    def plot(self, path: str) -> None:
        """Write a stacked bar chart (PNG): each device's memory by kind, ours beside even."""
        self._figure().savefig(path, dpi=110)

    def _figure(self) -> Any:
        """The chart as a matplotlib ``Figure`` (drawn on an Agg canvas)."""
        # The object API with an Agg canvas: no pyplot, no global backend switch, no display.
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        columns = self.columns()
        fig = Figure(figsize=(2 + 1.6 * len(columns), 4.5))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        width = 0.38
        colors = [colormaps["tab10"](c) for c in range(10)]
        most = max(
            max(sum(d.breakdown.values()), sum(d.even_breakdown.values()), d.budget)
            for _, d, _ in columns
        )
        unit, scale = byte_unit(most)  # the axis in the unit of its largest figure
        top = most / scale
        for j, (_, d, _) in enumerate(columns):
            budget = d.budget / scale
            ax.hlines(budget, j - width, j + width, colors="black", linestyles="--")
            for offset, parts, count in (
                (-width / 2, d.breakdown, d.samples),
                (width / 2, d.even_breakdown, d.even_samples),
            ):
                bottom = 0.0
                for c, kind in enumerate(KINDS):
                    h = parts.get(kind, 0) / scale
                    if h:
                        ax.bar(
                            j + offset,
                            h,
                            width,
                            bottom=bottom,
                            color=colors[c % 10],
                            label=KIND_LABELS.get(kind, kind) if j == 0 and offset < 0 else None,
                            hatch="//" if offset > 0 else None,
                            edgecolor="white",
                        )
                        bottom += h
                # A bar that ends just under the dashed budget line gets its count above
                # the line, not struck through by it; any other bar, right above its top.
                near = 0 <= budget - bottom < 0.06 * top
                ax.annotate(
                    str(count),
                    (j + offset, budget if near else bottom),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_ylim(0, top * 1.25 if top else 1)  # room for the counts and the legend
        ax.set_xticks(range(len(columns)), [label for label, _, _ in columns])
        ax.set_ylabel(f"{unit} (left: evendp, right hatched: even split; dashed: budget)")
        ax.set_title(
            f"{self.mode}{' no_grad' if self.no_grad else ''}: batch {self.global_batch} vs "
            f"even {self.even_global_batch} (numbers: samples per device)\n"
            f"eta_mem, the batch over what the devices hold alone: {self.eta_mem:.0%} vs "
            f"{self.even_eta_mem:.0%}",
            fontsize=10,
        )
        ax.legend(fontsize=7, loc="upper right", ncols=2)
        fig.tight_layout()
        return fig
