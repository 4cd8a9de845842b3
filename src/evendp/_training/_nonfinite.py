"""What a step with a non-finite gradient does: it is skipped, and K in a row stop the run.

As ``torch.amp.GradScaler`` does for inf/NaN gradients, the optimizer does not step when the
gradient's norm is not finite (NaN or inf in the loss or in any gradient), so the weights stay
those of the last good step. A run whose gradient stays non-finite for ``limit`` steps in a row
is not going to recover: it stops with :class:`TrainingError` (exit 1) and one line, never
"exit 0 with NaN weights". The norm is the one gradient clipping computes (computed for this
check alone without clipping); reading it costs one host sync per step, which
``TrainConfig(max_nonfinite_steps=0)`` turns off. It is equal on every rank once the
gradients are reduced, so every rank takes the same decision.
"""

from __future__ import annotations

import math

import torch

from .._core._errors import TrainingError

__all__ = ["NonFiniteSteps", "gradient_norm"]


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


class NonFiniteSteps:
    """Counts consecutive steps with a non-finite gradient norm; raises at ``limit``.

    >>> steps = NonFiniteSteps(limit=2)
    >>> steps.ok(torch.tensor(1.0), step=1), steps.ok(torch.tensor(float("nan")), step=2)
    (True, False)
    >>> steps.ok(torch.tensor(float("inf")), step=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.TrainingError: the gradient was NaN or inf in 2 steps in a row (steps 2-3); ...
    """

    def __init__(self, limit: int, where: str = "") -> None:
        self.limit = limit
        self.where = where  # the last good checkpoint, for the message
        self.in_a_row = 0
        self.skipped = 0

    def ok(self, norm: torch.Tensor | float, step: int) -> bool:
        """Whether the step with this gradient ``norm`` may update the weights."""
        if math.isfinite(float(norm)):  # one host sync per step
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise TrainingError(
                f"the gradient was NaN or inf in {self.in_a_row} steps in a row (steps "
                f"{first}-{step}); each was skipped, the weights are those of step "
                f"{first - 1}; nothing was saved from them{self.where}; lower the learning "
                "rate, check the data for NaN, or use amp='bf16'/'none', then resume"
            )
        return False
