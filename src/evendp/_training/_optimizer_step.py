"""The optimizer's part of a step: backward, unscale, clip, the non-finite gate, step, schedule.

evendp's :class:`~evendp._training._stepper.Stepper`: one object per run, built by the strategy
(:meth:`Strategy.build_stepper`) after it wrapped the model, so FSDP2's sharded parameters are
the ones optimized; the Trainer calls it. The default optimizer is
AdamW, fused where this torch has it for the parameters' device: its update takes the
non-finite gate's ``found_inf`` flag on the device, so a step needs no host read.

What each step reads on the host (the Trainer's steady state, outside log steps):

=====================================  ===================================================
no gate (``max_nonfinite_steps=0``)     nothing
gate, optimizer takes ``found_inf``     nothing (the flag stays on the device)
  + an LR scheduler                     the previous step's flag, read a step late (the
                                        device has finished it), so the schedule skips it
gate, other optimizers                  the gradient norm, each step
fp16 (``GradScaler``)                   the scale, each step (its own inf/NaN policy)
=====================================  ===================================================
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._nonfinite import NonFiniteGate, gradient_norm

__all__ = ["OptimizerStep", "default_optimizer", "run_schedule", "takes_found_inf"]


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
        self._schedule_late()  # the previous step's schedule, its flag long computed
        self._update_unless(skipped)
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

    def _update_unless(self, skipped: torch.Tensor) -> None:
        # The fused kernels skip the whole update (moments, step count, decay) on found_inf.
        opt: Any = self.optimizer
        opt.grad_scale, opt.found_inf = None, skipped.to(torch.float32)
        try:
            self.optimizer.step()
        finally:
            del opt.grad_scale, opt.found_inf

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
