"""What a :class:`~evendp._training._trainer.Trainer` run shows and reports, read from outside
its step: the progress bar and its text, the notes of re-splits, the figures ``on_log`` gets,
and the :class:`~evendp._training._report.TrainReport` at the end.

The Trainer formats nothing: it hands its position (the step, each step's layout, the time
run) to one :class:`Recorder`, which reads the rest from the trainer it observes (its state,
strategy, OOM guard, speed balancer and evaluations) at the points a fit calls it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

import torch

from .._distributed._step_layout import StepLayout
from .._planning._balance import split_per_step
from ._report import FORWARD, RESERVED, DeviceStat, TrainProgress, TrainReport, format_bytes

__all__ = ["Recorder"]


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

    def start(self) -> TrainProgress:
        """At the start of a fit (after a resume): what ran before stays out of its report.
        Returns the progress bar (a context manager; drawn on rank 0 with ``progress``)."""
        t = self.trainer
        state = t.state
        self.splits = []
        self._start_step = state.step
        self._before = (list(state.samples), self.skipped_steps())
        self._started = time.perf_counter()
        show = t.config.progress and t.rank == 0
        return TrainProgress(t.config.steps, enabled=show, start=state.step)

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.perf_counter() - self._started

    def step_done(self, layout: StepLayout) -> list[str]:
        """Record the step just done (each replica's rows, as every rank laid them out);
        return this rank's notes of it to say (the OOM guard's re-splits, skips)."""
        self.splits.append([n for rows in layout.rows for n in rows])
        return self._oom_lines()

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

    def resplit_line(self) -> str:
        """What the speed balancer just decided: the step, the split before and after (its
        history), and the per-sample times it went by."""
        balancer = self.trainer.balancer
        (_, before), (step, after) = balancer.history[-2:]
        times = balancer.seconds_per_sample
        said = ", ".join("-" if t is None else f"{t * 1e3:.3g}" for t in times)
        return (
            f"evendp: step {step}: speed re-split {list(before)} -> {list(after)} (ms per "
            f"sample by rank: {said})"
        )

    def _oom_lines(self) -> list[str]:
        """The OOM guard's notes of the step just done (a re-split, a skip), each naming the
        step and, on several ranks, this rank; emptied once said."""
        t = self.trainer
        if not t.guard.notes:  # nearly every step: nothing to say
            return []
        where = f"step {t.state.step}" + (f", rank {t.rank}" if t.world > 1 else "")
        lines = [f"evendp: {where}: {note}" for note in t.guard.notes]
        t.guard.notes.clear()
        return lines

    def bar_text(self) -> str:
        """The bar's memory column: measured peaks, OOM caps, the last evaluation."""
        return self.memory_text() + self._micro_text() + self._eval_text()

    def peaks(self) -> list[int | None]:
        """Per device, the measured peak: the CUDA allocator's, else a budget's forward peak."""
        t = self.trainer
        peaks = t._device_peaks()
        budgets = t.memory_budgets
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

    def _micro_text(self) -> str:
        # Shown only once an OOM (or a resumed run) capped some device's micro-batches.
        caps = self.trainer.guard.micro_batch_sizes
        if all(c is None for c in caps):
            return ""
        return " micro-batch " + "/".join("all" if c is None else str(c) for c in caps)

    def _eval_text(self) -> str:
        evals = self.trainer.evals
        if not evals:
            return ""
        return "".join(f" val {k} {v:.4f}" for k, v in evals[-1]["metrics"].items())

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
        t = self.trainer
        state = t.state
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
