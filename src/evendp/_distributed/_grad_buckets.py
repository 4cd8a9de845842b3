"""Gradient buckets reduced while backward runs, in an order every rank shares.

Why not DDP's reducer: after an OOM half-way through a backward, the buckets it launched pair
with other ranks' while the rest never come. Here the *sequence* of collectives is fixed
(every bucket once, in order, then the step's flags); a rank chooses only *when* it launches
each, which changes no pairing. A launched copy that went stale (an OOM retry, a gradient
arriving twice) is said in the flags, and every rank then reduces ``.grad`` again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from ._group import BUCKET_BYTES, all_reduce_gradients, bucket_tensors

__all__ = ["GradientBuckets"]


class GradientBuckets:
    """The all-reduce of ``params``' gradients in ~``bucket_bytes`` buckets, in backward
    order (as DDP's), each launched from a gradient hook during :meth:`overlapping` once it
    and every earlier bucket are ready; :meth:`finish` launches the rest and the flags.

    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> buckets = GradientBuckets([p])
    >>> with buckets.overlapping():
    ...     (p * 3).sum().backward()
    >>> flags = torch.zeros(1)
    >>> buckets.finish(flags)  # one process: nothing to reduce
    >>> buckets.apply(), p.grad
    (None, tensor([3., 3.]))
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        #: Parameter lists in launch order; the sequence is the same on every rank.
        backward_order: list[torch.Tensor] = list(self.params[::-1])
        self.buckets = list(bucket_tensors(backward_order, bucket_bytes))
        self._bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        #: Whether a launched bucket no longer holds this rank's gradient (a gradient came
        #: after its launch: a retry after an OOM, or a second accumulation in one backward).
        self.stale = False
        #: Whether this rank launches buckets during backward (else all at :meth:`finish`).
        self.overlap = True
        self._armed = False
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._launched: list[tuple[dist.Work | None, torch.Tensor]] = []  # bucket order
        self._kept: dict[int, torch.Tensor] = {}  # CPU buckets' buffers

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Around the step's last backward: launch each bucket as soon as it is ready."""
        if self._launched:  # the step runs again (an OOM retry): what went came from before
            self.stale = True
        self._armed = self.overlap and not self._launched  # the rest waits for finish
        self._ready = [set() for _ in self.buckets]
        try:
            yield
        finally:
            self._armed = False

    def _on_grad(self, param: torch.Tensor) -> None:
        k = self._bucket_of[id(param)]
        if k < len(self._launched):  # a gradient after its bucket went: the copy is stale
            self.stale = True
            # A second accumulation inside one backward (reentrant checkpointing over a
            # shared weight) would repeat every step: this rank launches at the end from now.
            self.overlap = self.overlap and not self._armed
            return
        if not self._armed:
            return
        self._ready[k].add(id(param))
        nxt = len(self._launched)
        # The last bucket (the first layers', ready last anyway) waits for the flags to ride
        # in it: no collective of their own.
        while nxt < len(self.buckets) - 1 and len(self._ready[nxt]) == len(self.buckets[nxt]):
            self._launch(nxt)
            nxt += 1

    def _launch(self, k: int, flags: torch.Tensor | None = None) -> None:
        # (numel,), a copy (torch.cat always allocates; flattening one tensor returns a view
        # of it), so .grad stays this rank's own until the flags are read.
        parts = [_grad_of(p).reshape(-1) for p in self.buckets[k]]
        parts = parts if flags is None else [*parts, flags.reshape(-1)]
        flat = self._buffer(k, sum(t.numel() for t in parts), parts[0])
        torch.cat(parts, out=flat)
        work = dist.all_reduce(flat, group=self.group, async_op=True) if self.world > 1 else None
        self._launched.append((work, flat))

    def _buffer(self, k: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``k``'s flat buffer, kept from step to step on a CPU device: a large CPU block
        goes back to the OS when freed, and a new one pays its page faults during backward (a
        51 MB MLP on 2 gloo ranks: 163 ms a step against 143 ms kept). A GPU's caching
        allocator reuses its block anyway."""
        if like.device.type != "cpu":
            return like.new_empty(numel)
        kept = self._kept.get(k)
        if kept is None or kept.numel() != numel or kept.dtype != like.dtype:
            kept = self._kept[k] = like.new_empty(numel)
        return kept

    def finish(self, flags: torch.Tensor, *, failed: bool = False) -> None:
        """Launch the buckets not launched yet, ``flags`` (summed in place) riding in the last
        when dtype and device agree; wait for all. ``failed`` (this rank ran out of memory:
        every rank drops the result): the rest goes as zeros from one buffer, no copy."""
        self._armed = False
        last = len(self.buckets) - 1
        if failed:
            self._send_zeros(last)
        for k in range(len(self._launched), last):
            self._launch(k)
        like = self.buckets[last][0] if self.buckets else None
        rides = like is not None and (like.dtype, like.device) == (flags.dtype, flags.device)
        if len(self._launched) == last:  # -1 without parameters: nothing to launch
            self._launch(last, flags if rides else None)
        if self.world > 1 and not rides:
            dist.all_reduce(flags, group=self.group)
        for work, _ in self._launched:
            if work is not None:
                work.wait()
        if rides and self.world > 1:
            flags.copy_(self._launched[-1][1][-flags.numel() :].view_as(flags))

    def _send_zeros(self, last: int) -> None:
        """A failed rank's unlaunched buckets but the last, as zeros of each bucket's dtype,
        waited one by one (the step is skipped everywhere: no result is used)."""
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for k in range(len(self._launched), last):
            like, numel = self.buckets[k][0], sum(p.numel() for p in self.buckets[k])
            key = (like.dtype, like.device)
            if key not in zeros or zeros[key].numel() < numel:
                zeros[key] = torch.zeros(numel, dtype=like.dtype, device=like.device)
            part = zeros[key][:numel]
            dist.all_reduce(part, group=self.group)
            part.zero_()
            self._launched.append((None, part))

    def apply(self) -> None:
        """Make each ``.grad`` the ranks' average, from the reduced buckets."""
        for (_, flat), bucket in zip(self._launched, self.buckets, strict=True):
            grads = [_grad_of(p) for p in bucket]
            numel = sum(g.numel() for g in grads)  # the flags may ride after them
            reduced = _unflatten_dense_tensors(flat[:numel], grads)  # views of flat
            for g, summed in zip(grads, reduced, strict=True):
                torch.div(summed, self.world, out=g)  # one pass: the mean, into .grad
        self._reset()

    def reduce_again(self) -> None:
        """Some rank's launched copies were stale: average ``.grad`` itself (every rank)."""
        self._reset()
        all_reduce_gradients(self.params, self.group)

    def discard(self) -> None:
        """Drop the reduced buckets (a step every rank skips)."""
        self._reset()

    def _reset(self) -> None:
        self._launched, self.stale = [], False

    def holds(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether these buckets are those of ``params``' trained ones, in the same order."""
        trained = [id(p) for p in params if p.requires_grad]
        return trained == [id(p) for p in self.params]

    def remove(self) -> None:
        """Take the gradient hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient; a parameter without one (an empty share, an unused branch) gets
    zeros, so every rank sends the same bucket sizes."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
