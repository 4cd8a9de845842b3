"""The collective arithmetic of the exact loss on ranks as threads (tests/_threaded.py): for
any world size and any split, zeros included, the global count is the sum of the ranks'
counts, the global mean is the one-device mean, and the per-rank ``ddp_loss`` values that DDP
averages give the one-device mean loss (so the averaged gradient is the one-device gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from evendp._distributed._group import ddp_loss, global_count, global_mean
from tests._threaded import run_threads


@st.composite
def _splits(draw: st.DrawFn) -> tuple[list[int], list[float]]:
    """Per-rank item counts for 1-5 ranks (zeros allowed, not all zero), and one loss per item."""
    counts = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(any))
    values = draw(
        st.lists(st.floats(-10, 10, width=32), min_size=sum(counts), max_size=sum(counts))
    )
    return counts, values


def _shares(counts: list[int], values: list[float]) -> list[torch.Tensor]:
    cuts = torch.tensor(values).split(counts)
    return [c.clone() for c in cuts]


@given(_splits())
def test_counts_means_and_ddp_losses_over_threads_are_the_one_device_ones(
    split: tuple[list[int], list[float]],
) -> None:
    counts, values = split
    shares = _shares(counts, values)

    def rank_body(rank: int, world: int) -> tuple[float, float, float, int]:
        mine = shares[rank]
        total = global_count(torch.tensor(len(mine)))
        mean = global_mean(mine.sum(), len(mine))
        loss = ddp_loss(mine.sum(), len(mine))  # DDP then averages over `world` ranks
        return float(total), float(mean), float(loss) / world, dist.get_world_size()

    per_rank = run_threads(rank_body, len(counts))
    whole = torch.tensor(values, dtype=torch.float64)
    for total, mean, _, world in per_rank:
        assert total == sum(counts) and world == len(counts)
        assert mean == pytest.approx(float(whole.mean()), rel=1e-5, abs=1e-5)
    averaged = sum(share for _, _, share, _ in per_rank)  # what DDP's mean of gradients sees
    assert averaged == pytest.approx(float(whole.mean()), rel=1e-5, abs=1e-5)


def test_the_per_rank_mean_that_the_threads_replace_is_biased() -> None:
    # The seed posts' example: losses [0.3, 0.2, 0.8] split [2, 1] over 2 ranks. The mean of
    # per-rank means is 0.525, the one-device mean 0.4333; ddp_loss gives the latter.
    shares = [torch.tensor([0.3, 0.2]), torch.tensor([0.8])]

    def rank_body(rank: int, world: int) -> tuple[float, float]:
        mine = shares[rank]
        return float(mine.mean()), float(ddp_loss(mine.sum(), len(mine))) / world

    per_rank = run_threads(rank_body, 2)
    assert sum(m for m, _ in per_rank) / 2 == pytest.approx(0.525)
    assert sum(s for _, s in per_rank) == pytest.approx(0.43333, rel=1e-4)


def test_a_failing_rank_is_reported_and_the_world_is_restored() -> None:
    before = dist.distributed_c10d._world

    def rank_body(rank: int, world: int) -> None:
        if rank == 1:
            raise ValueError("rank 1 fails")
        global_count(torch.tensor(1))  # rank 0 waits in the collective: woken, not hung

    with pytest.raises(AssertionError, match="rank 1 of 2 failed"):
        run_threads(rank_body, 2, timeout_s=30)
    assert dist.distributed_c10d._world is before and not dist.is_initialized()
