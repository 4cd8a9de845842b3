"""UnevenBatchSampler(costs=...): the same steps and samples, assigned to ranks by padded cost.

Ranks are emulated in one process: a sampler per rank, as every rank builds its own with no
communication, so a plan that differed between ranks would lose or repeat samples here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from evendp._core._cost import padded_cost
from evendp._core._errors import EvendpError
from evendp._distributed._group import ddp_loss
from evendp._distributed._sampler import UnevenBatchSampler
from tests._helpers import tiny_gpt2_config


def epoch(n: int, sizes: list[int], **kw: object) -> list[list[list[int]]]:
    """Per rank, the batches of one epoch, each rank from its own sampler."""
    return [
        list(UnevenBatchSampler(n, sizes, rank=r, **kw))  # type: ignore[arg-type]
        for r in range(len(sizes))
    ]


def step_bottleneck(costs: list[int], shares: list[list[int]], capacities: list[int]) -> float:
    return max(
        (
            padded_cost([costs[i] for i in s]) / c
            for s, c in zip(shares, capacities, strict=True)
            if s
        ),
        default=0.0,
    )


sizes_strategy = st.lists(st.integers(0, 8), min_size=1, max_size=4).filter(lambda s: sum(s) > 0)


@settings(max_examples=40, deadline=None)
@given(
    sizes=sizes_strategy,
    extra=st.integers(0, 50),
    seed=st.integers(0, 5),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_same_steps_same_samples_each_once_by_cost(
    sizes: list[int], extra: int, seed: int, drop_last: bool, data: st.DataObject
) -> None:
    n = max(len(sizes), sum(sizes) if drop_last else 0) + extra
    costs = data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    kw = {"seed": seed, "drop_last": drop_last}
    plain = epoch(n, sizes, **kw)
    by_cost = epoch(n, sizes, costs=costs, **kw)
    steps = len(plain[0])
    # Every rank runs the same number of steps, and len() says so.
    assert [len(batches) for batches in by_cost] == [steps] * len(sizes)
    assert len(UnevenBatchSampler(n, sizes, rank=0, costs=costs, **kw)) == steps  # type: ignore[arg-type]
    seen = [i for batches in by_cost for batch in batches for i in batch]
    assert len(seen) == len(set(seen))  # no sample twice, so every rank made the same plan
    if not drop_last:
        assert sorted(seen) == list(range(n))
    sampler = UnevenBatchSampler(n, sizes, rank=0, costs=costs, **kw)  # type: ignore[arg-type]
    for step, _ in enumerate(sampler):
        ours = [by_cost[r][step] for r in range(len(sizes))]
        theirs = [plain[r][step] for r in range(len(sizes))]
        # The step's global set (so the global batch and its gradient) is unchanged.
        assert sorted(i for b in ours for i in b) == sorted(i for b in theirs for i in b)
        assert sampler.sizes_in_step(step) == [len(b) for b in ours]
        assert sampler.samples_in_step(step) == sum(len(b) for b in theirs)
        assert all(
            not b for b, size in zip(ours, sizes, strict=True) if size == 0
        )  # zero size: nothing
        # Never a worse bottleneck than the sample-count split of the same step.
        assert step_bottleneck(costs, ours, sizes) <= step_bottleneck(costs, theirs, sizes) * (
            1 + 1e-9
        )


def test_long_samples_spread_by_capacity() -> None:
    # 32 samples a step, a quarter of them 8x longer; capacities 2:1:1.
    costs = [8 if i % 4 == 0 else 1 for i in range(128)]
    sizes = [16, 8, 8]
    per_rank = epoch(128, sizes, costs=costs, seed=3)
    plain = epoch(128, sizes, seed=3)
    for step in range(4):
        ours = [per_rank[r][step] for r in range(3)]
        theirs = [plain[r][step] for r in range(3)]
        assert step_bottleneck(costs, ours, sizes) < step_bottleneck(costs, theirs, sizes)
        loads = [padded_cost([costs[i] for i in b]) / c for b, c in zip(ours, sizes, strict=True)]
        assert max(loads) / (sum(padded_cost([costs[i] for i in b]) for b in ours) / 32) < 1.2


def test_costs_from_a_function_of_the_item_and_set_batch_sizes() -> None:
    texts = [torch.zeros(1 + (7 * i) % 13) for i in range(40)]
    by_fn = UnevenBatchSampler(texts, [4, 4], rank=1, costs=len, seed=1)
    by_list = UnevenBatchSampler(texts, [4, 4], rank=1, costs=[len(t) for t in texts], seed=1)
    assert list(by_fn) == list(by_list)
    assert by_fn.costs == [float(len(t)) for t in texts]
    # A re-split mid-epoch: capacities follow the new sizes, coverage stays exact.
    samplers = [UnevenBatchSampler(texts, [4, 4], rank=r, costs=len) for r in range(2)]
    iters = [iter(s) for s in samplers]
    seen = [i for it in iters for i in next(it)]
    for s in samplers:
        s.set_batch_sizes([6, 2])
    seen += [i for it in iters for batch in it for i in batch]
    assert sorted(seen) == list(range(40))
    assert len(samplers[0]) == 1 + math.ceil(32 / 8)


@pytest.mark.parametrize(
    ("data", "costs", "message"),
    [
        (4, [1, 2, 3], "costs has 3 values for 4 samples"),
        (4, len, "costs is a function of the dataset item, but data is 4"),
        ([[1], [2]], lambda item: -1, r"costs\(list\[i\]\) returned a bad value: cost -1"),
        (2, [1, "x"], "cost 'x' at position 1"),
    ],
)
def test_bad_costs_name_the_value(data: object, costs: object, message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        UnevenBatchSampler(data, [1, 1], rank=0, costs=costs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The exact gradient: a tiny GPT-2 on padded variable-length rows with -100 labels


def tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config()
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def token_sum_and_count(
    model: torch.nn.Module, rows: list[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """Summed next-token loss over the real tokens of ``rows``, right-padded to the longest."""
    if not rows:
        # HF GPT-2 cannot reshape an empty batch; a zero tied to every parameter is what an
        # empty DDP rank contributes (the Trainer's strategies stand in for it the same way).
        return sum(p.sum() for p in model.parameters()) * 0.0, 0  # type: ignore[return-value]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row)], mask[k, : len(row)] = row, 1
    labels = ids.masked_fill(mask == 0, -100)
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]  # the first token has no label
    total = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return total, int((shift_labels != -100).sum())


@settings(max_examples=5, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 4), min_size=2, max_size=3).filter(lambda s: sum(s) > 1),
    lengths=st.lists(st.integers(1, 20), min_size=12, max_size=12),
    seed=st.integers(0, 3),
)
def test_gradient_of_each_step_equals_one_device(
    sizes: list[int], lengths: list[int], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    model = tiny_gpt2()
    samplers = [
        UnevenBatchSampler(texts, sizes, rank=r, costs=len, seed=seed) for r in range(len(sizes))
    ]
    for step, shares in enumerate(zip(*samplers, strict=True)):
        # Emulated DDP: rank r backprops ddp_loss(sum_r, count_r, N) * (1/W) from its
        # world-size-W scale; here world_size() is 1 and we sum, which is the same average.
        model.zero_grad()
        counted = [token_sum_and_count(model, [texts[i] for i in share]) for share in shares]
        global_tokens = sum(c for _, c in counted)
        for local_sum, local_count in counted:
            ddp_loss(local_sum, local_count, global_tokens).backward()
        ranks_grad = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        everything = [texts[i] for share in shares for i in share]
        total, count = token_sum_and_count(model, everything)
        (total / count).backward()
        for ours, ref in zip(ranks_grad, [p.grad for p in model.parameters()], strict=True):
            assert ref is not None
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert samplers[0].samples_in_step(step) == len(everything)


@settings(max_examples=25, deadline=None)
@given(
    sizes=sizes_strategy,
    extra=st.integers(0, 60),
    group_steps=st.integers(1, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_group_steps_keeps_coverage_and_step_counts(
    sizes: list[int], extra: int, group_steps: int, shuffle: bool, data: st.DataObject
) -> None:
    n = len(sizes) + extra
    costs = data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    kw = {"costs": costs, "group_steps": group_steps, "shuffle": shuffle}
    per_rank = epoch(n, sizes, **kw)
    assert [len(b) for b in per_rank] == [math.ceil(n / sum(sizes))] * len(sizes)
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(n))


def test_group_steps_cuts_padding() -> None:
    costs = [1 + (37 * i) % 200 for i in range(480)]
    sizes = [16, 8, 8]

    def padding(group_steps: int) -> float:
        per_rank = epoch(480, sizes, costs=costs, group_steps=group_steps, seed=2)
        padded = sum(padded_cost([costs[i] for i in b]) for bs in per_rank for b in bs)
        return padded / sum(costs)

    assert padding(8) < 1.1 < padding(1)


def test_group_steps_needs_costs_and_a_positive_int() -> None:
    with pytest.raises(EvendpError, match="group_steps=4 groups samples by cost"):
        UnevenBatchSampler(10, [1, 1], rank=0, group_steps=4)
    with pytest.raises(EvendpError, match="group_steps must be a positive int"):
        UnevenBatchSampler(10, [1, 1], rank=0, costs=[1] * 10, group_steps=0)
