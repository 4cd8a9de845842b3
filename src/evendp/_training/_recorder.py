"""What a :class:`~evendp._training._trainer.Trainer` run records, shows and reports, fed from
outside its step: where the run stands (:class:`TrainState`, a checkpoint part), the callbacks'
hooks (:class:`Callbacks`), the progress bar and its text, the notes of re-splits, the figures
``on_log`` gets, and the :class:`~evendp._training._report.TrainReport` at the end.

The Trainer formats nothing: once per step it hands one :class:`Recorder` what the step
returned (:class:`~evendp._training._step.StepResult`) and the step's layout; the recorder reads
the rest from the trainer it observes (its strategy, OOM guard, speed balancer, evaluations).

Step losses stay on their device until read: under DDP/FSDP2 each rank records its part of a
step's loss, and :meth:`TrainState.flush` sums the pending parts over ranks in one collective on
the display steps (:func:`display_due`, the same on every rank, so the collective pairs), a
checkpoint, the report. The hooks and when each runs: docs/training.md, "Logging and callbacks".
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import torch

from .._core._errors import EvendpError
from .._distributed._step_layout import StepLayout
from .._planning._balance import split_per_step
from ._report import FORWARD, RESERVED, DeviceStat, TrainReport, format_bytes
from ._step import StepResult

__all__ = [
    "HOOKS",
    "Callback",
    "Callbacks",
    "Recorder",
    "TrainProgress",
    "TrainState",
    "display_due",
]


class Recorder:
    """One fit's bar, notes and report, observing ``trainer`` (a
    :class:`~evendp._training._trainer.Trainer`).

    >>> from evendp import TrainConfig, Trainer
    >>> data = torch.utils.data.TensorDataset(torch.ones(6, 2), torch.zeros(6))
    >>> loss = lambda m, b: ((m(b[0]).squeeze(1) - b[1]) ** 2).mean()
    >>> t = Trainer(torch.nn.Linear(2, 1), data, TrainConfig(steps=2, batch_size=3,
    ...             progress=False), loss_fn=loss, device_ids=["cpu", "cpu"], weights=[2, 1])
    >>> report = t.fit()
    >>> t.recorder.memory_text(), report.batch_sizes_per_step
    ('-', [[2, 1], [2, 1]])
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        #: Per step this fit ran, each replica's rows (the report's ``batch_sizes_per_step``).
        self.splits: list[list[int]] = []
        self._start_step = 0
        self._before: tuple[list[int], int] = ([], 0)  # samples and skipped steps before
        self._started = time.perf_counter()
        self._shown: float | None = None  # the loss on the bar, read on display steps only
        self._reads = False  # whether display steps read the losses (a bar or callbacks)
        self.bar = TrainProgress(0, enabled=False)

    def start(self) -> TrainProgress:
        """At the start of a fit (after a resume): what ran before stays out of its report.
        Returns the progress bar (a context manager; drawn on rank 0 with ``progress``)."""
        t, state = self.trainer, self.trainer.state
        self.splits = []
        self._start_step = state.step
        self._before = (list(state.samples), self.skipped_steps())
        self._started = time.perf_counter()
        self._shown = None
        # Under torchrun the ranks agree once whether any has callbacks (one all-reduce), so a
        # logger on rank 0 alone still has every rank join the loss reads of its on_log.
        mine = int(bool(t.callbacks))
        anywhere = (mine if t.world == 1 else sum(t.strategy.reduce_samples([mine]))) > 0
        self._reads = anywhere or t.config.progress
        show = t.config.progress and t.rank == 0
        self.bar = TrainProgress(t.config.steps, enabled=show, start=state.step)
        return self.bar

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.perf_counter() - self._started

    def step_done(self, result: StepResult, layout: StepLayout) -> None:
        """Record the step just done (the trainer's ``state.step`` already counts it): its
        loss, each device's samples, the layout's rows, this rank's OOM notes; on display
        steps the reads and ``on_log``; the callbacks' ``on_step_end``; an evaluation when
        due; the bar."""
        t, state = self.trainer, self.trainer.state
        self.splits.append(list(itertools.chain.from_iterable(layout.rows)))
        if t.guard.notes:  # this rank's re-splits and skips (nearly every step: none)
            where = f"step {state.step}" + (f", rank {t.rank}" if t.world > 1 else "")
            for note in t.guard.notes:
                self.bar.say(f"evendp: {where}: {note}")
            t.guard.notes.clear()
        # This process's devices' rows, in the report's places (0 on other ranks' devices).
        before, devices = t.rank * len(t.strategy.devices), len(t.device_names)
        t.micro_steps = [
            [0] * before + rows + [0] * (devices - before - len(rows)) for rows in result.micro_rows
        ]
        ran = list(map(sum, zip(*t.micro_steps, strict=True))) if t.micro_steps else [0] * devices
        # The loss is this process's part: reduce_losses makes it the step's. A step the gate
        # skipped on the device is dropped when the flags are read.
        state.record(result.loss, ran, result.skipped)
        cfg = t.config
        if display_due(state.step, self._start_step, cfg.steps, cfg.log_every):
            self._log(result.loss)  # the same steps on every rank: the reads pair
        t.callbacks.call("on_step_end", t, state.step)
        t.watches.call("on_step_end", t, state.step)
        if t.eval_data is not None and (
            state.step == cfg.steps or bool(cfg.eval_every and state.step % cfg.eval_every == 0)
        ):
            t._evaluate()
        text = self.bar_text() if self.bar.enabled else ""
        self.bar.update(
            state.step, None if result.loss is None else self._shown, layout.samples, text
        )

    def _log(self, loss: torch.Tensor | None) -> None:
        """On a display step: the non-finite gate's verdict always; with a bar or callbacks
        (agreed by the ranks) the losses, summed over ranks in one collective, and ``on_log``."""
        t = self.trainer
        t.stepper.settle()
        if not self._reads:
            return
        t._read_pending()
        if t.config.progress and t.rank == 0 and loss is not None:
            self._shown = t.state.last_loss
        t.callbacks.call("on_log", t, t.state.step, self.log_metrics(loss))

    def skipped_steps(self) -> int:
        """Steps skipped so far: by an OOM everywhere, or by the non-finite gate (a read)."""
        return self.trainer.guard.skipped + self.trainer.stepper.skipped

    # -- lines and text ----------------------------------------------------------------------

    def say_resumed(self, notes: list[str], received: list[str]) -> None:
        """A resume's notes (rank 0), and the files this rank received from rank 0 (each
        rank: on another machine they are said there)."""
        rank = self.trainer.rank
        for note in notes if rank == 0 else []:
            print(f"evendp: {note}", file=sys.stderr, flush=True)
        for note in received:
            print(f"evendp: rank {rank}: {note}", file=sys.stderr, flush=True)

    def resplit(self) -> None:
        """After the speed balancer's step changed the split (every rank alike; the sampler
        has it, through its ``on_resplit``): rank 0 says the step, the split before and after
        and the per-sample times it went by."""
        t = self.trainer
        if t.rank != 0:
            return
        (_, before), (step, after) = t.balancer.history[-2:]
        said = ", ".join(
            "-" if x is None else f"{x * 1e3:.3g}" for x in t.balancer.seconds_per_sample
        )
        self.bar.say(
            f"evendp: step {step}: speed re-split {list(before)} -> {list(after)} (ms per "
            f"sample by rank: {said})"
        )

    def bar_text(self) -> str:
        """The bar's memory column: measured peaks, the OOM caps (once an OOM, or a resumed
        run, capped some device's micro-batches), the last evaluation."""
        text = self.memory_text()
        caps = self.trainer.guard.micro_batch_sizes
        if any(c is not None for c in caps):
            text += " micro-batch " + "/".join("all" if c is None else str(c) for c in caps)
        evals = self.trainer.evals
        if evals:
            text += "".join(f" val {k} {v:.4f}" for k, v in evals[-1]["metrics"].items())
        return text

    def peaks(self) -> list[int | None]:
        """Per device, the measured peak: the CUDA allocator's, else a budget's forward peak."""
        peaks, budgets = self.trainer._device_peaks(), self.trainer.memory_budgets
        if budgets is None:
            return peaks
        return [p if p is not None else b for p, b in zip(peaks, budgets.peaks, strict=True)]

    def memory_text(self) -> str:
        """The measured peaks as the bar shows them."""
        t = self.trainer
        if t.memory_budgets is not None:  # virtual CPU devices: one measured peak each
            return "/".join("-" if p is None else format_bytes(p) for p in self.peaks())
        # Replicas of one GPU share its figure: one per device (two GPUs may read alike).
        peaks = dict(zip(t.device_names, t._device_peaks(), strict=True))
        shown = [format_bytes(p) for p in peaks.values() if p is not None]
        return " ".join(shown) if shown else "-"

    def log_metrics(self, loss: torch.Tensor | None) -> dict[str, float]:
        """What ``on_log`` gets: the step's loss (read already), the lr, measured peaks."""
        t = self.trainer
        metrics: dict[str, float] = {}
        if loss is not None:
            metrics["loss"] = t.state.last_loss
        metrics["lr"] = float(t.optimizer.param_groups[0]["lr"])
        (sizes,) = split_per_step(t.balancer, t.sampler, 1)  # the step's, not the next
        if len(sizes) > 1:  # each rank's batch size (speed balance moves the split)
            metrics.update({f"split/rank{r}": float(n) for r, n in enumerate(sizes)})
        for name, peak in zip(t.device_names, self.peaks(), strict=True):
            if peak is not None:
                metrics[f"memory/{name}"] = float(peak)
        return metrics

    # -- the report --------------------------------------------------------------------------

    def report(self, elapsed: float, signum: int | None) -> TrainReport:
        """This fit's figures (every rank calls it: one reduction gathers them): samples per
        device per step, throughput and time count only the steps it ran."""
        t, state = self.trainer, self.trainer.state
        steps_run = state.step - self._start_step
        t._read_pending()
        samples = [a - b for a, b in zip(state.samples, self._before[0], strict=True)]
        # Each rank counted only its own samples and read only its own GPU's peak: one
        # reduction gathers both (a peak travels as bytes + 1, 0 for none).
        n = len(samples)
        mine = [0 if p is None else p + 1 for p in t._device_peaks()]
        gathered = t.strategy.reduce_samples(samples + mine)
        samples, peaks = gathered[:n], [None if v == 0 else v - 1 for v in gathered[n:]]
        # Skipped steps trained no samples.
        done = max(steps_run - (self.skipped_steps() - self._before[1]), 1)
        stats = [
            DeviceStat(name, samples[i] / done, peaks[i], samples=samples[i],
                       peak_kind=None if peaks[i] is None else RESERVED)
            for i, name in enumerate(t.device_names)
        ]  # fmt: skip
        budgets = t.memory_budgets
        if budgets is not None:  # virtual devices: the budget and its enforced forward peak
            stats = [
                replace(s, budget_bytes=b, peak_bytes=p, peak_kind=None if p is None else FORWARD)
                for s, b, p in zip(stats, budgets.budgets, budgets.peaks, strict=True)
            ]
        return TrainReport(
            devices=stats,
            losses=state.losses,
            steps=state.step,
            steps_run=steps_run,
            global_batch=sum(t.sampler.batch_sizes),  # a step's, not a short step's mean
            samples_per_s=sum(samples) / max(elapsed, 1e-9),
            elapsed_s=elapsed,
            resplits=t.guard.resplits,
            skipped_steps=self.skipped_steps(),
            micro_batch_size=t.guard.micro_batch_size,
            interrupted=signum is not None,
            mode=t.strategy.name,
            amp=t.config.amp,
            signal=signum,
            eval=list(t.evals),
            batch_sizes_per_step=list(self.splits),
        )


@dataclass
class TrainState:
    """The position of a run: optimizer steps done, epoch and batch within it, losses, samples.

    ``batch_in_epoch`` counts the batches of ``epoch`` already *trained* (not merely prepared
    by a prefetching loader), so a resume skips exactly those.

    >>> state = TrainState(devices=2)
    >>> state.record(torch.tensor(0.5), [3, 1])
    >>> state.flush(lambda parts: parts)  # one process: its parts are the steps' losses
    >>> state.losses, state.samples
    ([0.5], [3, 1])
    """

    devices: int
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples: list[int] = field(default_factory=list)
    _losses: list[float | torch.Tensor] = field(default_factory=list)
    _parts: list[torch.Tensor] = field(default_factory=list)
    # Per pending part: the samples each device ran and the step's skip flag (device, unread).
    _pending: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    #: What the last resume restored and what it could not (for the user to read).
    notes: list[str] = field(default_factory=list)
    #: What must match on resume: ``{"global_batch": int, "mode": str}`` (set by the Trainer).
    run_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [0] * self.devices

    @property
    def losses(self) -> list[float]:
        """The step losses as floats (reading them waits for the device, once per value)."""
        self._losses = [float(v) for v in self._losses]
        return list(self._losses)  # type: ignore[arg-type]

    def record(
        self, loss: torch.Tensor | None, ran: list[int], skipped: torch.Tensor | bool = False
    ) -> None:
        """One step done: this process's part of its loss (``None``: skipped, not recorded;
        :meth:`flush` sums the parts over ranks) and each device's samples. ``skipped``: the
        non-finite gate's flag, a device tensor read only at :meth:`flush`; a skipped step's
        loss and samples are then dropped.
        """
        if loss is None or (isinstance(skipped, bool) and skipped):
            # Skipped on the host's knowledge: no loss, no samples (ran is zeros then).
            self.samples = [a + b for a, b in zip(self.samples, ran, strict=True)]
            return
        flag = skipped if isinstance(skipped, torch.Tensor) else torch.zeros(())
        self._parts.append(loss.detach().float())
        self._pending.append((ran, flag))

    def flush(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the pending per-rank parts over ranks, all in one ``reduce`` call (collective),
        and read their skip flags (one host read): a skipped step keeps no loss or samples."""
        if not self._parts:
            return
        summed = reduce(torch.stack(self._parts))  # (pending steps,)
        flags = torch.stack([f.to(summed.device).float() for _, f in self._pending]).tolist()
        for loss, (ran, _), skipped in zip(summed.unbind(), self._pending, flags, strict=True):
            if not skipped:
                self._losses.append(loss)
                self.samples = [a + b for a, b in zip(self.samples, ran, strict=True)]
        self._parts, self._pending = [], []

    @property
    def last_loss(self) -> float:
        """The latest recorded (global) loss, read from the device now."""
        return float(self._losses[-1])

    def state_dict(self) -> dict[str, Any]:
        """The run's position: ``step``, ``epoch``, ``batch_in_epoch``, ``losses``, ``samples``.

        Call :meth:`flush` first where losses are pending per rank (a collective).
        """
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "losses": self.losses,
            "samples": list(self.samples),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> str | None:
        """Continue from a saved position; per-device sample counts saved for another number
        of devices start from 0, and the note returned says so.

        >>> state = TrainState(devices=2)
        >>> state.load_state_dict({"step": 4, "epoch": 1, "losses": [2.0], "samples": [9, 7]})
        >>> state.step, state.epoch, state.batch_in_epoch, state.losses, state.samples
        (4, 1, 0, [2.0], [9, 7])
        """
        step = int(state_dict.get("step", 0))
        epoch = int(state_dict.get("epoch", 0))
        batch_in_epoch = int(state_dict.get("batch_in_epoch", 0))
        losses = [float(v) for v in state_dict.get("losses", [])]
        saved = [int(v) for v in state_dict.get("samples", [])]
        self.step, self.epoch, self.batch_in_epoch = step, epoch, batch_in_epoch
        self._losses, self._parts, self._pending = list(losses), [], []
        if len(saved) == len(self.samples):
            self.samples = saved
            return None
        self.samples = [0] * len(self.samples)
        return (
            f"the checkpoint counted samples for {len(saved)} device(s), this run has "
            f"{len(self.samples)}: per-device sample counts start from 0"
        )


HOOKS = ("on_fit_start", "on_step_end", "on_log", "on_eval", "on_save", "on_fit_end")


class Callback:
    """A base class whose hooks do nothing: subclass it and override the ones you need.

    >>> import torch
    >>> from evendp import TrainConfig, Trainer
    >>> class Losses(Callback):
    ...     def __init__(self):
    ...         self.seen = []
    ...     def on_log(self, trainer, step, metrics):
    ...         self.seen.append((step, round(metrics["loss"], 1)))
    >>> data = torch.utils.data.TensorDataset(torch.ones(8, 2), torch.zeros(8))
    >>> net = torch.nn.Linear(2, 1)
    >>> loss = lambda m, b: ((m(b[0]).squeeze(1) - b[1]) ** 2).mean()
    >>> cfg = TrainConfig(steps=3, batch_size=4, lr=0.0, progress=False, log_every=2)
    >>> torch.manual_seed(0) and None
    >>> logged = Losses()
    >>> _ = Trainer(net, data, cfg, loss_fn=loss, callbacks=[logged]).fit()
    >>> [step for step, _ in logged.seen]  # the first step, every 2nd, the last
    [1, 2, 3]
    """

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first step of ``fit``."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """After every optimizer step."""

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """On the steps whose loss is read (``config.log_every``)."""

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """After each evaluation of ``eval_data``."""

    def on_save(self, trainer: Any, step: int, path: Any) -> None:
        """After each checkpoint."""

    def on_fit_end(self, trainer: Any, report: Any) -> None:
        """After the run, with its report."""


class Callbacks:
    """The Trainer's callbacks, called in the order given; a missing method is skipped.

    >>> class Printer:
    ...     def on_step_end(self, trainer, step):
    ...         print("step", step)
    >>> hooks = Callbacks([Printer()])
    >>> hooks.call("on_step_end", None, 3)
    step 3
    >>> hooks.call("on_log", None, 3, {})  # Printer has no on_log: nothing happens
    >>> bool(hooks), bool(Callbacks(None))
    (True, False)
    """

    def __init__(self, callbacks: Sequence[Any] | None) -> None:
        self.items = _validate_callbacks(callbacks)

    def __bool__(self) -> bool:
        return bool(self.items)

    def call(self, hook: str, *args: Any) -> None:
        """``callback.hook(*args)`` for every callback that has ``hook``."""
        for callback in self.items:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)


def _validate_callbacks(callbacks: Sequence[Any] | None) -> list[Any]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise EvendpError(
            f"callbacks must be a list of callback objects, got {type(callbacks).__name__}; "
            "e.g. callbacks=[TensorBoardLogger('runs/tb')]"
        )
    for c in callbacks:
        if not any(callable(getattr(c, h, None)) for h in HOOKS):
            raise EvendpError(
                f"callbacks: {c!r} has none of the hooks {', '.join(HOOKS)}; pass an object "
                "with some of these methods, e.g. a subclass of evendp.Callback or a logger "
                "such as evendp.CSVLogger('metrics.csv')"
            )
    return list(callbacks)


def display_due(step: int, start: int, steps: int, every: int) -> bool:
    """Whether the progress bar reads the loss after ``step`` (1-based steps done).

    The first step of this run, every ``every``-th step and the last one; the same on every
    rank, so the reads' collective (DDP/FSDP2) pairs up.

    >>> [s for s in range(1, 26) if display_due(s, start=0, steps=25, every=10)]
    [1, 10, 20, 25]
    """
    return step == start + 1 or step % every == 0 or step == steps


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
