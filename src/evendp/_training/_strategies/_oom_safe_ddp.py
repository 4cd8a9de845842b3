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

One call ends a step, :meth:`OomSafeDDP.finish_step`: the buckets backward did not launch,
the flags in the last one, the flags read (:func:`agree_step`: step or skip), the result into
``.grad`` (or reduced again); it returns what was agreed, and nothing waits in an attribute.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..._distributed._grad_buckets import GradientBuckets
from ..._distributed._group import BUCKET_BYTES, comm_device
from ._base import StepEnd, signal_of, stop_votes
from ._ranks import RankStrategy

__all__ = ["OomSafeDDP"]


class OomSafeDDP(RankStrategy):
    """The default under torchrun: every micro-batch accumulates locally; the last one's
    backward launches each ~25 MiB gradient bucket's all-reduce once it is ready (DDP's
    overlap); the ranks' ``[OOM flag, loss, SIGINT, SIGTERM, stale]`` ride in the last bucket
    (in an all-reduce of their own when the gradients are not float32 on the communication
    device), the step's one host read. When any rank failed, all drop the
    result and skip: the reduction was wasted, never wrong."""

    _buckets: GradientBuckets | None = None
    #: Bytes per gradient bucket (DDP's 25 MiB).
    bucket_bytes = BUCKET_BYTES
    # No collective waited for in backward (its buckets' all-reduces run beside it) or in
    # the optimizer step: both are this rank's own compute.
    local_parts = frozenset({"backward", "optimizer"})
    _survives_oom = True

    def _gradient_buckets(self, *, recheck: bool = False) -> GradientBuckets:
        """The buckets of the parameters being trained: built at first use (the model is
        final after wrap), and again between steps (``recheck``, at the last micro-step or
        the step's end, which every rank reaches, empty share or not) when that set changed
        (layers unfrozen, on every rank alike, as their optimizers are)."""
        current = self._buckets
        fresh = current is not None and not current._launched  # not mid-step
        if current is None or (recheck and fresh and not current.holds(self.model.parameters())):
            if current is not None:
                current.remove()
            current = GradientBuckets(self.model.parameters(), bucket_bytes=self.bucket_bytes)
            self._buckets = current
        return current

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if not last or self.world == 1:  # only the last micro-step's gradients are final
            return contextlib.nullcontext()
        return self._gradient_buckets(recheck=True).overlapping()  # each bucket goes once ready

    def finish_step(self, failed: bool, total: torch.Tensor | None) -> StepEnd:
        """The buckets backward did not launch, then the step's flags ``[OOM, loss total,
        SIGINT, SIGTERM, stale]`` riding in the last one (the same collectives on every rank,
        whatever failed; one rank has nothing to reduce: its flags are the sums), read once
        (:func:`agree_step`)."""
        buckets = self._gradient_buckets(recheck=True) if self.world > 1 else None
        where = comm_device()
        mine = torch.zeros((), device=where) if total is None else total.to(where).float()
        stale = buckets is not None and buckets.stale
        failed_stale = torch.tensor([float(failed), float(stale)], device=where)
        votes = stop_votes(self._stop_source(), where)
        flags = torch.cat([failed_stale[:1], mine.reshape(1), votes, failed_stale[1:]])
        if buckets is not None:
            buckets.finish(flags, failed=failed)
        return agree_step(flags, buckets)

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        return parts  # already summed over ranks in the step's own all-reduce

    def agree_stop(
        self,
        step: int,
        votes: tuple[float, float] | None = None,
        *,
        starting: bool = False,
        interrupted: KeyboardInterrupt | None = None,
    ) -> int | None:
        if starting or interrupted is not None:
            return super().agree_stop(step, starting=starting, interrupted=interrupted)
        if votes is None:  # no step agreed since the last call: a collective of its own
            self._done = step
            return self._vote_now()
        return signal_of(*votes)


def agree_step(flags: torch.Tensor, buckets: GradientBuckets | None) -> StepEnd:
    """The flags that rode with the gradients, summed: skip on every rank when any failed
    (the reduction dropped), else the reduced buckets into ``.grad`` or, where some rank's
    launched copy was stale (agreed in the flags, so on every rank alike), one more
    all-reduce of ``.grad``; the step's total over every rank and the stop votes."""
    # The one host read of a step, the flags together: whether a rank failed decides the
    # retry arithmetic's next plan and the skipped count, which the host keeps; a stale copy
    # anywhere makes every rank reduce again (data every rank has).
    failed_anywhere, _, sigint, sigterm, stale_anywhere = flags.tolist()
    if failed_anywhere:
        if buckets is not None:
            buckets.discard()  # host bookkeeping only: nothing to wait for
        return StepEnd(None, (sigint, sigterm))
    if buckets is not None:
        if stale_anywhere:
            buckets.reduce_again()
        else:
            buckets.apply()
    return StepEnd(flags[1], (sigint, sigterm))
