"""Surviving ``torch.OutOfMemoryError`` without changing the math: exact micro-batch re-splits.

A step's share of ``n`` samples runs as micro-batches ``[start, stop)``; each micro-batch's
mean loss is weighted by ``(stop - start) * weight`` (``weight`` = 1 / global count, times the
world size under DDP's averaging) before ``backward``, so the accumulated gradient is the
gradient of the global mean however the share is cut. When a micro-batch runs out of memory,
the step's gradients are dropped (an OOM inside ``backward`` may already have added part of a
micro-batch to some ``.grad``), the failed graph is freed, the CUDA cache emptied, and the
whole share runs again with micro-batches half as large. The working size is remembered for
later steps. Only when a single-sample micro-batch still does not fit is the step skipped,
counted in :attr:`OomResplit.skipped`.

With several devices in one process (:meth:`OomResplit.run_shares`) each device keeps its own
cap: micro-step k runs the k-th piece of every device's own share together, so an OOM that
names its device (``evendp_device_index``, set by ``BalancedDataParallel``) halves that
device's pieces only, and the healthy devices keep running their whole shares at once.

Under DDP every rank runs its share locally (no collective inside forward or backward, see
:func:`all_reduce_gradients`), then :meth:`OomResplit.run` all-reduces one flag (with the
step's loss in the same small tensor) so that every rank agrees on "step" or "skip": an OOM on
one rank can never leave another blocked in a collective.
"""

from __future__ import annotations

import gc
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ._distributed import comm_device, world_size
from ._errors import EvendpError

__all__ = ["OomResplit", "all_reduce_gradients", "is_oom_error"]

# Out-of-memory reported as a plain RuntimeError by libraries that allocate on their own:
# cuBLAS/cuDNN/cuFFT/cuSOLVER/cuSPARSE workspaces ("CUBLAS_STATUS_ALLOC_FAILED",
# "CUDNN_STATUS_ALLOC_FAILED", "CUFFT_ALLOC_FAILED"), the CUDA runtime ("CUDA error: out of
# memory") and NCCL ("Cuda failure 'out of memory'").
_OOM_MESSAGE = re.compile(r"_ALLOC_FAILED|out of memory", re.IGNORECASE)


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` means a device ran out of memory: by type first, message as fallback.

    >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    True
    >>> is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    True
    >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and _OOM_MESSAGE.search(str(error)) is not None


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _validate_micro(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EvendpError(f"{name} must be a positive int or None, got {value!r}; e.g. 8")
    return value


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
    ) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise EvendpError(f"devices must be a positive int, got {devices!r}; e.g. 3")
        self.catch = catch
        #: Per device, the micro-batch that fits (``None``: its whole share); kept across steps.
        self.micro_batch_sizes = [_validate_micro("micro_batch_size", micro_batch_size)] * devices
        self.min_micro_batch_size = _validate_micro("min_micro_batch_size", min_micro_batch_size)
        self.group = group
        #: How many times a step was re-run with smaller micro-batches.
        self.resplits = 0
        #: How many steps were skipped because even the smallest micro-batch did not fit.
        self.skipped = 0
        #: While ``chunk_loss`` runs: the index of this micro-step and how many the attempt
        #: runs, so a caller can sync gradients on the last one only.
        self.micro_step = 0
        self.micro_step_count = 0

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

    def _distributed(self) -> bool:
        return world_size(self.group) > 1

    def run(
        self,
        n: int,
        chunk_loss: Callable[[int, int], torch.Tensor],
        *,
        weight: float,
        zero_grad: Callable[[], None],
        backward: Callable[[torch.Tensor], None] = _default_backward,
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
        backward: Callable[[torch.Tensor], None] = _default_backward,
        micro_batch_sizes: Sequence[int | None] | None = None,
        min_micro_steps: int = 0,
        summed: bool = False,
        reduce_total: bool = False,
        agree: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Like :meth:`run`, with one share per device, each cut by its own cap.

        Micro-step k gives device i the span ``[start_i, stop_i)`` of *its own* share: the
        k-th piece of at most ``micro_batch_sizes[i]`` samples, empty once the share is done.
        ``chunk_loss(spans)`` returns the mean loss over all the spans' samples, and is
        weighted by their count times ``weight``. An OOM carrying ``evendp_device_index``
        (set by :class:`~evendp.BalancedDataParallel` for a replica's forward) halves that
        device's cap only; any other OOM (e.g. in backward) halves every device's.

        ``min_micro_steps`` pads the step with empty micro-steps (every span empty) up to that
        many: under DDP or FSDP2 every rank must run forward and backward as often as the
        others, even with no samples. An empty micro-step backpropagates
        ``loss.nan_to_num(0.0) * 0`` (the mean over no samples is NaN): zero gradients that
        still reach every parameter, so DDP's and FSDP2's collectives pair up.

        ``summed=True``: ``chunk_loss`` returns the loss already *summed* over its counted
        items (and zero, never NaN, for none); it is weighted by ``weight`` alone. This is how
        the Trainer weights by counted items (tokens) instead of samples. ``weight`` may be a
        0-dim tensor (a global count all-reduced on the device, never read on the host).

        ``reduce_total=True`` (under DDP): the ranks' step/skip flag and their totals travel in
        one all-reduce, and the returned total is the sum over ranks (on the communication
        device); only the flag is read on the host, since every rank must agree on it.

        ``agree(status)`` (under DDP) all-reduces (sums) ``status`` in place *instead of* the
        guard's own all-reduce: :class:`~evendp._strategy.OomSafeDDP` passes one that sends it
        with the gradient buckets, so the flag costs no collective of its own. A rank that
        failed has zero gradients by then, and when any rank failed every rank zeroes the
        averaged gradients and skips: the reduction was wasted, never wrong.

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
        if len(shares) != len(self.micro_batch_sizes):
            raise EvendpError(
                f"got {len(shares)} shares for a guard of {len(self.micro_batch_sizes)} devices;"
                " pass one share per device (zeros allowed)"
            )
        for n in shares:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise EvendpError(
                    f"n must be a non-negative int (samples in this share), got {n!r}"
                )
        if (
            isinstance(min_micro_steps, bool)
            or not isinstance(min_micro_steps, int)
            or min_micro_steps < 0
        ):
            raise EvendpError(f"min_micro_steps must be an int >= 0, got {min_micro_steps!r}")
        caps = list(micro_batch_sizes or [None] * len(shares))
        for cap in caps:
            _validate_micro("micro_batch_size", cap)
        sizes = [
            min(x for x in (n, mine, cap) if x is not None)
            for n, mine, cap in zip(shares, self.micro_batch_sizes, caps, strict=True)
        ]
        floor = self.min_micro_batch_size or 1
        total: torch.Tensor | None = None
        while True:
            device: int | None = None
            try:
                total = self._run_micro_steps(
                    shares, sizes, chunk_loss, weight, backward, min_micro_steps, summed
                )
                break
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not (self.catch and is_oom_error(error)):
                    raise
                device = getattr(error, "evendp_device_index", None)
            # Handled here, outside the except block, so the failed graph's frames are freed.
            total = None
            zero_grad()
            _free_memory()
            active = [i for i, n in enumerate(shares) if n]
            targets = [device] if device in active else active
            shrink = [i for i in targets if sizes[i] > floor]
            if not shrink:
                break
            for i in shrink:
                sizes[i] = self.micro_batch_sizes[i] = max(math.ceil(sizes[i] / 2), floor)
            self.resplits += 1
        failed = total is None
        # Without catching, an OOM has already propagated: the flag could only be 0.
        if self.catch and self._distributed():
            # One small all-reduce per step: [ranks that failed, sum of the ranks' totals].
            where = comm_device(self.group)
            mine = torch.zeros((), device=where) if total is None else total.to(where)
            status = torch.stack([torch.tensor(float(failed), device=where), mine.float()])
            if agree is not None:
                agree(status)
            else:
                dist.all_reduce(status, group=self.group)
            failed = bool(status[0].item())  # the one host sync: every rank must agree
            if reduce_total and not failed:
                total = status[1]
        if failed:
            zero_grad()
            self.skipped += 1
            return None
        return total

    def _run_micro_steps(
        self,
        shares: Sequence[int],
        sizes: list[int],
        chunk_loss: Callable[[list[tuple[int, int]]], torch.Tensor],
        weight: float | torch.Tensor,
        backward: Callable[[torch.Tensor], None],
        min_micro_steps: int,
        summed: bool = False,
    ) -> torch.Tensor:
        steps = max(
            (math.ceil(n / size) for n, size in zip(shares, sizes, strict=True) if n), default=0
        )
        self.micro_step_count = steps = max(steps, min_micro_steps)
        total: torch.Tensor | None = None  # summed on the loss's device: one copy at the end
        for k in range(steps):
            self.micro_step = k
            spans = [
                (min(k * z, n), min((k + 1) * z, n)) for n, z in zip(shares, sizes, strict=True)
            ]
            loss = chunk_loss(spans)  # () mean over the micro-step's samples (or their sum)
            count = sum(b - a for a, b in spans)
            if summed:
                scaled = loss * weight
            elif count:
                scaled = loss * (count * weight)
            else:  # no samples: the mean is NaN, and NaN * 0 is NaN; zero it (gradient 0)
                scaled = loss.nan_to_num(0.0) * 0.0
            backward(scaled)
            part = scaled.detach().float()
            total = part if total is None else total + part
        # The total stays on its device: reading it is the caller's choice (when logging).
        return torch.zeros(()) if total is None else total


def _free_memory() -> None:
    # The failed graph is only garbage once the exception and its frames are gone; collect
    # cycles, then hand cached blocks back so the smaller micro-batches can use them.
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    *,
    bucket_bytes: int = _BUCKET_BYTES,
    extra: torch.Tensor | None = None,
) -> None:
    """Average ``.grad`` over ranks (sum / world size, as DDP does), in place, in buckets.

    Used after :meth:`OomResplit.run` agreed to step: every rank calls it exactly once per
    step, whatever its micro-batching, so the collectives stay in lockstep. A parameter
    without a gradient (a rank with an empty share) contributes zeros. Without a process
    group (or with one rank) it does nothing.

    Gradients go in buckets of about ``bucket_bytes`` (DDP's 25 MiB), each one all-reduce:
    a gradient that fills a bucket alone is reduced in place, smaller ones are flattened
    into one bucket buffer. At most two buckets are in flight, so the extra memory is two
    buckets, never a second copy of all gradients, while one bucket's reduction overlaps the
    next one's packing.

    ``extra`` (a small contiguous tensor, e.g. an OOM flag and a loss) is *summed* over ranks in
    place, riding in the last bucket instead of a collective of its own.

    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> p.grad = torch.full((2,), 3.0)
    >>> all_reduce_gradients([p])  # one process: unchanged
    >>> p.grad
    tensor([3., 3.])
    """
    world = world_size(group)
    if world == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if extra is not None:
        grads.append(extra)
    in_flight: deque[tuple[dist.Work | None, torch.Tensor, list[torch.Tensor]]] = deque()
    for bucket in _buckets(grads, bucket_bytes):
        alone = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if alone else _flatten_dense_tensors(bucket)  # (sum of numels,)
        in_flight.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
        if len(in_flight) > 2:
            _unpack(*in_flight.popleft(), world, extra)
    while in_flight:
        _unpack(*in_flight.popleft(), world, extra)


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, about ``bucket_bytes`` per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        same = not bucket or (g.dtype, g.device) == (bucket[0].dtype, bucket[0].device)
        if bucket and (not same or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def _unpack(
    work: dist.Work | None,
    flat: torch.Tensor,
    bucket: list[torch.Tensor],
    world: int,
    summed: torch.Tensor | None,
) -> None:
    # Gradients are averaged (as DDP does); ``summed`` (the extra tensor) keeps the sum.
    if work is not None:
        work.wait()
    if flat is bucket[0]:
        if flat is not summed:
            flat.div_(world)
        return
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
        g.copy_(reduced if g is summed else reduced.div_(world))
