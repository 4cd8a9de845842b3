"""Surviving ``torch.OutOfMemoryError`` without changing the math: exact micro-batch re-splits.

A step's share runs as micro-batches, each weighted by its counted items over the step's
global count (:func:`evendp.share_loss`), so the gradient is the global mean's however the
share is cut. When one runs out of memory the step's gradients are dropped, the failed graph
freed, the CUDA cache emptied, and the share runs again with that device's micro-batches half
as large (an OOM that names its device, tagged by ``BalancedDataParallel``, halves that
device's only; :func:`evendp._core._oom_errors.device_index_of`); the size is kept for later
steps. Only when one sample still does not fit is the step skipped (:attr:`OomResplit.skipped`).

How micro-steps are cut is the layout's (:func:`~evendp._distributed._step_layout.micro_plan`):
the Trainer's step reads the guard's caps and consults it only after an OOM; across ranks its
strategy agrees on step or skip. :meth:`OomResplit.run_shares`, for hand-written loops,
agrees under a process group with one all-reduced flag.
"""

from __future__ import annotations

import collections
import gc
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._core._errors import EvendpError
from .._core._exact import share_loss
from .._core._oom_errors import device_index_of, is_oom_error
from .._core._validate import is_int, validate_int
from .._distributed._group import comm_device, world_size
from .._distributed._step_layout import MicroPlan, micro_plan

__all__ = ["OomResplit", "free_memory"]


def _validate_micro(name: str, value: int | None) -> int | None:
    return validate_int(name, value, minimum=1, allow_none=True, example="8")


class OomResplit:
    """Run shares of samples as micro-batches, re-splitting them smaller on out-of-memory.

    Args:
        micro_batch_size: the largest micro-batch to try first (``None``: the whole share).
        min_micro_batch_size: below this the step is skipped instead of re-split.
        group: the process group whose ranks must agree on skipping (``None``: the default
            group when one is initialized and has more than one rank, else no agreement).
        catch: ``False`` lets ``torch.OutOfMemoryError`` propagate (micro-batching only):
            for strategies with collectives inside forward and backward (FSDP2), where a
            retry on one rank would pair its collectives with the wrong ones on the others.
        devices: how many devices share each step (:meth:`run_shares`); each keeps its own
            micro-batch cap in :attr:`micro_batch_sizes`. :meth:`run` is the one-device case.

    >>> torch.manual_seed(0) and None
    >>> net = torch.nn.Linear(3, 1)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> def chunk_loss(start, stop):  # the mean loss of samples [start, stop)
    ...     if stop - start > 3:  # pretend more than 3 samples do not fit
    ...         raise torch.OutOfMemoryError("injected")
    ...     return torch.nn.functional.mse_loss(net(x[start:stop]), y[start:stop])
    >>> guard = OomResplit()
    >>> loss = guard.run(8, chunk_loss, weight=1 / 8, zero_grad=net.zero_grad)
    >>> guard.micro_batch_size, guard.resplits, guard.skipped
    (2, 2, 0)
    >>> exact = torch.nn.functional.mse_loss(net(x), y)
    >>> torch.allclose(loss, exact.detach())
    True
    """

    def __init__(
        self,
        micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
        group: dist.ProcessGroup | None = None,
        catch: bool = True,
        *,
        devices: int = 1,
        min_micro_steps: int = 0,
    ) -> None:
        validate_int("devices", devices, minimum=1, example="3")
        self.catch = catch
        #: The fewest micro-steps :meth:`plan` gives (its strategy's: collectives inside
        #: forward or backward make every rank run as many as the most any rank runs).
        self.min_micro_steps = min_micro_steps
        #: Per device, the micro-batch that fits (``None``: its whole share); kept across steps.
        self.micro_batch_sizes = [_validate_micro("micro_batch_size", micro_batch_size)] * devices
        self.min_micro_batch_size = _validate_micro("min_micro_batch_size", min_micro_batch_size)
        self.group = group
        #: How many times a step was re-run with smaller micro-batches.
        self.resplits = 0
        #: How many steps were skipped because even the smallest micro-batch did not fit.
        self.skipped = 0
        #: One line per re-split or skip since the caller last emptied it (what was decided
        #: and why); the Trainer prints them after the step. The last 16: a hand-written loop
        #: that never reads them keeps no more.
        self.notes: collections.deque[str] = collections.deque(maxlen=16)
        #: While ``chunk_loss`` runs: the index of this micro-step and how many the attempt
        #: runs, so a caller can sync gradients on the last one only.
        self.micro_step = 0
        self.micro_steps = 0
        self._plan: MicroPlan = []  # the last plan()'s

    @property
    def micro_batch_size(self) -> int | None:
        """The smallest per-device cap (``None``: every device runs its whole share).

        Assigning sets every device's cap."""
        caps = [m for m in self.micro_batch_sizes if m is not None]
        return min(caps) if caps else None

    @micro_batch_size.setter
    def micro_batch_size(self, value: int | None) -> None:
        value = _validate_micro("micro_batch_size", value)
        self.micro_batch_sizes = [value] * len(self.micro_batch_sizes)

    def run(
        self,
        n: int,
        chunk_loss: Callable[[int, int], torch.Tensor],
        *,
        weight: float,
        zero_grad: Callable[[], None],
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
        micro_batch_size: int | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward ``n`` samples; return their detached weighted loss, or None.

        ``chunk_loss(start, stop)`` computes the mean loss of samples ``[start, stop)`` of
        this share. ``backward`` (default ``loss.backward()``; pass e.g.
        ``lambda l: scaler.scale(l).backward()``) is called on ``loss * (stop-start) *
        weight``. Gradients must be zero or ``None`` on entry: the guard owns the whole step
        so it can drop them on an OOM. ``micro_batch_size`` caps this call's micro-batches
        (gradient accumulation). Returns ``None`` when the step was skipped (every rank then
        returns ``None`` and gradients are zeroed).
        """
        if len(self.micro_batch_sizes) != 1:
            raise EvendpError(
                f"run() cuts one share, but this guard has devices={len(self.micro_batch_sizes)}"
                "; call run_shares() with one share per device"
            )
        return self.run_shares(
            [n],
            lambda spans: chunk_loss(*spans[0]),
            weight=weight,
            zero_grad=zero_grad,
            backward=backward,
            micro_batch_sizes=[micro_batch_size],
        )

    def run_shares(
        self,
        shares: Sequence[int],
        chunk_loss: Callable[[list[tuple[int, int]]], torch.Tensor],
        *,
        weight: float | torch.Tensor,
        zero_grad: Callable[[], None],
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
        micro_batch_sizes: Sequence[int | None] | None = None,
        min_micro_steps: int = 0,
        summed: bool = False,
    ) -> torch.Tensor | None:
        """Like :meth:`run`, with one share per device, each cut by its own cap.

        Micro-step k gives device i the span ``[start_i, stop_i)`` of *its own* share: the
        k-th piece of at most ``micro_batch_sizes[i]`` samples, empty once the share is done.
        ``chunk_loss(spans)`` returns the mean loss over all the spans' samples, and is
        weighted by their count times ``weight``. An OOM tagged with its device (by
        :class:`~evendp.BalancedDataParallel` for a replica's forward) halves that device's
        cap only; any other OOM (e.g. in backward) halves every device's.

        ``min_micro_steps`` pads the step with empty micro-steps (every span empty) up to that
        many: under DDP or FSDP2 every rank must run forward and backward as often as the
        others, even with no samples. An empty micro-step backpropagates an exact zero
        connected to the loss (:func:`evendp.share_loss`: never the NaN of a mean
        over no samples), so DDP's and FSDP2's collectives pair up.

        ``summed=True``: ``chunk_loss`` returns the loss already *summed* over its counted
        items (and zero, never NaN, for none); it is weighted by ``weight`` alone. This is how
        the Trainer weights by counted items (tokens) instead of samples. ``weight`` may be a
        0-dim tensor (a global count all-reduced on the device, never read on the host).

        Under a process group of more than one rank (``group``) every rank agrees on step or
        skip with one all-reduced flag: when any rank failed every rank zeroes the gradients
        and skips.

        >>> guard = OomResplit(devices=2)
        >>> seen = []
        >>> def chunk_loss(spans):
        ...     if spans[0][1] - spans[0][0] > 2:  # device 0 fits 2 samples
        ...         error = torch.OutOfMemoryError("injected")
        ...         error.evendp_device_index = 0
        ...         raise error
        ...     seen.append(spans)
        ...     return torch.ones((), requires_grad=True)
        >>> guard.run_shares([5, 3], chunk_loss, weight=1 / 8, zero_grad=lambda: None)
        tensor(1.)
        >>> guard.micro_batch_sizes, seen
        ([2, None], [[(0, 2), (0, 3)], [(2, 4), (3, 3)], [(4, 5), (3, 3)]])
        """
        validate_int("min_micro_steps", min_micro_steps, minimum=0)
        total: torch.Tensor | None = None
        while True:
            caps = self._caps(shares, micro_batch_sizes)
            plan = micro_plan(shares, 1, caps, max(min_micro_steps, self.min_micro_steps))
            try:
                total = self._run_plan(plan, chunk_loss, weight, backward, summed)
                break
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                retry = self.after_oom(error, shares, plan)
            # Handled here, outside the except block, so the failed graph's frames are freed.
            total = None
            zero_grad()
            free_memory()
            if not retry:
                break
        # Without catching, an OOM has already propagated: the flag could only be 0.
        failed = total is None
        if self.catch and world_size(self.group) > 1:
            flag = torch.tensor(float(failed), device=comm_device(self.group))
            dist.all_reduce(flag, group=self.group)
            failed = bool(flag.item())  # the one host sync: every rank must agree
        if failed:
            zero_grad()
            self.skipped += 1
            return None
        return total

    def plan(
        self, shares: Sequence[int], micro_batch_sizes: Sequence[int | None] | None = None
    ) -> MicroPlan:
        """The micro-steps of a step (:func:`~evendp._distributed._step_layout.micro_plan`):
        per micro-step, each device's span ``[start, stop)`` of its own share, at most its OOM
        cap and ``micro_batch_sizes[i]``; an empty share gives empty spans.

        >>> OomResplit(devices=2).plan([3, 1], [2, None])
        [[(0, 2), (0, 1)], [(2, 3), (1, 1)]]
        """
        self._plan = micro_plan(
            shares, 1, self._caps(shares, micro_batch_sizes), self.min_micro_steps
        )
        return self._plan

    def after_oom(
        self, error: RuntimeError, shares: Sequence[int], plan: MicroPlan | None = None
    ) -> bool:
        """After ``error`` ended an attempt at ``plan`` (default: the last :meth:`plan`'s) of
        ``shares``: ``True``
        when the micro-batches were halved and the step may run again (plan it again),
        ``False`` when none can shrink (skip the step). Re-raises ``error`` when it is not an
        OOM, or when this guard does not catch (``catch=False``).

        The caller zeroes the gradients and calls :func:`free_memory` before the next attempt,
        outside its ``except`` block, so the failed graph can be collected.
        """
        if not (self.catch and is_oom_error(error)):
            raise error
        device = device_index_of(error)
        where = "out of memory" + ("" if device is None else f" on device {device}")
        plan = self._plan if plan is None else plan
        sizes = [b - a for a, b in plan[0]] if plan else [0] * len(shares)  # each first piece
        if not self._shrink(shares, sizes, device):
            self.notes.append(f"{where} at the smallest micro-batch: the step is skipped")
            return False
        self.resplits += 1
        caps = "/".join("all" if c is None else str(c) for c in self.micro_batch_sizes)
        self.notes.append(f"{where}: micro-batches now {caps} per device, the step runs again")
        return True

    def _caps(
        self, shares: Sequence[int], micro_batch_sizes: Sequence[int | None] | None
    ) -> list[int | None]:
        """Per device, the smaller of its OOM cap and the caller's (``None``: neither)."""
        if len(shares) != len(self.micro_batch_sizes):
            raise EvendpError(
                f"got {len(shares)} shares for a guard of {len(self.micro_batch_sizes)} devices;"
                " pass one share per device (zeros allowed)"
            )
        for n in shares:
            if not is_int(n) or n < 0:
                raise EvendpError(
                    f"n must be a non-negative int (samples in this share), got {n!r}"
                )
        given = list(micro_batch_sizes or [None] * len(shares))
        for cap in given:
            _validate_micro("micro_batch_size", cap)
        return [
            min((c for c in (mine, cap) if c is not None), default=None)
            for mine, cap in zip(self.micro_batch_sizes, given, strict=True)
        ]

    def _shrink(self, shares: Sequence[int], sizes: list[int], device: int | None) -> bool:
        """Halve the failing device's micro-batches (every active one's when unknown);
        False when none can shrink below the floor: the step is skipped."""
        floor = self.min_micro_batch_size or 1
        active = [i for i, n in enumerate(shares) if n]
        targets = [device] if device in active else active
        shrink = [i for i in targets if sizes[i] > floor]
        for i in shrink:
            sizes[i] = self.micro_batch_sizes[i] = max(math.ceil(sizes[i] / 2), floor)
        return bool(shrink)

    def _run_plan(
        self,
        plan: list[list[tuple[int, int]]],
        chunk_loss: Callable[[list[tuple[int, int]]], torch.Tensor],
        weight: float | torch.Tensor,
        backward: Callable[[torch.Tensor], None],
        summed: bool,
    ) -> torch.Tensor:
        self.micro_steps = len(plan)
        total: torch.Tensor | None = None  # summed on the loss's device: one copy at the end
        for k, spans in enumerate(plan):
            self.micro_step = k
            loss = chunk_loss(spans)  # () mean over the micro-step's samples (or their sum)
            if not summed:
                loss = share_loss(loss, sum(b - a for a, b in spans))
            scaled = loss * weight
            backward(scaled)
            part = scaled.detach().float()
            total = part if total is None else total + part
        # The total stays on its device: reading it is the caller's choice (when logging).
        return torch.zeros(()) if total is None else total


def free_memory() -> None:
    """Collect a failed attempt's graph and hand cached blocks back to the device."""
    # The failed graph is only garbage once the exception and its frames are gone; collect
    # cycles, then hand cached blocks back so the smaller micro-batches can use them.
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
