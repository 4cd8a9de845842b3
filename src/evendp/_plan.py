"""The memory planner: what every device will hold for a step, and the split that fills them.

How it measures. The model is built (or copied) under ``FakeTensorMode`` on fake *cpu*
tensors, so no real memory is touched and an 8-GPU, 40 GB model plans in seconds; fake
``cuda`` tensors cannot run backward on a machine with no GPU. ``MemTracker`` records every
storage of one training step (forward, loss, backward, optimizer step), by kind, and the
peak of each phase. A step is measured at a few batch sizes. Peak memory as a function of
the batch size is the maximum over moments of an affine function of it, so it is convex, and
the straight line between two measured sizes never under-predicts between them: the planner
interpolates between measured sizes and adds the size it is about to recommend to the
measured set, until the recommendation lies inside it.

What it counts per device (the design's memory model): parameters, gradients, optimizer state,
activations, outputs; on the DP output device the gathered outputs, their gradient and the
loss computed there; DDP's gradient buckets; and a fixed allowance for the CUDA context and
library workspaces, which a fake run cannot see.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ._devices import parse_bytes
from ._errors import EvendpError, PlanError
from ._memory import DeviceMemory, live_memory, parse_memory
from ._split import split_sizes

__all__ = ["DevicePlan", "Plan", "auto_weights", "plan", "profile_step"]

Mode = Literal["dp", "ddp"]
ModelLike = nn.Module | Callable[[], nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

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
    "cuda_context",
)
_DEFAULT_CONTEXT = 512 << 20  # CUDA context + cuBLAS/cuDNN workspaces, typical on recent GPUs
_MAX_ROUNDS = 4


# --------------------------------------------------------------------------- measurement


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        """MemTracker whose peak can be restarted, so each phase gets its own peak."""

        def reset_peak(self) -> None:
            # Private fields of MemTracker (torch >= 2.4): the running peak and its snapshot.
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {d: s["Total"] for d, s in self._peak_mem_snap.items()}

    return _Tracker


def _kinds(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """MemTracker snapshot (per device, per ``_MemRefType``) -> bytes by kind name."""
    out: dict[str, int] = {}
    for per_kind in snapshot.values():
        for key, value in per_kind.items():
            name = getattr(key, "name", str(key))
            out[name] = out.get(name, 0) + int(value)
    return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tree: Any) -> int:
    """Bytes of the distinct storages under ``tree``."""
    seen: dict[int, int] = {}
    for t in _tensors(tree):
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


class _Handoff(torch.autograd.Function):
    """Stand-in for DP's gather: the replica's outputs leave the device (tiny stand-ins stay),
    and in backward their full-size gradients arrive, as ``Scatter`` would deliver them."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.meta = [(x.shape, x.dtype) for x in xs]
        return tuple(x.new_zeros(()) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(shape, dtype=dtype) for shape, dtype in ctx.meta)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a model computed in ``forward`` (its first floating scalar), else a stand-in
    (mean of every floating output) whose backward allocates the same gradients."""
    floats = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    for t in floats:
        if t.dim() == 0:
            return t
    if not floats:
        raise PlanError(
            "the model's output has no floating tensor that requires grad, so there is nothing "
            "to backpropagate; return logits or a loss from forward, or pass criterion="
        )
    return sum((t.float().mean() for t in floats), torch.zeros(()))


@dataclass
class _Setup:
    """Everything a fake step needs, already validated."""

    make_model: Callable[[], nn.Module]  # a fresh model on fake tensors
    make_batch: Callable[[int], Any]
    criterion: Callable[..., torch.Tensor] | None
    optimizer: OptimizerFactory | None
    amp: torch.dtype | None
    checkpointing: bool | Callable[[nn.Module], bool]
    fake_mode: Any = None

    def autocast(self) -> AbstractContextManager[Any]:
        if self.amp is None:
            return nullcontext()
        return torch.autocast("cpu", dtype=self.amp)


def _apply_checkpointing(model: nn.Module, which: bool | Callable[[nn.Module], bool]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    check: Callable[[nn.Module], bool]
    if which is True:
        # Default: every block of every nn.ModuleList (the transformer-layer convention).
        blocks = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}

        def check_block(m: nn.Module) -> bool:
            return id(m) in blocks

        check = check_block

    elif callable(which):
        check = which
    else:
        return
    apply_activation_checkpointing(model, check_fn=check)


def _fresh_model(setup: _Setup) -> nn.Module:
    model = setup.make_model()
    if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
        with setup.fake_mode:  # fake cuda tensors cannot run backward without a GPU
            model = model.to("cpu")
    model.train()
    _apply_checkpointing(model, setup.checkpointing)
    return model


def _make_optimizer(setup: _Setup, model: nn.Module) -> torch.optim.Optimizer | None:
    if setup.optimizer is None:
        return None
    opt = setup.optimizer(model.parameters())
    for group in opt.param_groups:
        # On CUDA, optimizers default to the multi-tensor (foreach) path, whose temporaries
        # differ from the per-parameter loop CPU tensors default to: measure the CUDA one.
        if group.get("foreach", False) is None and not group.get("fused", False):
            group["foreach"] = True
    return opt


@dataclass(frozen=True)
class _Point:
    """One measured replica step at batch size ``n``."""

    n: int
    fwbw: dict[str, float]  # at the forward+backward peak: params, grads, activations, outputs
    forward_end: dict[str, float]  # after forward (and the DP hand-off): params, activations
    output_bytes: int
    static: dict[str, int]  # params, grads, optimizer, optimizer_extra (optimizer-step temps)


def _measure_replica(setup: _Setup, n: int, variant: str) -> _Point:
    """One fake step at batch size ``n``. ``variant``: ``keep`` (outputs held through the
    step: DDP, DP without gather), ``drop`` (DP, loss inside the model: outputs are copied
    away), ``handoff`` (DP with a criterion on the output device)."""
    model = _fresh_model(setup)
    tracker = _tracker_class()()
    with setup.fake_mode:
        opt = _make_optimizer(setup, model)
        with tracker:
            batch = setup.make_batch(n)
            inputs, targets = batch if setup.criterion is not None else (batch, None)
            tracker.reset_peak()
            with setup.autocast():
                output = _call(model, inputs)
                output_bytes = _nbytes(output)
                if variant == "handoff":
                    outs = [t for t in _tensors(output) if t.requires_grad]
                    loss: torch.Tensor = sum(_Handoff.apply(*outs), torch.zeros(()))
                    del outs
                elif setup.criterion is not None and targets is not None:
                    loss = setup.criterion(output, targets)
                else:
                    loss = _loss_of(output)
            if variant != "keep":
                del output  # DP copies outputs to the output device; the replica's go
            fwd = _kinds(tracker.get_tracker_snapshot())
            loss.backward()
            del loss
            peak = _kinds(tracker.get_tracker_snapshot("peak"))
            after_bw = _kinds(tracker.get_tracker_snapshot())
            tracker.reset_peak()
            before_opt = after_bw["Total"]
            optimizer_bytes = extra = 0
            if opt is not None:
                opt.step()
                opt_peak = _kinds(tracker.get_tracker_snapshot("peak"))
                optimizer_bytes = _kinds(tracker.get_tracker_snapshot()).get("OPT", 0)
                extra = max(0, opt_peak["Total"] - before_opt - optimizer_bytes)
                opt.zero_grad(set_to_none=True)
    params = peak.get("PARAM", 0) + peak.get("BUFFER", 0)
    fwbw_out = min(output_bytes, peak.get("ACT", 0) + peak.get("TEMP", 0))
    fwbw = {
        "params": float(params),
        "grads": float(peak.get("GRAD", 0)),
        "outputs": float(fwbw_out),
        "activations": float(peak["Total"] - params - peak.get("GRAD", 0) - fwbw_out),
    }
    fparams = fwd.get("PARAM", 0) + fwd.get("BUFFER", 0)
    forward_end = {"params": float(fparams), "activations": float(fwd["Total"] - fparams)}
    static = {
        "params": params,
        "grads": after_bw.get("GRAD", 0),
        "optimizer": optimizer_bytes,
        "optimizer_extra": extra,
    }
    return _Point(n, fwbw, forward_end, output_bytes, static)


def _measure_gathered(setup: _Setup, sample_output: Any, n_sample: int, total: int) -> _Point:
    """DP's output device at global batch ``total``: gathered outputs, their gradient, the loss.

    ``sample_output`` is a replica output at batch ``n_sample`` (shapes and dtypes only).
    """
    assert setup.criterion is not None  # only called with a criterion (internal invariant)
    tracker = _tracker_class()()
    with setup.fake_mode:
        _, targets = setup.make_batch(total)
        with tracker:

            def grow(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                if t.dim() == 0:  # DP gathers scalars into one entry per device
                    return torch.zeros((1,), dtype=t.dtype, requires_grad=t.requires_grad)
                shape = (t.shape[0] * total // max(n_sample, 1), *t.shape[1:])
                return torch.zeros(shape, dtype=t.dtype, requires_grad=t.is_floating_point())

            gathered = tree_map(grow, sample_output)
            tracker.reset_peak()
            with setup.autocast():
                loss = setup.criterion(gathered, targets)
            loss.backward()
            peak = _kinds(tracker.get_tracker_snapshot("peak"))
            grads = [t.grad for t in _tensors(gathered) if t.grad is not None]
            g_bytes = _nbytes(gathered)
            grad_bytes = _nbytes(grads)
            t_bytes = _nbytes(targets)
    held = {"gathered_outputs": float(g_bytes), "gathered_grad": float(grad_bytes)}
    loss_bytes = max(0, peak["Total"] - g_bytes - grad_bytes) + t_bytes
    crit = {**held, "loss": float(loss_bytes)}
    return _Point(total, crit, {**held, "loss": float(t_bytes)}, g_bytes, {})


class _Curve:
    """Bytes by kind as a function of batch size: piecewise linear through measured points,
    extended beyond them along the outermost segment (an upper bound for a convex peak)."""

    def __init__(self, points: dict[int, dict[str, float]]) -> None:
        self.points = dict(sorted(points.items()))

    def at(self, n: float) -> dict[str, float]:
        xs = list(self.points)
        if len(xs) == 1:
            return dict(self.points[xs[0]])
        i = 1
        while i < len(xs) - 1 and n > xs[i]:
            i += 1
        x0, x1 = xs[i - 1], xs[i]
        a, b = self.points[x0], self.points[x1]
        w = (n - x0) / (x1 - x0)
        return {k: a.get(k, 0.0) + w * (b.get(k, 0.0) - a.get(k, 0.0)) for k in a.keys() | b}

    def slope(self) -> float:
        """Total bytes per sample on the outermost segment."""
        xs = list(self.points)
        if len(xs) < 2:
            return 0.0
        a, b = self.points[xs[-2]], self.points[xs[-1]]
        return (sum(b.values()) - sum(a.values())) / (xs[-1] - xs[-2])


# --------------------------------------------------------------------------- the model


@dataclass
class _Model:
    """Per-device memory as a function of its own samples ``n`` and the global batch ``N``."""

    mode: Mode
    output_device: int
    static: dict[str, float]
    replica: _Curve
    forward_end: _Curve
    outputs: _Curve  # bytes of one replica's outputs
    gathered: _Curve | None  # output device, at N (None: no criterion there)
    gathered_held: _Curve | None
    buckets: int
    context: int

    def breakdown(self, i: int, n: int, total: int) -> dict[str, float]:
        """Bytes by kind on device ``i`` at its peak phase."""
        s = self.static
        opt_phase: dict[str, float] = {
            "params": s["params"],
            "grads": s["grads"],
            "optimizer": s["optimizer"] + s["optimizer_extra"],
        }
        if self.mode == "ddp":
            fwbw = {**self.replica.at(n), "optimizer": s["optimizer"], "buckets": self.buckets}
            opt_phase.update(outputs=self.outputs.at(n).get("bytes", 0.0), buckets=self.buckets)
            phases: list[dict[str, float]] = [fwbw, opt_phase]
        else:
            master, out_dev = i == 0, i == self.output_device
            if n > 0:
                fwbw, fend = self.replica.at(n), self.forward_end.at(n)
            elif master:
                fwbw = fend = {"params": float(s["params"])}
            else:
                fwbw = fend = {}
            if master:
                fwbw = {**fwbw, "optimizer": s["optimizer"]}
                fend = {**fend, "optimizer": s["optimizer"]}
            phases = [fwbw]
            held: dict[str, float] = {}
            if out_dev:
                if self.gathered is not None and self.gathered_held is not None:
                    phases.append(_add(fend, self.gathered.at(total)))
                    held = self.gathered_held.at(total)
                else:  # loss inside the model: DP gathers the outputs, nothing flows back
                    o = self.outputs.at(total).get("bytes", 0.0) * (1 if n or total else 0)
                    held = {"gathered_outputs": o}
                phases[0] = _add(fwbw, held)
            if master:
                after = {k: v for k, v in held.items() if k != "gathered_grad"}
                reduce: dict[str, float] = {
                    "params": s["params"],
                    "optimizer": s["optimizer"],
                    "grads": 2 * s["grads"],  # replica 0's grads + their reduced sum
                }
                phases += [_add(reduce, after), _add(opt_phase, after)]
        best = max(phases, key=lambda p: sum(p.values()))
        return {**best, "cuda_context": float(self.context)}

    def peak(self, i: int, n: int, total: int) -> float:
        return sum(self.breakdown(i, n, total).values())


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b}


def _largest(fits: Callable[[int], bool], hi_hint: int = 1) -> int:
    """Largest n >= 0 with ``fits(n)`` for a monotone ``fits``; -1 when not even 0 fits."""
    if not fits(0):
        return -1
    lo, hi = 0, max(1, hi_hint)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            raise PlanError("the planned batch is unbounded: the model uses no memory per sample")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _capped_even_split(caps: list[int], total: int) -> list[int]:
    """Split ``total`` as evenly as the caps allow: ``min(cap_i, level)`` for the lowest level.

    For equally fast devices the step takes as long as the largest share, so the best split
    that fits is the even one, with a device that cannot hold its even share kept at its cap
    and the rest spread evenly over the others (speed differences are the speed balancer's
    job, at run time). The caller guarantees ``sum(caps) >= total``.

    >>> _capped_even_split([100, 5, 100], 30)
    [13, 5, 12]
    """
    level = _largest(lambda lv: sum(min(c, lv) for c in caps) < total, 1) + 1
    sizes = [min(c, level) for c in caps]
    excess = sum(sizes) - total
    for i in reversed(range(len(sizes))):  # take the excess back from the uncapped, last first
        if excess and sizes[i] == level:
            sizes[i] -= 1
            excess -= 1
    return sizes


@dataclass
class _Solution:
    split: list[int]
    alone: list[int]
    even: list[int]


def _solve(model: _Model, budgets: list[int], batch: int | None) -> _Solution:
    k = len(budgets)

    def cap(i: int, total: int) -> int:
        return _largest(lambda n: model.peak(i, n, total) <= budgets[i], total or 1)

    def caps(total: int) -> list[int]:
        return [min(cap(i, total), total) for i in range(k)]

    def feasible(total: int) -> bool:
        c = caps(total)
        return min(c) >= 0 and sum(c) >= total

    def alone_cap(i: int) -> int:
        return max(0, _largest(lambda n: model.peak(i, n, n) <= budgets[i]))

    alone = [alone_cap(i) for i in range(k)]
    best = _largest(feasible, max(1, sum(alone)))
    if best < 1:
        raise PlanError(
            "not even one sample fits: "
            + "; ".join(
                f"device {i} needs {model.peak(i, 1, 1) / 2**30:.2f} GiB for one sample, "
                f"may use {budgets[i] / 2**30:.2f} GiB"
                for i in range(k)
            )
            + "; use devices with more free memory, a smaller model, AMP or checkpointing"
        )
    total = best if batch is None else batch
    if total > best:
        raise PlanError(
            f"a global batch of {batch} does not fit these devices; the largest that fits is "
            f"{best}; lower --batch, add devices or free memory"
        )
    split = _capped_even_split([max(c, 0) for c in caps(total)], total)

    def even_fits(t: int) -> bool:
        sizes = split_sizes(t, [1] * k)
        return all(model.peak(i, sizes[i], t) <= budgets[i] for i in range(k))

    even_total = total if batch is not None else max(0, _largest(even_fits, max(1, best)))
    return _Solution(split, alone, split_sizes(even_total, [1] * k))


# --------------------------------------------------------------------------- public results


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

    @property
    def fits(self) -> bool:
        """Whether the chosen share's predicted peak is within the budget."""
        return self.peak <= self.budget

    @property
    def even_fits(self) -> bool:
        """Whether the even split's predicted peak is within the budget."""
        return self.even_peak <= self.budget


@dataclass(frozen=True)
class Plan:
    """Per-device memory for one training step and the split that maximizes the global batch.

    ``split`` is the per-device sample counts: pass it as
    ``BalancedDataParallel(chunk_sizes=plan.split)`` or
    ``UnevenBatchSampler(batch_sizes=plan.split)``.
    """

    mode: Mode
    devices: tuple[DevicePlan, ...]
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
                    "breakdown": dict(d.breakdown),
                    "even_samples": d.even_samples,
                    "even_peak": d.even_peak,
                    "even_fits": d.even_fits,
                    "even_breakdown": dict(d.even_breakdown),
                }
                for d in self.devices
            ],
        }

    def table(self) -> Any:
        """A ``rich.table.Table``: one column per device, one row per kind of memory (GiB)."""
        from rich.table import Table

        def gib(x: int) -> str:
            return f"{x / 2**30:.2f}"

        table = Table(
            title=f"evendp plan ({self.mode}): global batch {self.global_batch} "
            f"(eta_mem {self.eta_mem:.3f}) vs even {self.even_global_batch} "
            f"(eta_mem {self.even_eta_mem:.3f})",
            caption=f"GiB; budget = free x (1 - {self.safety_margin:g}); "
            f"planned in {self.seconds:.1f} s from batch sizes {self.measured_sizes}",
        )
        table.add_column("")
        for d in self.devices:
            table.add_column(d.name, justify="right")
        table.add_row("samples", *[str(d.samples) for d in self.devices], style="bold")
        for kind in KINDS:
            if any(d.breakdown.get(kind, 0) for d in self.devices):
                table.add_row(kind, *[gib(d.breakdown.get(kind, 0)) for d in self.devices])
        table.add_row("predicted peak", *[gib(d.peak) for d in self.devices], style="bold")
        table.add_row("budget", *[gib(d.budget) for d in self.devices])
        table.add_row("max batch alone", *[str(d.max_batch_alone) for d in self.devices])
        table.add_row("even: samples", *[str(d.even_samples) for d in self.devices])
        table.add_row(
            "even: peak",
            *[gib(d.even_peak) + ("" if d.even_fits else " (OOM)") for d in self.devices],
        )
        return table

    def plot(self, path: str) -> None:
        """Write a stacked bar chart (PNG): each device's memory by kind, ours beside even."""
        # The object API with an Agg canvas: no pyplot, no global backend switch, no display.
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(2 + 1.6 * len(self.devices), 4.5))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        width = 0.38
        colors = [colormaps["tab10"](c) for c in range(10)]
        for j, d in enumerate(self.devices):
            for offset, parts, label in (
                (-width / 2, d.breakdown, f"{d.samples}"),
                (width / 2, d.even_breakdown, f"{d.even_samples}"),
            ):
                bottom = 0.0
                for c, kind in enumerate(KINDS):
                    h = parts.get(kind, 0) / 2**30
                    if h:
                        ax.bar(
                            j + offset,
                            h,
                            width,
                            bottom=bottom,
                            color=colors[c % 10],
                            label=kind if j == 0 and offset < 0 else None,
                            hatch="//" if offset > 0 else None,
                            edgecolor="white",
                        )
                        bottom += h
                ax.text(j + offset, bottom, label, ha="center", va="bottom", fontsize=8)
            ax.hlines(d.budget / 2**30, j - width, j + width, colors="black", linestyles="--")
        ax.set_xticks(range(len(self.devices)), [d.name for d in self.devices])
        ax.set_ylabel("GiB (left: evendp, right hatched: even split; dashed: budget)")
        ax.set_title(
            f"{self.mode}: batch {self.global_batch} (eta {self.eta_mem:.2f}) vs even "
            f"{self.even_global_batch} (eta {self.even_eta_mem:.2f})"
        )
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- validation


def _validate_model(model: Any) -> Callable[[Any], nn.Module]:
    """A function of the fake mode that returns a fresh fake copy of the model."""
    if isinstance(model, nn.Module):
        from torch._subclasses.fake_tensor import FakeCopyMode

        def copy_fake(fake_mode: Any) -> nn.Module:
            # Deep copy through FakeCopyMode: fake parameters, no real memory.
            with FakeCopyMode(fake_mode):
                return copy.deepcopy(model)

        return copy_fake
    if callable(model):

        def build(fake_mode: Any) -> nn.Module:
            with fake_mode:
                built = model()
            if not isinstance(built, nn.Module):
                raise EvendpError(
                    f"the model factory returned {type(built).__name__}, not an nn.Module"
                )
            return built

        return build
    raise EvendpError(f"model must be an nn.Module or a function returning one, got {model!r}")


def _validate_batch(batch: Any) -> Callable[[int], Any]:
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return batch
    if not _tensors(batch):
        raise EvendpError(
            f"batch must hold tensors (batch dimension 0) or be a function of the batch size, "
            f"got {batch!r}"
        )

    def resize(n: int) -> Any:
        # Fresh fake tensors of the example's dtypes with n samples: no values are needed.
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            shape = (n, *t.shape[1:]) if t.dim() else ()
            return torch.zeros(shape, dtype=t.dtype)

        return tree_map(one, batch)

    return resize


def _validate_options(
    mode: str, safety_margin: float, output_device: int, k: int, batch_size: int | None
) -> None:
    if mode not in ("dp", "ddp"):
        raise EvendpError(f"mode must be 'dp' or 'ddp', got {mode!r}")
    if not 0.0 <= safety_margin < 1.0:
        raise EvendpError(f"safety_margin must be in [0, 1), got {safety_margin!r}; e.g. 0.05")
    if not 0 <= output_device < k:
        raise EvendpError(
            f"output_device {output_device!r} is not one of the {k} devices 0..{k - 1}"
        )
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise EvendpError(f"batch_size must be a positive int or None, got {batch_size!r}")


def _validate_devices(devices: Any) -> list[DeviceMemory]:
    if devices is None:
        return live_memory()
    if isinstance(devices, str):
        return parse_memory(devices)
    if (
        isinstance(devices, Sequence)
        and devices
        and all(isinstance(d, DeviceMemory) for d in devices)
    ):
        return list(devices)
    if isinstance(devices, Sequence) and devices:
        return parse_memory(list(devices))
    raise EvendpError(
        f"devices must be a spec like '24GiB,24GiB,12GiB', a list of sizes or DeviceMemory, "
        f"or None for the live GPUs; got {devices!r}"
    )


@contextmanager
def _planning_errors(what: str) -> Iterator[None]:
    """Turn failures inside the user's model, batch or criterion into a PlanError."""
    try:
        yield
    except EvendpError:
        raise
    except Exception as exc:  # the user's code can raise anything; say where it happened
        raise PlanError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- entry points


def _make_setup(
    model: ModelLike,
    batch: Any,
    criterion: Callable[..., torch.Tensor] | None,
    optimizer: OptimizerFactory | None,
    amp: torch.dtype | None,
    checkpointing: bool | Callable[[nn.Module], bool],
) -> _Setup:
    from torch._subclasses.fake_tensor import FakeTensorMode

    if amp not in (None, torch.float16, torch.bfloat16):
        raise EvendpError(f"amp must be None, torch.float16 or torch.bfloat16, got {amp!r}")
    make = _validate_model(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    return _Setup(
        lambda: make(fake_mode),
        _validate_batch(batch),
        criterion,
        optimizer,
        amp,
        checkpointing,
        fake_mode,
    )


def profile_step(
    model: ModelLike,
    batch: Any,
    sizes: Sequence[int] = (8, 16),
    *,
    criterion: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    amp: torch.dtype | None = None,
    checkpointing: bool | Callable[[nn.Module], bool] = False,
) -> dict[str, Any]:
    """Measure one training step on fake tensors at each batch size in ``sizes``.

    Returns ``{"sizes", "params", "grads", "optimizer", "forward_bytes", "peak_bytes",
    "output_bytes"}``: the static bytes, and per size the memory held after forward (saved
    activations and outputs, parameters excluded) and the forward+backward peak (parameters
    included). The slope of ``forward_bytes`` is the activation bytes per sample.

    >>> net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    >>> p = profile_step(net, torch.randn(2, 32), sizes=(8, 16), optimizer=None)
    >>> p["params"] == sum(t.numel() * 4 for t in net.parameters())
    True
    >>> # per sample: the input, ReLU's output (saved), the logits: (32 + 64 + 4) * 4 bytes
    >>> (p["forward_bytes"][1] - p["forward_bytes"][0]) / 8
    400.0
    """
    setup = _make_setup(model, batch, criterion, optimizer, amp, checkpointing)
    points = []
    with _planning_errors("measuring the model on fake tensors"):
        for n in sizes:
            points.append(_measure_replica(setup, int(n), "keep"))
    return {
        "sizes": [p.n for p in points],
        "params": points[0].static["params"],
        "grads": points[0].static["grads"],
        "optimizer": points[0].static["optimizer"],
        "forward_bytes": [p.forward_end["activations"] for p in points],
        "peak_bytes": [sum(p.fwbw.values()) for p in points],
        "output_bytes": [p.output_bytes for p in points],
    }


def plan(
    model: ModelLike,
    batch: Any,
    devices: str | Sequence[Any] | None = None,
    *,
    mode: Mode = "dp",
    criterion: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    batch_size: int | None = None,
    amp: torch.dtype | None = None,
    checkpointing: bool | Callable[[nn.Module], bool] = False,
    gradient_as_bucket_view: bool = False,
    gather: bool = True,
    output_device: int = 0,
    safety_margin: float = 0.05,
    cuda_context: int | str = _DEFAULT_CONTEXT,
) -> Plan:
    """Predict every device's memory for a training step and choose the per-device split.

    Args:
        model: an ``nn.Module`` (copied onto fake tensors) or a function returning one
            (called under ``FakeTensorMode``: build on CPU, it allocates nothing).
        batch: an example batch (tensors with the batch in dim 0; its size does not matter)
            or a function ``batch(n)``. Without ``criterion`` it is the model's input (a
            tensor, a tuple of positional arguments, or a dict of keyword arguments) and the
            loss is the model's first scalar output; with ``criterion`` it is
            ``(inputs, targets)`` and the loss is ``criterion(model(inputs), targets)``.
        devices: ``"24GiB,24GiB-10GiB,12GiB"`` (see :func:`evendp.parse_memory`), a list of
            sizes or ``DeviceMemory``, or ``None`` to read the live GPUs' free memory.
        mode: ``"dp"`` (one process; device 0 holds the optimizer, and the gathered outputs
            and loss on ``output_device``) or ``"ddp"`` (one process per device).
        optimizer: a factory ``optimizer(params)``; ``None`` for no optimizer state.
        batch_size: plan this global batch; ``None`` for the largest that fits.
        amp: ``torch.bfloat16`` or ``torch.float16`` to plan under autocast.
        checkpointing: ``True`` to checkpoint every block of every ``nn.ModuleList``, or a
            predicate choosing the modules to checkpoint.
        gradient_as_bucket_view: DDP's option; without it buckets cost one more gradient.
        gather: DP only; ``False`` when the loss is computed per device
            (``ParallelCriterion``), so no outputs are gathered.
        safety_margin: each device may use ``free * (1 - safety_margin)``.
        cuda_context: bytes per device for the CUDA context and library workspaces.

    Raises :class:`PlanError` when the model fails on fake tensors or no batch fits.

    >>> net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    >>> p = plan(net, torch.randn(1, 256), "1GiB,1GiB,512MiB", mode="ddp",
    ...          cuda_context=0)
    >>> p.split == [d.samples for d in p.devices] and p.eta_mem >= 0.95
    True
    """
    start = time.perf_counter()
    mems = _validate_devices(devices)
    k = len(mems)
    _validate_options(mode, safety_margin, output_device, k, batch_size)
    context = parse_bytes(cuda_context)
    setup = _make_setup(model, batch, criterion, optimizer, amp, checkpointing)
    if mode == "ddp" or not gather:
        variant = "keep"
    else:
        variant = "handoff" if criterion is not None else "drop"
    budgets = [int(m.free * (1.0 - safety_margin)) for m in mems]

    replica: dict[int, _Point] = {}
    crit: dict[int, _Point] = {}
    with _planning_errors("running the model on fake tensors"):
        for n in (2, 4):
            replica[n] = _measure_replica(setup, n, variant)
    sample = None
    needs_crit = mode == "dp" and gather and criterion is not None
    if needs_crit:
        with _planning_errors("computing the criterion on fake gathered outputs"):
            sample = _sample_output(setup, 2)
            for n in (2, 4):
                crit[n] = _measure_gathered(setup, sample, 2, n)

    sol: _Solution | None = None
    mdl: _Model | None = None
    for _ in range(_MAX_ROUNDS):
        mdl = _build_model(
            mode, output_device, replica, crit, gradient_as_bucket_view, context, needs_crit
        )
        sol = _solve(mdl, budgets, batch_size)
        want_rep = {n for n in [*sol.split, *sol.alone, *sol.even] if n > max(replica)}
        want_crit = set()
        if needs_crit:
            totals = [sum(sol.split), sum(sol.even), sol.alone[output_device]]
            want_crit = {t for t in totals if t > max(crit)}
        if not want_rep and not want_crit:
            break
        with _planning_errors("running the model on fake tensors"):
            for n in sorted(want_rep)[-1:]:  # the largest: chords below it are upper bounds
                replica[n] = _measure_replica(setup, n, variant)
            for n in sorted(want_crit)[-1:]:
                assert sample is not None
                crit[n] = _measure_gathered(setup, sample, 2, n)
    assert sol is not None and mdl is not None
    return _result(
        mdl,
        mems,
        budgets,
        sol,
        replica,
        mode,
        safety_margin,
        start,
        {
            "criterion": criterion is not None,
            "optimizer": getattr(optimizer, "__name__", repr(optimizer)),
            "amp": None if amp is None else str(amp).removeprefix("torch."),
            "checkpointing": bool(checkpointing),
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "gather": gather,
            "output_device": output_device,
            "cuda_context": context,
        },
    )


def _sample_output(setup: _Setup, n: int) -> Any:
    """A replica's outputs at batch ``n`` (fake; only shapes and dtypes are used)."""
    model = _fresh_model(setup)
    with setup.fake_mode, torch.no_grad():
        inputs, _ = setup.make_batch(n)
        with setup.autocast():
            out = _call(model, inputs)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _build_model(
    mode: Mode,
    output_device: int,
    replica: dict[int, _Point],
    crit: dict[int, _Point],
    bucket_view: bool,
    context: int,
    needs_crit: bool,
) -> _Model:
    first = replica[min(replica)]
    static = {key: float(v) for key, v in first.static.items()}
    return _Model(
        mode=mode,
        output_device=output_device,
        static=static,
        replica=_Curve({n: p.fwbw for n, p in replica.items()}),
        forward_end=_Curve({n: p.forward_end for n, p in replica.items()}),
        outputs=_Curve({n: {"bytes": float(p.output_bytes)} for n, p in replica.items()}),
        gathered=_Curve({n: p.fwbw for n, p in crit.items()}) if needs_crit else None,
        gathered_held=_Curve({n: p.forward_end for n, p in crit.items()}) if needs_crit else None,
        buckets=0 if (mode == "dp" or bucket_view) else int(static["grads"]),
        context=context,
    )


def _result(
    mdl: _Model,
    mems: list[DeviceMemory],
    budgets: list[int],
    sol: _Solution,
    replica: dict[int, _Point],
    mode: Mode,
    margin: float,
    start: float,
    options: dict[str, Any],
) -> Plan:
    total, even_total = sum(sol.split), sum(sol.even)
    devices = []
    for i, m in enumerate(mems):
        ours = {k: round(v) for k, v in mdl.breakdown(i, sol.split[i], total).items() if v}
        even = {k: round(v) for k, v in mdl.breakdown(i, sol.even[i], even_total).items() if v}
        devices.append(
            DevicePlan(
                name=m.name,
                free=m.free,
                budget=budgets[i],
                samples=sol.split[i],
                breakdown=ours,
                peak=sum(ours.values()),
                max_batch_alone=sol.alone[i],
                even_samples=sol.even[i],
                even_breakdown=even,
                even_peak=sum(even.values()),
            )
        )
    reach = max(1, sum(sol.alone))
    sizes = sorted(replica)
    fe = _Curve({n: {"b": replica[n].forward_end["activations"]} for n in sizes})
    out = _Curve({n: {"b": float(replica[n].output_bytes)} for n in sizes})
    return Plan(
        mode=mode,
        devices=tuple(devices),
        split=list(sol.split),
        global_batch=total,
        eta_mem=total / reach,
        even_split=list(sol.even),
        even_global_batch=even_total,
        even_eta_mem=even_total / reach if all(d.even_fits for d in devices) else 0.0,
        activation_bytes_per_sample=fe.slope(),
        output_bytes_per_sample=out.slope(),
        measured_sizes=sizes,
        safety_margin=margin,
        seconds=time.perf_counter() - start,
        options=options,
    )


def auto_weights(
    module: nn.Module,
    device_ids: Sequence[torch.device | int | str],
    example_inputs: Any,
    *,
    output_device: int = 0,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    safety_margin: float = 0.1,
) -> list[float]:
    """Per-device weights for ``BalancedDataParallel(chunk_sizes="auto")``, from live memory.

    Plans DP on the devices' free memory right now (NVML, or ``torch.cuda.mem_get_info``),
    counting the module's parameters already resident there as available to it, and returns
    the largest split that fits as weights. On non-CUDA (virtual CPU) devices there is no
    memory to read: every device gets weight 1.0.

    >>> auto_weights(nn.Linear(4, 2), ["cpu", "cpu", "cpu"], torch.randn(5, 4))
    [1.0, 1.0, 1.0]
    """
    devices = [
        torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids
    ]
    if not devices:
        raise EvendpError("device_ids is empty; pass the devices BalancedDataParallel uses")
    if any(d.type != "cuda" for d in devices):
        return [1.0] * len(devices)
    # --- GPU-only path below. ---
    indices = [d.index if d.index is not None else torch.cuda.current_device() for d in devices]
    live = {m.name: m for m in live_memory(sorted(set(indices)))}
    resident: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "cuda":
            resident[t.device.index] = (
                resident.get(t.device.index, 0) + t.numel() * t.element_size()
            )
    mems = []
    for i in indices:
        repeats = indices.count(i)  # virtual devices share one GPU's memory
        free = live[f"cuda:{i}"].free + resident.get(i, 0)
        mems.append(DeviceMemory(f"cuda:{i}", free // repeats))
    result = plan(
        module,
        example_inputs,
        mems,
        mode="dp",
        optimizer=optimizer,
        output_device=output_device,
        safety_margin=safety_margin,
        cuda_context=0,
    )
    return [float(n) for n in result.split]
