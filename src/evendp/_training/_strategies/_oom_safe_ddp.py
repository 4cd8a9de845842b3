"""DDP that survives an OOM on any rank: local backward, reduced as it goes, agreed, then used.

Why not DDP's own reducer: DDP launches a bucket's all-reduce from inside backward, and if one
rank runs out of memory half-way through its last backward, the buckets it launched pair with
the other ranks' while the rest never come; the others block in DDP's reducer with no way to
learn about the OOM. No micro-batch can be proven OOM-free in advance (fragmentation and other
processes change what fits). Here every rank runs the same collectives whatever happens
(:class:`~evendp._distributed._grad_buckets.GradientBuckets`: every bucket once, in one order,
then the step's flags): during the last backward each bucket goes as soon as it is ready, so
the reduction overlaps backward as DDP's does; a rank that failed launches the rest at the end
of its step, and the flags say whether the result is used, reduced again (a rank's launched
copy was stale: it retried after an OOM) or dropped (an OOM with nothing left to try).

The three are the verbs the Trainer calls in turn: ``reduce_gradients`` (the buckets backward
did not launch, the flags in the last one), ``agree_step`` (the flags read: step or skip) and
``apply_gradients`` (the result into ``.grad``, or reduced again).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..._distributed._grad_buckets import GradientBuckets
from ..._distributed._group import BUCKET_BYTES, comm_device
from .._oom import OomResplit
from .._stepper import Stepper
from ._base import signal_of, stop_votes
from ._ranks import RankStrategy

__all__ = ["OomSafeDDP"]


class OomSafeDDP(RankStrategy):
    """The default under torchrun: every micro-batch accumulates locally; the last one's
    backward launches each ~25 MiB gradient bucket's all-reduce once it is ready (DDP's
    overlap); the ranks' ``[OOM flag, loss, SIGINT, SIGTERM, stale]`` ride in the last bucket
    (in an all-reduce of their own when the gradients are not float32 on the communication
    device), the step's one host read. When any rank failed, all drop the
    result and skip: the reduction was wasted, never wrong."""

    _votes: tuple[float, float] | None = None  # the last step's summed stop votes, read
    _buckets: GradientBuckets | None = None
    _flags: torch.Tensor | None = None  # the step's flags, reduced, until agree_step reads them
    _stale = False  # whether some rank's launched bucket was stale (the flags, read)
    _last = True  # whether the micro-step running now is the step's last
    #: Bytes per gradient bucket (DDP's 25 MiB).
    bucket_bytes = BUCKET_BYTES
    # No collective waited for in backward (its buckets' all-reduces run beside it) or in
    # the optimizer step: both are this rank's own compute.
    local_parts = frozenset({"backward", "optimizer"})

    def guard(self, oom_resplit: bool) -> OomResplit:
        return OomResplit(catch=oom_resplit)

    def _gradient_buckets(self, *, recheck: bool = False) -> GradientBuckets:
        """The buckets of the parameters being trained: built at first use (the model is
        final after wrap), and again at a step's start (``recheck``, from :meth:`start_step`,
        which every rank runs, empty share or not) when that set changed (layers unfrozen,
        on every rank alike, as their optimizers are)."""
        current = self._buckets
        fresh = current is not None and not current._launched  # not mid-step
        if current is None or (recheck and fresh and not current.holds(self.model.parameters())):
            if current is not None:
                current.remove()
            current = GradientBuckets(self.model.parameters(), bucket_bytes=self.bucket_bytes)
            self._buckets = current
        return current

    def start_step(self) -> None:
        if self.world > 1:
            self._gradient_buckets(recheck=True)

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self._last = last  # only the last micro-step's gradients are final
        return contextlib.nullcontext()

    def backward(self, stepper: Stepper, loss: torch.Tensor) -> None:
        if not self._last or self.world == 1:  # one rank: nothing to reduce
            return super().backward(stepper, loss)
        with self._gradient_buckets().overlapping():  # each bucket goes once ready
            super().backward(stepper, loss)

    def reduce_gradients(self, failed: bool, total: torch.Tensor | None) -> None:
        """The buckets backward did not launch, then the step's flags ``[OOM, loss total,
        SIGINT, SIGTERM, stale]`` riding in the last one (the same collectives on every rank,
        whatever failed); one rank has nothing to reduce: its flags are the sums."""
        buckets = self._gradient_buckets() if self.world > 1 else None
        where = comm_device()
        mine = torch.zeros((), device=where) if total is None else total.to(where).float()
        stale = buckets is not None and buckets.stale
        failed_stale = torch.tensor([float(failed), float(stale)], device=where)
        votes = stop_votes(self._stop_source(), where)
        self._flags = torch.cat([failed_stale[:1], mine.reshape(1), votes, failed_stale[1:]])
        if buckets is not None:
            buckets.finish(self._flags, failed=failed)

    def agree_step(
        self, failed: bool, total: torch.Tensor | None
    ) -> tuple[bool, torch.Tensor | None]:
        """The flags that rode with the gradients, summed: skip on every rank when any
        failed (the reduction dropped), else the step's total over every rank."""
        flags, self._flags = self._flags, None
        assert flags is not None, "reduce_gradients runs before agree_step"
        # The one host read of a step, the flags together: whether a rank failed decides
        # the retry arithmetic's next plan and the skipped count, which the host keeps; a
        # stale copy anywhere makes every rank reduce again (data every rank has).
        failed_anywhere, _, sigint, sigterm, stale_anywhere = flags.tolist()
        self._votes, self._stale = (sigint, sigterm), bool(stale_anywhere)
        if not failed_anywhere:
            return False, flags[1]
        if self._buckets is not None and self.world > 1:
            self._buckets.discard()  # host bookkeeping only: nothing to wait for
        return True, None

    def apply_gradients(self) -> None:
        """The reduced buckets into ``.grad``, or, where some rank's launched copy was stale
        (agreed in the flags, so on every rank alike), one more all-reduce of ``.grad``."""
        if self._buckets is None or self.world == 1:
            return
        if self._stale:
            self._buckets.reduce_again()
        else:
            self._buckets.apply()

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        return parts  # already summed over ranks in the step's own all-reduce

    def agree_stop(self, step: int, *, starting: bool = False) -> int | None:
        votes, self._votes = self._votes, None
        if votes is None:  # no step agreed since the last call: a collective of its own
            return super().agree_stop(step, starting=True)
        return signal_of(*votes)
