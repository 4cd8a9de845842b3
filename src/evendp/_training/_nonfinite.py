"""What a step with a non-finite gradient does: it is skipped, and K in a row stop the run.

As ``torch.amp.GradScaler`` does for inf/NaN gradients, the optimizer does not step when the
gradient's norm is not finite (NaN or inf in the loss or in any gradient), so the weights stay
those of the last good step. A run whose gradient stays non-finite for ``limit`` steps in a row
is not going to recover: it stops with :class:`TrainingError` (exit 1) and one line, never
"exit 0 with NaN weights". The norm is the one gradient clipping computes (computed for this
check alone without clipping); it is equal on every rank once the gradients are reduced, so
every rank takes the same decision.

The decision is made **on the device**, as ``GradScaler``'s ``found_inf`` is:
:meth:`NonFiniteGate.found` turns the norm into a 0/1 flag and counts the steps in a row in
device tensors, and an optimizer that takes ``found_inf`` (the fused Adam, AdamW and SGD; the
Trainer's default AdamW is fused) skips its update on the device. The host reads nothing until
:meth:`NonFiniteGate.check`, which the Trainer calls where it reads anyway (log steps,
checkpoints, the end): a run that reached ``limit`` skips every later step until then, so its
weights are still those of the last good step when it stops. With an optimizer that has no
``found_inf`` the flag is read on the host each step (:meth:`NonFiniteGate.ok`), as before.
"""

from __future__ import annotations

import torch

from .._core._errors import InputError, TrainingError
from .._core._validate import shown

__all__ = ["NonFiniteGate", "gradient_norm"]

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
