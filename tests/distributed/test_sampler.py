"""UnevenBatchSampler, batch-size parsing and EmptySafeCollate (evendp._distributed._sampler).

The loss helpers and starting a rank are tests/distributed/test_distributed.py; the
multi-process (gloo) checks of exact gradients live in tests/distributed/test_distributed_gloo.py.
"""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from evendp._core._errors import EvendpError
from evendp._core._split import split_sizes
from evendp._distributed._batch_plan import batch_sizes_from_env, parse_batch_sizes
from evendp._distributed._collate import EmptySafeCollate
from evendp._distributed._sampler import UnevenBatchSampler


def all_ranks(n: int, sizes: list[int], **kw: object) -> list[list[list[int]]]:
    """Per rank, the list of batches one epoch yields."""
    return [
        list(UnevenBatchSampler(n, sizes, rank=r, **kw))  # type: ignore[arg-type]
        for r in range(len(sizes))
    ]


sizes_strategy = st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda s: sum(s) > 0)


@settings(max_examples=25, deadline=None)
@given(
    sizes=sizes_strategy, extra=st.integers(0, 60), shuffle=st.booleans(), seed=st.integers(0, 9)
)
def test_every_index_once_and_equal_step_counts(
    sizes: list[int], extra: int, shuffle: bool, seed: int
) -> None:
    n = len(sizes) + extra
    per_rank = all_ranks(n, sizes, shuffle=shuffle, seed=seed)
    steps = math.ceil(n / sum(sizes))
    assert [len(b) for b in per_rank] == [steps] * len(sizes)
    assert all(len(UnevenBatchSampler(n, sizes, rank=r)) == steps for r in range(len(sizes)))
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(n))  # each index exactly once: coverage and disjointness
    full_steps = n // sum(sizes)
    for r, batches in enumerate(per_rank):
        assert all(len(b) == sizes[r] for b in batches[:full_steps])
    if n % sum(sizes):  # the short last step is split in proportion to the sizes
        last = [len(batches[-1]) for batches in per_rank]
        assert last == split_sizes(n % sum(sizes), sizes)


@settings(max_examples=20, deadline=None)
@given(sizes=sizes_strategy, extra=st.integers(0, 60))
def test_drop_last_gives_only_full_steps(sizes: list[int], extra: int) -> None:
    n = max(len(sizes), sum(sizes)) + extra
    per_rank = all_ranks(n, sizes, drop_last=True)
    steps = n // sum(sizes)
    for r, batches in enumerate(per_rank):
        assert [len(b) for b in batches] == [sizes[r]] * steps
        assert len(UnevenBatchSampler(n, sizes, rank=r, drop_last=True)) == steps
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == steps * sum(sizes)


def test_step_slices_follow_one_global_permutation() -> None:
    # Rank r's batch at step k is perm[k*B + offset_r : ... + size_r] of the shared permutation.
    sizes, n = [2, 0, 3], 13
    g = torch.Generator()
    g.manual_seed(5 + 2)
    perm = torch.randperm(n, generator=g).tolist()
    per_rank = []
    for r in range(3):
        s = UnevenBatchSampler(n, sizes, rank=r, seed=5)
        s.set_epoch(2)
        per_rank.append(list(s))
    for k in range(2):
        assert per_rank[0][k] == perm[5 * k : 5 * k + 2]
        assert per_rank[1][k] == []
        assert per_rank[2][k] == perm[5 * k + 2 : 5 * k + 5]
    # Last step: 3 indices split [1, 0, 2] (largest remainder of 3 over weights 2, 0, 3).
    assert per_rank[0][2] == perm[10:11] and per_rank[2][2] == perm[11:13]


def test_deterministic_and_epochs_differ() -> None:
    a = UnevenBatchSampler(50, [3, 5], rank=1, seed=7)
    b = UnevenBatchSampler(50, [3, 5], rank=1, seed=7)
    assert list(a) == list(b) == list(a)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(UnevenBatchSampler(50, [3, 5], rank=1, seed=8)) != first


def test_no_shuffle_is_in_order() -> None:
    assert list(UnevenBatchSampler(7, [2, 1], rank=0, shuffle=False)) == [[0, 1], [3, 4], [6]]
    assert list(UnevenBatchSampler(7, [2, 1], rank=1, shuffle=False)) == [[2], [5], []]


def test_zero_size_rank_yields_empty_batches_every_step() -> None:
    batches = list(UnevenBatchSampler(20, [4, 0, 3], rank=1))
    assert batches == [[]] * 3
    assert len(UnevenBatchSampler(20, [4, 0, 3], rank=1)) == 3


def test_accepts_a_dataset_and_properties() -> None:
    data = TensorDataset(torch.arange(9.0))
    s = UnevenBatchSampler(data, [1, 2], rank=1)
    assert (s.num_samples, s.world_size, s.batch_size, s.global_batch_size) == (9, 2, 2, 3)
    assert s.batch_sizes == [1, 2]


def test_world_size_without_process_group_checks_length() -> None:
    assert UnevenBatchSampler(9, [1, 2], rank=0, world_size=2).world_size == 2
    with pytest.raises(EvendpError, match=r"2 batch sizes .* world_size=3"):
        UnevenBatchSampler(9, [1, 2], rank=0, world_size=3)


@settings(max_examples=20, deadline=None)
@given(
    first=sizes_strategy,
    data=st.data(),
    switch_at=st.integers(0, 8),
    extra=st.integers(0, 50),
    drop_last=st.booleans(),
)
def test_set_batch_sizes_mid_epoch_keeps_coverage(
    first: list[int], data: st.DataObject, switch_at: int, extra: int, drop_last: bool
) -> None:
    k = len(first)
    n = max(k, sum(first)) + extra
    # With drop_last, sizes whose global batch exceeds the data are refused (tested apart).
    second = data.draw(
        st.lists(st.integers(0, 9), min_size=k, max_size=k).filter(
            lambda s: sum(s) > 0 and not (drop_last and sum(s) > n)
        )
    )
    per_rank: list[list[list[int]]] = []
    lengths = []
    for r in range(k):
        s = UnevenBatchSampler(n, first, rank=r, drop_last=drop_last)
        batches = []
        for step, batch in enumerate(s):
            batches.append(batch)
            if step == switch_at:
                s.set_batch_sizes(second)  # the balancer calls it on every rank at one step
        per_rank.append(batches)
        lengths.append(len(batches))
    assert len(set(lengths)) == 1  # equal step counts survive the change
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen))
    if not drop_last:
        assert sorted(seen) == list(range(n))
    # After the switch, full steps use the new sizes.
    for r in range(k):
        after = per_rank[r][switch_at + 1 : -1]
        assert all(len(b) == second[r] for b in after)


def test_len_follows_set_batch_sizes() -> None:
    s = UnevenBatchSampler(20, [1, 1], rank=0, shuffle=False)
    it = iter(s)
    next(it)
    assert len(s) == 10
    s.set_batch_sizes([4, 4])
    assert len(s) == 1 + math.ceil(18 / 8)
    assert len(list(it)) == 3
    assert len(s) == math.ceil(20 / 8)  # between epochs: a whole epoch at the new sizes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_sizes": [3, -1]}, r"-1 for rank 1 .* not a non-negative int"),
        ({"batch_sizes": [0, 0]}, r"all batch sizes are zero"),
        ({"batch_sizes": []}, r"batch_sizes is empty"),
        ({"batch_sizes": "3,5"}, r"sequence of non-negative ints"),
        ({"batch_sizes": [2.5, 1]}, r"2.5 for rank 0"),
        ({"batch_sizes": [True, 1]}, r"True for rank 0"),
        ({"rank": 2}, r"rank 2 is out of range for world_size=2"),
        ({"rank": -1}, r"rank -1 is out of range"),
        ({"world_size": 3}, r"2 batch sizes \[3, 5\] for world_size=3"),
        ({"data": 1}, r"1 samples, fewer than the 2 ranks"),
        ({"data": -3}, r"length must be >= 0"),
        ({"data": object()}, r"dataset with len\(\)"),
        ({"data": 7, "drop_last": True}, r"drop_last=True with 7 samples .* global batch of 8"),
    ],
)
def test_bad_input_names_the_value(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"data": 100, "batch_sizes": [3, 5], "rank": 0}
    args.update(kwargs)
    with pytest.raises(EvendpError, match=match):
        UnevenBatchSampler(**args)  # type: ignore[arg-type]


def test_rank_none_without_process_group_is_a_clear_error() -> None:
    with pytest.raises(EvendpError, match=r"no torch\.distributed process group"):
        UnevenBatchSampler(10, [1, 2])


def test_set_batch_sizes_validates() -> None:
    s = UnevenBatchSampler(10, [1, 2], rank=0)
    with pytest.raises(EvendpError, match="3 batch sizes"):
        s.set_batch_sizes([1, 2, 3])
    with pytest.raises(EvendpError, match="all batch sizes are zero"):
        s.set_batch_sizes([0, 0])
    with pytest.raises(EvendpError, match="drop_last=True with 10 samples"):
        UnevenBatchSampler(10, [1, 2], rank=0, drop_last=True).set_batch_sizes([6, 6])
    assert s.batch_sizes == [1, 2]  # a rejected change leaves the sizes alone


# --- batch sizes from the flag / environment -------------------------------------------------


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("3,5") == [3, 5]
    assert parse_batch_sizes(" 0 , 7 ", world_size=2) == [0, 7]
    with pytest.raises(EvendpError, match="'' is not an int"):
        parse_batch_sizes("3,,5")
    with pytest.raises(EvendpError, match="-2 for rank 1"):
        parse_batch_sizes("3,-2")
    with pytest.raises(EvendpError, match="for world_size=3"):
        parse_batch_sizes("3,5", world_size=3)


def test_batch_sizes_from_env() -> None:
    env = {"EVENDP_BATCH_SIZES": "3,5"}
    assert batch_sizes_from_env(environ=env) == [3, 5]
    assert batch_sizes_from_env(2, environ=env) == [3, 5]
    with pytest.raises(EvendpError, match=r"EVENDP_BATCH_SIZES='3,5' is invalid: .*world_size=4"):
        batch_sizes_from_env(environ={**env, "WORLD_SIZE": "4"})
    with pytest.raises(EvendpError, match="EVENDP_BATCH_SIZES is not set; `evendp launch`"):
        batch_sizes_from_env(environ={})
    with pytest.raises(EvendpError, match=r"is invalid: .*'a' is not an int"):
        batch_sizes_from_env(environ={"EVENDP_BATCH_SIZES": "a,b"})
    assert batch_sizes_from_env(2, default=[1, 1], environ={}) == [1, 1]
    assert batch_sizes_from_env(environ={"MY_SIZES": "4"}, var="MY_SIZES") == [4]


def test_batch_sizes_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "2,0,6")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sizes = batch_sizes_from_env()
    assert len(list(UnevenBatchSampler(16, sizes, rank=2))) == 2


# --- empty batches through DataLoader ---------------------------------------------------------


def test_default_collate_fails_on_empty_and_empty_safe_collate_fixes_it() -> None:
    data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    sampler = UnevenBatchSampler(data, [4, 0], rank=1)
    with pytest.raises(IndexError):  # why EmptySafeCollate exists
        next(iter(DataLoader(data, batch_sampler=sampler)))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data))
    batches = list(loader)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == (0, 3) and x.dtype == torch.float32
        assert y.shape == (0,) and y.dtype == torch.int64


def test_dataloader_with_workers_covers_everything() -> None:
    data = TensorDataset(torch.arange(23))
    got = []
    for r, sizes in enumerate([[3, 0, 5]] * 3):
        sampler = UnevenBatchSampler(data, sizes, rank=r, seed=3)
        loader = DataLoader(
            data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data), num_workers=1
        )
        batches = [x.tolist() for (x,) in loader]
        assert len(batches) == len(sampler) == 3
        got += [i for b in batches for i in b]
    assert sorted(got) == list(range(23))


def test_empty_safe_collate_structures() -> None:
    Pair = namedtuple("Pair", ["x", "name"])
    data = [{"x": torch.ones(2, 5), "name": "a", "pair": Pair(torch.zeros(1), "b")}]
    empty = EmptySafeCollate(data)([])
    assert empty["x"].shape == (0, 2, 5)
    assert empty["name"] == []
    assert isinstance(empty["pair"], Pair) and empty["pair"].x.shape == (0, 1)
    assert empty["pair"].name == ()  # default_collate makes a tuple here
    full = EmptySafeCollate(data)([data[0], data[0]])
    assert full["x"].shape == (2, 2, 5)


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_in_step_matches_the_step_even_when_the_loader_samples_ahead(workers: int) -> None:
    data = TensorDataset(torch.arange(50))
    sizes, per_rank_lens, totals = [4, 0, 3], [], []
    for r in range(3):
        sampler = UnevenBatchSampler(data, sizes, rank=r, seed=1)
        loader = DataLoader(
            data, batch_sampler=sampler, collate_fn=EmptySafeCollate(data), num_workers=workers
        )
        lens, mine = [], []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            sampler.set_batch_sizes(sizes)
            for step, (x,) in enumerate(loader):
                if step == 1:
                    sampler.set_batch_sizes([1, 6, 2])  # reaches the loop later with workers
                lens.append(len(x))
                mine.append(sampler.samples_in_step(step))
        per_rank_lens.append(lens)
        totals.append(mine)
    assert totals[0] == totals[1] == totals[2]
    assert totals[0] == [sum(step) for step in zip(*per_rank_lens, strict=True)]
    assert sum(totals[0]) == 100  # two epochs, each sample once per epoch


def test_samples_in_step_rejects_steps_not_sampled() -> None:
    s = UnevenBatchSampler(10, [1, 3], rank=0)
    with pytest.raises(EvendpError, match="step 0 has not been sampled yet"):
        s.samples_in_step(0)
    list(s)
    assert s.samples_in_step(2) == 2  # still readable after the epoch's iterator is done
    with pytest.raises(EvendpError, match="step must be a non-negative int"):
        s.samples_in_step(-1)


def test_set_batch_sizes_refuses_a_drop_last_epoch_with_no_step() -> None:
    sampler = UnevenBatchSampler(3, [1], rank=0, drop_last=True)
    with pytest.raises(EvendpError, match="leaves no step"):
        sampler.set_batch_sizes([4])
    assert sampler.batch_sizes == [1]  # refused sizes change nothing


def test_a_sampler_writes_no_module_state() -> None:
    """Issue 52: the constructor wrote a process-wide set (the launcher's handshake), which
    broke test order once. Building, iterating and re-sizing a sampler now leaves every
    container of every evendp module as it was; the launcher's wrapper notes sizes through a
    hook of its own (tests/planning/test_launch.py)."""
    import sys

    def containers() -> dict[tuple[str, str], int]:
        return {
            (name, key): len(value)
            for name, module in list(sys.modules.items())
            if name.startswith("evendp")
            for key, value in vars(module).items()
            if isinstance(value, (set, dict, list)) and not key.startswith("__")
        }

    before = containers()
    sampler = UnevenBatchSampler(50, [7, 11, 13], rank=2, costs=[float(i % 9) for i in range(50)])
    list(sampler)
    sampler.set_epoch(1)
    sampler.set_batch_sizes([3, 5, 9])
    assert len(sampler) == 3 and len(list(sampler)) == 3
    assert containers() == before
