"""DDP that survives an OOM on any rank: local backward, then agree, then reduce.

Why it gives up DDP's overlap even on the last micro-batch: DDP launches a bucket's all-reduce
from inside backward as soon as its gradients are ready. If one rank runs out of memory
half-way through its last backward, the buckets it already launched pair with the other ranks'
while the rest never come; the others block in DDP's reducer with no way to learn about the
OOM. No micro-batch can be proven OOM-free in advance (fragmentation and other processes
change what fits), so every backward stays local, the ranks agree on the step, and only then
are the gradients used. The bucketed reduction keeps two buckets in flight, so it costs about
one gradient all-reduce's time, not two copies of memory.
"""

from __future__ import annotations

import torch

from ..._distributed._group import all_reduce_gradients, comm_device
from .._oom import OomResplit
from ._base import signal_of, stop_votes
from ._ranks import RankStrategy

__all__ = ["OomSafeDDP"]


class OomSafeDDP(RankStrategy):
    """The default under torchrun: every micro-batch accumulates locally (no collective inside
    forward or backward); then the gradients are averaged in place in ~25 MiB buckets
    (:func:`~evendp._distributed._group.all_reduce_gradients`) with the ranks' ``[OOM flag, loss,
    SIGINT, SIGTERM]`` summed in the last bucket: no collective of its own, and one host read
    (the flag) per step. A rank that failed sends zeros; when any rank failed, all zero the
    result and skip: the reduction was wasted, never wrong."""

    _votes: tuple[float, float] | None = None  # the last step's summed stop votes, read
    # No collective in backward or in the optimizer step (the gradients were averaged in
    # agree_step): both are this rank's own compute.
    local_parts = frozenset({"backward", "optimizer"})

    def guard(self, oom_resplit: bool) -> OomResplit:
        return OomResplit(catch=oom_resplit)

    def agree_step(
        self, failed: bool, total: torch.Tensor | None
    ) -> tuple[bool, torch.Tensor | None]:
        # The gradients are averaged and the flags summed in the same collectives, and the
        # one host read (the OOM flag) follows them. The stop votes are read by agree_stop.
        where = comm_device()
        mine = torch.zeros((), device=where) if total is None else total.to(where).float()
        fused = torch.stack([torch.tensor(float(failed), device=where), mine])
        fused = torch.cat([fused, stop_votes(self._stop_source(), where)])
        all_reduce_gradients(self.model.parameters(), extra=fused)
        # The one host read of a step, the OOM flag and the stop votes together: whether a
        # rank failed decides the retry arithmetic's next plan and the skipped count, which
        # the host keeps (a skip on the device alone would still need the host to know it).
        failed_anywhere, _, sigint, sigterm = fused.tolist()
        self._votes = (sigint, sigterm)
        if failed_anywhere:
            return True, None
        return False, fused[1]  # the step's total over every rank

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        return parts  # already summed over ranks in the step's own all-reduce

    def agree_stop(self, step: int, *, starting: bool = False) -> int | None:
        votes, self._votes = self._votes, None
        if votes is None:  # no step agreed since the last call: a collective of its own
            return super().agree_stop(step, starting=True)
        return signal_of(*votes)
