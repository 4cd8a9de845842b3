"""One training step of the :class:`~evendp.Trainer`, and the optimizer's part of it.

:func:`train_step` reads top to bottom, as torchtitan's does: this process's rows to its
devices, the step's global count, per micro-step forward and backward with the exactness
weight, the strategy's :meth:`~evendp._training._strategies._base.Strategy.finish_step`
(the reduction and the agreement: step or skip), then the stepper's update (unscale, clip,
the non-finite gate, the optimizer step, the schedule). It returns what the step did; what
the run shows and reports is the recorder's, fed with that value from outside the step.

The stepper is :class:`OptimizerStep` (a :class:`Stepper`; DeepSpeed's engine is the other).
The default optimizer is AdamW, fused where this torch has it for the parameters' device: its
update takes the non-finite gate's ``found_inf`` flag on the device, so a step needs no host
read. What each step reads on the host (outside log steps):

=====================================  ===================================================
no gate (``max_nonfinite_steps=0``)     nothing
gate, optimizer takes ``found_inf``     nothing (the flag stays on the device)
  + an LR scheduler                     the previous step's flag, read a step late (the
                                        device has finished it), so the schedule skips it
gate, other optimizers                  the gradient norm, each step
fp16 (``GradScaler``)                   the scale, each step (its own inf/NaN policy)
=====================================  ===================================================

A step with a non-finite gradient norm is skipped (the weights stay the last good step's, as
``GradScaler`` does); :class:`NonFiniteGate` counts those in a row on the device and stops the
run with :class:`TrainingError` at ``limit`` when read (log steps, checkpoints, the end).

The step's global count (the number the whole batch's mean is over) is known to every process
when it is the samples or ``Trainer(counts=)``'s (:func:`sample_counts`); a ``count_fn`` count
under DDP/FSDP2 is summed by :class:`StepWeight`, an all-reduce started before the first
forward and waited for after it, so the collective overlaps the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._core._calls import as_args, as_batch
from .._core._errors import EvendpError, InputError, TrainingError
from .._core._exact import mean_scale, share_loss, step_count
from .._core._validate import shown, validate_count
from .._distributed._step_layout import StepLayout, micro_plan
from .._parallel._scatter import map_tensors, row_count_and_devices
from ._oom import free_memory

__all__ = [
    "NonFiniteGate",
    "OptimizerStep",
    "StepResult",
    "StepWeight",
    "Stepper",
    "count_weight",
    "default_optimizer",
    "gradient_norm",
    "no_batch_dimension",
    "run_schedule",
    "sample_counts",
    "takes_found_inf",
    "train_step",
]


@dataclass(frozen=True)
class StepResult:
    """What :func:`train_step` did, for the recorder.

    ``loss``: this process's part of the step's mean loss, on the device (``None``: an OOM
    skipped the step everywhere); ``skipped``: the non-finite gate's 0/1 flag (a device
    tensor, read with the losses at log steps); ``votes``: the ranks' summed ``(SIGINT,
    SIGTERM)`` stop votes that rode with the step (``None``: none did); ``micro_rows``: per
    micro-step, the rows each of this process's devices ran.
    """

    loss: torch.Tensor | None
    skipped: torch.Tensor | bool
    votes: tuple[float, float] | None
    micro_rows: list[list[int]]


def train_step(t: Any, batch: Any, layout: StepLayout, counted: float | None) -> StepResult:
    """One optimizer step of the :class:`~evendp.Trainer` ``t`` (typed ``Any``: the Trainer's
    module imports this one) on this process's ``batch``, its rows as ``layout`` places them
    (``counted``: the step's global count from ``Trainer(counts=)``, else ``None``)."""
    strategy, stepper, guard = t.strategy, t.stepper, t.guard
    if not t._count_checked:  # the first step only, without count_fn
        t.warn_uncounted(batch)
    n, devices = row_count_and_devices(batch)
    if n is None:
        raise no_batch_dimension(batch)
    if devices != {t.device}:  # this process's rows to its devices, where they are not
        batch = strategy.place(batch)
    shares = list(layout.rows[t.rank])  # this process's rows on each of its devices
    if sum(shares) != n:  # a batch function that makes rows of its own (packing)
        shares = strategy.shares(n)
    if counted is None and t.count_fn is None:
        counted = layout.samples  # known to every process: no collective
    weight = count_weight(t, batch) if counted is None else StepWeight.known(t.world, counted)
    stepper.zero_grad()
    total: torch.Tensor | None = None
    while True:  # the micro-steps; after an OOM, again with the failing device's halved
        # Each device's rows in pieces: the accumulation's, capped where an OOM halved them.
        plan = micro_plan(shares, t.config.accum, guard.micro_batch_sizes, guard.min_micro_steps)
        try:
            total, ran = torch.zeros((), device=t.device), []
            for k, spans in enumerate(plan):
                rows = [b - a for a, b in spans]
                ran.append(rows)
                with strategy.micro_step(last=k == len(plan) - 1):  # sync on the last only
                    with t.autocast(), t.timers["forward"](sum(rows)):
                        if not sum(rows):  # nothing left here: a stand-in sample, weight 0
                            one = strategy.forward(t.stand_in(), strategy.shares(1))
                            summed = share_loss(one, 0, stand_in=True)
                        elif rows == shares:  # every device its whole share at once
                            summed = strategy.forward(batch, rows).float()
                        else:  # accumulation or an OOM re-split: the micro-step's rows only
                            part = _rows(batch, shares, spans)
                            summed = strategy.forward(part, rows).float()
                    loss = summed * weight.wait()  # the count's all-reduce ran beside it
                    with t.timers["backward"](0):
                        stepper.backward(loss)
                total = total + loss.detach()
            break
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            retry = guard.after_oom(error, shares, plan)  # re-raises anything else
        # Outside the except block, so the failed graph's frames can be freed.
        stepper.zero_grad()
        free_memory()
        if not retry:
            total = None
            break
    end = strategy.finish_step(total is None, total)  # every process, whatever happened
    if end.total is None:  # an OOM on some process: every process skips the step
        stepper.zero_grad()
        guard.skipped += 1
        return StepResult(None, True, end.votes, [])
    with t.timers["optimizer"](0):
        skipped = stepper.step(t.state.step + 1)  # unscale, clip, gate, update
    # The step's mean, or this rank's part of it (the strategy sums the parts when read).
    return StepResult(end.total / t.world, skipped, end.votes, ran)


def _rows(batch: Any, shares: list[int], spans: list[tuple[int, int]]) -> Any:
    """The rows of every device's span ``[start, stop)`` of its own share, in order: a view
    when they are adjacent. Per-row lists (strings, ids) are cut with their rows.

    >>> x = torch.arange(6)
    >>> _rows(x, [3, 3], [(0, 2), (0, 2)]), _rows(x, [2, 4], [(0, 2), (0, 2)])
    (tensor([0, 1, 3, 4]), tensor([0, 1, 2, 3]))
    >>> _rows({"x": torch.arange(3), "text": ["a", "b", "c"]}, [3], [(1, 3)])["text"]
    ['b', 'c']
    """
    total, offset, ranges = sum(shares), 0, []
    for share, (a, b) in zip(shares, spans, strict=True):
        if b > a:
            ranges.append((offset + a, offset + b))
        offset += share

    def rows_of(values: list[Any]) -> list[Any]:
        return [value for a, b in ranges for value in values[a:b]]

    if not ranges:  # an empty micro-step: zero rows, same layout
        return map_tensors(batch, lambda x: x[:0] if x.dim() else x, rows=total, row_fn=rows_of)
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
        start, stop = ranges[0][0], ranges[-1][1]
        return map_tensors(batch, lambda x: x[start:stop], rows=total, row_fn=rows_of)
    index = torch.cat([torch.arange(a, b) for a, b in ranges])  # (samples,)
    return map_tensors(batch, lambda x: x[index.to(x.device)], rows=total, row_fn=rows_of)


def no_batch_dimension(batch: Any) -> EvendpError:
    """The error of a batch with no tensor to count its rows by."""
    return EvendpError(
        f"cannot find the batch dimension of {type(batch).__name__}; return tensors with "
        "the samples along dim 0 from the dataset (or its batch(indices) method)"
    )


def count_weight(t: Any, batch: Any) -> StepWeight:
    """``world / the step's count_fn count over all processes``, before the first backward:
    summed by the strategy (:meth:`Strategy.count_weight`). A tensor count's value is checked
    at the first step only (each read waits for the device)."""
    assert t.count_fn is not None  # for mypy: the caller's condition
    count = t.count_fn(as_batch(as_args(batch), {}))  # the batch as loss_fn sees it
    validate_count(
        "count_fn(batch)", count, check_values=t.state.step == 0 or not torch.is_tensor(count)
    )
    local = torch.as_tensor(count, dtype=torch.float64)
    return t.strategy.count_weight(local.reshape(()))


class StepWeight:
    """``world / (the step's global count)``, all-reduced while the first forward runs.

    ``value`` is a 0-dim tensor on ``device`` that holds the weight once :meth:`wait` has
    returned (call it after the forward, before the first ``backward``; later calls are free).
    The arithmetic is :mod:`evendp._core._exact`'s: the count summed in float64
    (:func:`~evendp._core._exact.step_count`), the weight :func:`~evendp._core._exact.mean_scale`
    (0 when nothing is counted anywhere).

    >>> weight = StepWeight.ready(2, torch.tensor(8.0))  # no process group: nothing to wait for
    >>> weight.wait()
    tensor(0.2500)
    """

    def __init__(
        self, world: int, local: torch.Tensor, device: torch.device, comm: torch.device
    ) -> None:
        self._world = world
        self._work: dist.Work | None = None
        # Started now, waited for after the forward: the collective overlaps it.
        total = step_count(local, device=comm, all_reduce=self._start)
        self._total = torch.as_tensor(total)
        self.value: torch.Tensor | float = torch.empty((), device=device)

    def _start(self, total: torch.Tensor) -> torch.Tensor:
        self._work = dist.all_reduce(total, async_op=True)
        return total

    @classmethod
    def known(cls, world: int, count: float) -> StepWeight:
        """A weight whose global count every process knows already (the samples, or
        ``Trainer(counts=)``): no collective, and its value a Python number.

        >>> StepWeight.known(2, 8).wait()
        0.25
        """
        weight = cls.__new__(cls)
        weight._world, weight._total, weight._work = world, torch.zeros(()), None
        weight.value = mean_scale(count, numerator=world)  # a number: no tensor, no read
        return weight

    @classmethod
    def ready(cls, world: int, total: torch.Tensor) -> StepWeight:
        """A weight whose global count is already known (one process)."""
        weight = cls.__new__(cls)
        weight._world, weight._total, weight._work = world, total, None
        weight.value = torch.as_tensor(mean_scale(total, numerator=world))
        return weight

    def wait(self) -> torch.Tensor | float:
        """The weight, once the all-reduce is done (NCCL: the stream waits, not the host)."""
        if self._work is not None and isinstance(self.value, torch.Tensor):
            self._work.wait()
            self._work = None
            total = self._total.to(self.value.device)
            self.value.copy_(torch.as_tensor(mean_scale(total, numerator=self._world)))
        return self.value


def sample_counts(data: Any, length: int, counts: Any) -> list[float] | None:
    """``Trainer(counts=)`` as one number per sample: a sequence, or a function of ``data[i]``.

    Each sample's counted items (what ``count_fn`` counts on it alone): every rank then knows
    the step's global count from the step's layout, with no collective.

    >>> sample_counts(["ab", "c"], 2, len)
    [2.0, 1.0]
    """
    if counts is None:
        return None
    if callable(counts):
        counts = [counts(data[i]) for i in range(length)]
    values = [float(c) for c in counts]
    if len(values) != length or any(not v >= 0 for v in values):
        raise EvendpError(
            f"counts must give one count >= 0 per sample ({length} samples), got {len(values)} "
            "values; pass e.g. counts=[len(x) - 1 for x in texts] or a function of data[i]"
        )
    return values


# -- the optimizer's part --------------------------------------------------------------------


class Stepper(Protocol):
    """Backward and the update of one run, in the order ``train_step`` calls them:
    ``zero_grad``, ``backward`` per micro-step, ``step`` (the 0/1 flag of a step the gate
    skipped, unread); ``settle`` where the host reads (a schedule step, the gate's verdict).
    :class:`OptimizerStep`, or DeepSpeed's engine (``EngineStep``); ``optimizer``,
    ``scheduler``, ``scaler``, ``gate`` (a checkpoint part) are ``None`` where a run has none."""

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Any | None: ...

    @property
    def scaler(self) -> torch.amp.GradScaler | None: ...

    @property
    def gate(self) -> NonFiniteGate | None: ...

    @property
    def skipped(self) -> int: ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, step: int) -> torch.Tensor | bool: ...

    def settle(self) -> None: ...


def default_optimizer(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, fused where this torch supports the parameters' device (else the default).

    >>> opt = default_optimizer(nn.Linear(2, 2).parameters(), lr=1e-3, weight_decay=0.0)
    >>> type(opt).__name__, takes_found_inf(opt)
    ('AdamW', True)
    """
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def run_schedule(optimizer: torch.optim.Optimizer, scheduler: Any | None, warmup_steps: int) -> Any:
    """The run's learning-rate schedule: ``scheduler``, else a linear warmup over
    ``warmup_steps`` optimizer steps (``lr * k / warmup_steps`` for step ``k``, then ``lr``),
    else none. DeepSpeed's engine builds it on its own optimizer through the same function.

    >>> opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    >>> warmup = run_schedule(opt, None, 4)
    >>> rates = []
    >>> for _ in range(5):
    ...     rates.append(opt.param_groups[0]["lr"]); opt.step(); warmup.step()
    >>> rates, run_schedule(opt, None, 0)
    ([0.25, 0.5, 0.75, 1.0, 1.0], None)
    """
    if scheduler is not None or not warmup_steps:
        return scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: min(1.0, (done + 1) / warmup_steps)
    )


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` skips itself on a device-side ``found_inf`` flag (the fused
    Adam, AdamW and SGD, as ``GradScaler`` uses them)."""
    return bool(optimizer.defaults.get("fused")) and hasattr(
        optimizer, "_step_supports_amp_scaling"
    )


class OptimizerStep:
    """Backward and the optimizer step of a run: loss scaling (fp16), clipping of the true
    gradient, the non-finite gate, the update, the LR schedule.

    >>> net = nn.Linear(2, 1)
    >>> step = OptimizerStep(net, default_optimizer(net.parameters(), 0.1, 0.0), None,
    ...                      amp="none", grad_clip=1.0, max_nonfinite_steps=3)
    >>> step.backward(net(torch.ones(4, 2)).sum())
    >>> skipped = step.step(step=1)  # a 0/1 flag on the device, not read
    >>> float(skipped), step.gate.skipped
    (0.0, 0)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        *,
        amp: str,
        grad_clip: float | None,
        max_nonfinite_steps: int,
        where: str = "",
        device_type: str = "cpu",
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # fp16 needs loss scaling so small gradients do not flush to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(device_type) if amp == "fp16" else None
        self.grad_clip = grad_clip
        # GradScaler has its own policy for inf gradients (it lowers the scale and skips).
        self.gate = NonFiniteGate(max_nonfinite_steps, where)
        self._gated = self.scaler is None and max_nonfinite_steps > 0
        self._on_device = self._gated and takes_found_inf(optimizer)
        #: The last step's skip flag while its scheduler step waits to be read (a step late).
        self._unscheduled: torch.Tensor | None = None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-step's weighted loss (scaled first under fp16)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, step: int) -> torch.Tensor | bool:
        """Update the weights for optimizer step ``step`` (1-based); the 0/1 flag of a skipped
        step (a device tensor under the device-side gate, else a bool)."""
        if self.scaler is not None:
            return self._scaled_step()
        if not self._gated:
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self._schedule()
            return False
        norm = gradient_norm(self.model, self.grad_clip)
        if not self._on_device:
            if not self.gate.ok(norm, step):  # one host read: this optimizer has no found_inf
                return True
            self.optimizer.step()
            self._schedule()
            return False
        skipped = self.gate.found(norm, step)
        if self._unscheduled is not None:  # the previous step's schedule, its flag computed
            self._schedule_late()
        # The fused kernels skip the whole update (moments, step count, decay) on found_inf.
        opt: Any = self.optimizer
        opt.grad_scale, opt.found_inf = None, skipped.to(torch.float32)
        try:
            self.optimizer.step()
        finally:
            del opt.grad_scale, opt.found_inf
        if self.scheduler is not None:
            self._unscheduled = skipped
        return skipped

    @property
    def skipped(self) -> int:
        """Steps the non-finite gate skipped so far (a host read)."""
        return self.gate.skipped

    def settle(self) -> None:
        """Where the Trainer reads anyway (log steps, checkpoints, the end): the pending
        schedule step, then the gate's verdict (:class:`TrainingError` past its limit)."""
        self._schedule_late()
        self.gate.check()

    def _schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def _schedule_late(self) -> None:
        flag, self._unscheduled = self._unscheduled, None
        if flag is not None and not bool(flag):  # the read of a step the device has finished
            self._schedule()

    def _scaled_step(self) -> bool:
        scaler = self.scaler
        assert scaler is not None
        scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        scale = scaler.get_scale()
        scaler.step(self.optimizer)
        scaler.update()
        # GradScaler skips the optimizer step on inf/NaN gradients and lowers its scale:
        # then the learning-rate schedule must not advance either.
        if scaler.get_scale() >= scale:
            self._schedule()
        return False


# -- the non-finite gate ---------------------------------------------------------------------

_COUNTERS = ("in_a_row", "skipped")


def gradient_norm(model: torch.nn.Module, clip: float | None) -> torch.Tensor:
    """The total gradient norm over ranks, clipping to ``clip`` (``None``: no clipping).

    >>> net = torch.nn.Linear(1, 1, bias=False)
    >>> net(torch.ones(1, 1)).sum().backward()
    >>> float(gradient_norm(net, None))
    1.0
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    full = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor, reduced over the shards
    return full() if callable(full) else norm


class NonFiniteGate:
    """Skips steps whose gradient norm is not finite; ``limit`` in a row stop the run.

    The norm is the one clipping computes, equal on every rank once the gradients are
    reduced, so every rank takes the same decision. :meth:`found` decides on the device (the
    flag an optimizer's ``found_inf`` takes); :meth:`check` reads it where the Trainer reads
    anyway; :meth:`ok` is both at once, for an optimizer without ``found_inf``.

    >>> gate = NonFiniteGate(limit=2)
    >>> gate.ok(torch.tensor(1.0), step=1), gate.ok(torch.tensor(float("nan")), step=2)
    (True, False)
    >>> gate.ok(torch.tensor(float("inf")), step=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.TrainingError: the gradient was NaN or inf in 2 steps in a row (steps 2-3); ...

    On the device, read later: the flags of steps 1 and 2, then one host read.

    >>> gate = NonFiniteGate(limit=3)
    >>> [float(gate.found(torch.tensor(v), step=s)) for s, v in [(1, 1.0), (2, float("nan"))]]
    [0.0, 1.0]
    >>> gate.check(), gate.skipped
    (None, 1)
    """

    def __init__(self, limit: int, where: str = "") -> None:
        self.limit = limit
        self.where = where  # the last good checkpoint, for the message
        # On the norm's device, created at the first step: never read but by check().
        self._in_a_row: torch.Tensor | None = None
        self._tripped_at: torch.Tensor | None = None  # the step the limit was reached; 0: not
        self._skipped: torch.Tensor | None = None
        self._carried = (0, 0)  # (in a row, skipped) restored from a checkpoint

    def found(self, norm: torch.Tensor, step: int) -> torch.Tensor:
        """The 0/1 ``found_inf`` flag of ``step`` (1: skip it), decided on ``norm``'s device.

        Once the limit was reached every later step is skipped too, so the weights stay those
        of the last good step until :meth:`check` stops the run."""
        if self._in_a_row is None:
            in_a_row, skipped = self._carried
            self._in_a_row = torch.full((), float(in_a_row), device=norm.device)
            self._tripped_at = torch.zeros((), device=norm.device)
            self._skipped = torch.full((), float(skipped), device=norm.device)
        assert self._tripped_at is not None and self._skipped is not None
        bad = torch.maximum((~torch.isfinite(norm)).float(), (self._tripped_at > 0).float())
        self._in_a_row = (self._in_a_row + 1) * bad  # back to 0 on a good step
        reached = (self._tripped_at == 0) & (self._in_a_row >= self.limit)
        self._tripped_at = torch.where(reached, torch.full_like(bad, step), self._tripped_at)
        self._skipped = self._skipped + bad
        return bad

    def ok(self, norm: torch.Tensor | float, step: int) -> bool:
        """:meth:`found` read now (one host read): whether ``step`` may update the weights."""
        bad = self.found(torch.as_tensor(norm, dtype=torch.float32), step)
        self.check()
        return not bool(bad)

    def check(self) -> None:
        """Raise :class:`TrainingError` when ``limit`` steps in a row were non-finite (a host
        read: the Trainer calls it where it reads anyway)."""
        if self._tripped_at is None:
            return
        last = int(self._tripped_at)
        if last:
            first = last - self.limit + 1
            raise TrainingError(
                f"the gradient was NaN or inf in {self.limit} steps in a row (steps "
                f"{first}-{last}); each was skipped, the weights are those of step "
                f"{first - 1}; nothing was saved from them{self.where}; lower the learning "
                "rate, check the data for NaN, or use amp='bf16'/'none', then resume"
            )

    @property
    def skipped(self) -> int:
        """Steps skipped so far (a host read)."""
        return self._carried[1] if self._skipped is None else int(self._skipped)

    def state_dict(self) -> dict[str, int]:
        """The counters a resumed run continues from (a host read)."""
        in_a_row = self._carried[0] if self._in_a_row is None else int(self._in_a_row)
        return {"in_a_row": in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved :meth:`state_dict` (read back from a file: checked as data)."""
        values = [state.get(k, 0) if isinstance(state, dict) else None for k in _COUNTERS]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise InputError(
                f"the non-finite counters must be ints >= 0 ({', '.join(_COUNTERS)}), got "
                f"{shown(state)}"
            )
        self._carried = (values[0], values[1])
        self._in_a_row = self._tripped_at = self._skipped = None
