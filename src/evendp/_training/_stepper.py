"""The contract of a run's optimizer step, which the Trainer calls itself: a stepper.

A strategy builds it (:meth:`Strategy.build_stepper`, after wrapping, so FSDP2's sharded
parameters are the ones optimized): evendp's
:class:`~evendp._training._optimizer_step.OptimizerStep` (fp16 loss scaling, clipping, the
non-finite gate, the schedule), or an engine that owns its optimizer (DeepSpeed's
``EngineStep``). The Trainer alone calls it; what differs between strategies around its
backward (gradient buckets launched during it, gradient sync) is the context the strategy's
``micro_step`` gives.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ._nonfinite import NonFiniteGate

__all__ = ["Stepper"]


class Stepper(Protocol):
    """Backward and the update of one run, in the order the Trainer calls them each step:
    ``zero_grad``, ``backward`` per micro-step, ``step``; ``settle`` where the host reads."""

    def zero_grad(self) -> None:
        """Drop the gradients (before a step, and after an attempt an OOM ended)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step's loss, already weighted by the step's weight."""

    def step(self, step: int) -> torch.Tensor | bool:
        """Update the weights for step ``step`` (1-based): the 0/1 flag of a step the
        non-finite gate skipped (a device tensor, not read)."""

    def settle(self) -> None:
        """Where the Trainer reads the host anyway (log steps, checkpoints, the end): what
        the update left pending (a schedule step, the gate's verdict, which may stop the run)."""

    @property
    def optimizer(self) -> Any:
        """The optimizer stepped (``param_groups`` hold the learning rate)."""

    @property
    def scheduler(self) -> Any | None:
        """The learning-rate schedule (``None``: none)."""

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler (``None``: none, or the engine's own)."""

    @property
    def gate(self) -> NonFiniteGate | None:
        """The non-finite gate's counters, a checkpoint part (``None``: not in this run)."""

    @property
    def skipped(self) -> int:
        """Steps the non-finite gate skipped so far (a host read)."""
