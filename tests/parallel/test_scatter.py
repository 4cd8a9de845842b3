"""Scattering nested inputs by sizes and gathering outputs back."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evendp import EvendpError
from evendp._parallel._scatter import gather_outputs, map_tensors, row_count, scatter

CPU = torch.device("cpu")


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


@dataclass(frozen=True)
class Sample:
    x: torch.Tensor
    weight: float = 1.0
    cache: list[int] = field(default_factory=list, init=False)


def test_containers_keep_their_types() -> None:
    obj = (
        [torch.zeros(4)],
        OrderedDict(a=torch.zeros(4, 2)),
        Pair(torch.zeros(4), "p"),
        Sample(torch.zeros(4)),
    )
    rebuilt = map_tensors(obj, lambda t: t + 1)
    assert isinstance(rebuilt[0], list)
    assert isinstance(rebuilt[1], OrderedDict)
    assert isinstance(rebuilt[2], Pair) and rebuilt[2].label == "p"
    assert isinstance(rebuilt[3], Sample) and rebuilt[3].weight == 1.0
    assert float(rebuilt[3].x.sum()) == 4.0


@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_scatter_then_gather_is_the_identity(sizes: list[int]) -> None:
    total = sum(sizes)
    x = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    parts = scatter({"x": x, "k": 7}, sizes, [CPU] * len(sizes))
    assert [p["x"].shape[0] for p in parts] == sizes
    assert all(p["k"] == 7 for p in parts)
    active = [i for i, n in enumerate(sizes) if n > 0] or [0]
    outs = [parts[i]["x"] for i in active]
    joined = gather_outputs(outs, [sizes[i] for i in active], CPU)
    torch.testing.assert_close(joined, x)


def test_scatter_along_dim_one_and_non_batch_tensors_go_whole() -> None:
    seq = torch.arange(12).reshape(2, 6)  # (T=2, B=6), batch on dim 1
    scale = torch.tensor(3.0)  # 0-dim: not a batch tensor
    parts = scatter((seq, scale), [4, 2], [CPU, CPU], dim=1)
    assert parts[0][0].shape == (2, 4) and parts[1][0].shape == (2, 2)
    assert parts[1][1] is scale


def test_batch_size_names_the_disagreeing_shapes() -> None:
    assert row_count(("no tensors", 3)) is None
    with pytest.raises(EvendpError, match=r"\[3, 2\].*\[4\]"):
        row_count((torch.zeros(3, 2), torch.zeros(4)))


def test_gather_weights_float_scalars_and_sums_counts() -> None:
    means = [torch.tensor(0.25), torch.tensor(0.8)]  # means of [0.3, 0.2] and [0.8]
    assert gather_outputs(means, [2, 1], CPU).item() == pytest.approx(0.4333333)
    counts = [torch.tensor(2), torch.tensor(5)]
    assert gather_outputs(counts, [2, 1], CPU).item() == 7


def test_gather_of_plain_values_keeps_agreement_or_lists_them() -> None:
    assert gather_outputs(["a", "a"], [1, 1], CPU) == "a"
    assert gather_outputs(["a", "b"], [1, 1], CPU) == ["a", "b"]
    assert gather_outputs([None, None], [1, 1], CPU) is None


def test_gradients_flow_back_through_scatter_and_gather() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    parts = scatter(x, [2, 3], [CPU, CPU])
    gather_outputs([p * 2 for p in parts], [2, 3], CPU).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full((5, 3), 2.0))


def test_gather_weights_float_scalars_by_counts_and_leaves_out_empty_shares() -> None:
    # Token means 0.5 over 4 tokens and 2.0 over 1 token: the mean over all 5 tokens is 0.8,
    # whatever the samples were (weighting by samples [1, 1] would give 1.25).
    means = [torch.tensor(0.5), torch.tensor(2.0)]
    assert gather_outputs(means, [1, 1], CPU, counts=[4, 1]).item() == pytest.approx(0.8)
    assert gather_outputs(means, [1, 1], CPU).item() == pytest.approx(1.25)
    nan = torch.tensor(float("nan"))  # a mean over no tokens
    assert gather_outputs([means[0], nan], [1, 1], CPU, counts=[4, 0]).item() == 0.5


def test_gather_with_no_counted_item_anywhere_is_a_zero_that_backward_accepts() -> None:
    w = torch.ones((), requires_grad=True)
    nan_means = [w * float("nan"), w * float("nan")]
    loss = gather_outputs(nan_means, [2, 1], CPU, counts=[0, 0])
    assert loss.item() == 0.0
    loss.backward()  # runs; nothing flows into w (no NaN either)
    assert w.grad is None
    one = gather_outputs([w * float("nan")], [2], CPU, counts=[0])
    assert one.item() == 0.0


def test_a_left_out_share_sends_no_nan_into_the_gradient() -> None:
    w = torch.ones(3, requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0])
    # A masked mean over an all-masked share: NaN forward and NaN backward (0 / 0).
    kept = (w[:2] * mask[:2]).sum() / mask[:2].sum()
    empty = (w[2:] * mask[2:]).sum() / mask[2:].sum()
    gather_outputs([kept, empty], [2, 1], CPU, counts=[2, 0]).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, torch.tensor([0.5, 0.5, 0.0]))


def test_per_row_lists_are_cut_with_their_rows_and_other_values_go_whole() -> None:
    batch = {
        "x": torch.arange(5)[:, None],
        "text": [f"t{i}" for i in range(5)],  # one per row: cut
        "ids": [[i, i] for i in range(5)],  # nested, no tensor: one per row, cut
        "pair": ("a", "b", "c", "d", "e"),  # a tuple: whole, whatever its length
        "tags": ["p", "q"],  # another length: whole
        "mixed": [torch.tensor(1.0)] * 5,  # holds tensors: a container, not a per-row list
    }
    parts = scatter(batch, [2, 0, 3], [torch.device("cpu")] * 3)
    assert [p["text"] for p in parts] == [["t0", "t1"], [], ["t2", "t3", "t4"]]
    assert parts[2]["ids"] == [[2, 2], [3, 3], [4, 4]]
    assert all(p["pair"] == batch["pair"] and p["tags"] == ["p", "q"] for p in parts)
    assert all(len(p["mixed"]) == 5 for p in parts)
    joined = gather_outputs([p["text"] for p in parts if p["text"]], [2, 3], torch.device("cpu"))
    assert joined == batch["text"]
