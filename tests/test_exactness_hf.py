"""A real Hugging Face GPT-2 with padded rows and ``labels=``: equal to one device.

The usual call ``model(input_ids, attention_mask=..., labels=...)`` returns the mean over the
non-ignored *shifted* labels (the causal shift drops label position 0). Weighting the
replicas by samples is then off (the issue measured 5e-4 on the loss and 0.16 on the
gradient); ``count_fn`` with the shift, or ``num_items_in_batch``, makes it exact.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evendp import BalancedDataParallel, count_tokens
from tests._helpers import requires_cuda, tiny_gpt2_config

transformers = pytest.importorskip("transformers")

LENGTHS = [12, 3, 7, 9, 12, 5, 1, 1]  # real tokens per row; the last two have no shifted label
EVEN = [12, 3, 7, 9, 12, 5, 2, 9]  # every share has labels
SEQ_LEN = 12


def hf_count(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The items GPT-2's loss is a mean over: labels that are not -100, after the shift."""
    return (kwargs["labels"][..., 1:] != -100).sum()


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    logging.getLogger("transformers").setLevel(logging.ERROR)  # config notes on a tiny vocab
    config = tiny_gpt2_config(use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def padded_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (len(lengths), SEQ_LEN), generator=generator)
    mask = (torch.arange(SEQ_LEN)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gradient_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """max over parameters of ||g - g_ref|| / ||g_ref||."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)))
    return worst


def one_device(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    reference = copy.deepcopy(model)
    loss = reference(**batch).loss
    loss.backward()
    return reference, loss


def test_gpt2_labels_with_the_hf_count_fn_equal_one_device(gpt2: torch.nn.Module) -> None:
    model = copy.deepcopy(gpt2)
    batch = padded_batch(EVEN)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, weights=[2, 1, 1], count_fn=hf_count)
    out = wrapped(**batch)
    out.loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert wrapped.last_sizes == [4, 2, 2]
    assert out.logits.shape == (8, SEQ_LEN, 64)
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5


def test_gpt2_weighted_by_samples_is_not_exact(gpt2: torch.nn.Module) -> None:
    model = copy.deepcopy(gpt2)
    batch = padded_batch(EVEN)
    rows = BalancedDataParallel(
        model, ["cpu"] * 3, weights=[2, 1, 1], count_fn=lambda **kw: kw["labels"].shape[0]
    )
    out = rows(**batch)
    out.loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert abs(out.loss.item() - ref_loss.item()) > 1e-4
    assert gradient_error(model, reference) > 1e-2


def test_gpt2_without_count_fn_counts_its_shifted_labels_and_is_exact(
    gpt2: torch.nn.Module,
) -> None:
    """The first-day call: no count_fn. GPT2LMHeadModel is a causal LM: shifted labels."""
    model = copy.deepcopy(gpt2)
    batch = padded_batch(EVEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact by itself: nothing to warn about
        out = BalancedDataParallel(model, ["cpu"] * 3, weights=[2, 1, 1])(**batch)
    out.loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5


def test_gpt2_count_tokens_matches_the_hand_written_count(gpt2: torch.nn.Module) -> None:
    batch = padded_batch(LENGTHS)
    assert int(count_tokens(shift=True)(**batch)) == int(hf_count(**batch))
    model = copy.deepcopy(gpt2)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, count_fn=count_tokens(shift=True))
    with wrapped.fixed_sizes([4, 2, 2]):  # device 2: no label after the shift
        wrapped(**batch).loss.backward()
    reference, _ = one_device(gpt2, batch)
    assert gradient_error(model, reference) <= 1e-5


class _OwnLM(torch.nn.Module):
    """Not a Hugging Face class: evendp cannot tell whether its loss shifts the labels."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.inner(**batch).loss


def test_an_unknown_model_with_ignored_labels_warns_once_naming_count_fn(
    gpt2: torch.nn.Module,
) -> None:
    wrapped = BalancedDataParallel(_OwnLM(copy.deepcopy(gpt2)), ["cpu"] * 3, weights=[2, 1, 1])
    with pytest.warns(UserWarning, match=r"count_fn=evendp.count_tokens\(shift=True\)"):
        wrapped(**padded_batch(EVEN))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(**padded_batch(EVEN))  # once
    counted = BalancedDataParallel(
        _OwnLM(copy.deepcopy(gpt2)), ["cpu"] * 3, count_fn=count_tokens(shift=True)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counted(**padded_batch(EVEN))  # told: no warning


def test_gpt2_share_with_no_label_adds_nothing_and_no_nan(gpt2: torch.nn.Module) -> None:
    model = copy.deepcopy(gpt2)
    batch = padded_batch(LENGTHS)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, count_fn=hf_count)
    with wrapped.fixed_sizes([4, 2, 2]):  # device 2 gets the two one-token rows: no label
        out = wrapped(**batch)
    alone = copy.deepcopy(gpt2)(**{k: v[6:] for k, v in batch.items()}).loss
    assert torch.isnan(alone)  # what that share's replica returns on its own
    out.loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5


def test_gpt2_num_items_in_batch_summed_per_device_equals_one_device(
    gpt2: torch.nn.Module,
) -> None:
    model = copy.deepcopy(gpt2)
    batch = padded_batch(LENGTHS)
    items = hf_count(**batch)  # the global count, passed whole to every replica
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, weights=[2, 1, 1], gather_output=False)
    parts = wrapped(**batch, num_items_in_batch=items)
    loss = sum(part.loss.to(parts.output_device) for part in parts.outputs)  # sums / count
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5


@requires_cuda
@pytest.mark.gpu
def test_gpt2_on_cuda_virtual_devices_with_the_hf_count_fn(gpt2: torch.nn.Module) -> None:
    model = copy.deepcopy(gpt2).cuda()
    batch = {k: v.cuda() for k, v in padded_batch(LENGTHS).items()}
    wrapped = BalancedDataParallel(model, ["cuda:0"] * 3, count_fn=hf_count)
    with wrapped.fixed_sizes([4, 2, 2]):
        out = wrapped(**batch)
    out.loss.backward()
    reference, ref_loss = one_device(copy.deepcopy(gpt2).cuda(), batch)
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, SEQ_LEN), min_size=1, max_size=7),
    cuts=st.lists(st.integers(0, 7), min_size=2, max_size=2),
)
def test_gpt2_without_count_fn_is_exact_on_any_split_with_zeros(
    gpt2: torch.nn.Module, lengths: list[int], cuts: list[int]
) -> None:
    """Property: any lengths (1 = no label after the shift), any split, empty shares too."""
    n = len(lengths)
    a, b = sorted(min(c, n) for c in cuts)
    sizes = [a, b - a, n - b]
    batch = padded_batch(lengths)
    if int(hf_count(**batch)) == 0:
        return  # no label anywhere: one device's mean is NaN too, nothing to compare
    model = copy.deepcopy(gpt2)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3)
    with wrapped.fixed_sizes(sizes):
        out = wrapped(**batch)
    out.loss.backward()
    reference, ref_loss = one_device(gpt2, batch)
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert gradient_error(model, reference) <= 1e-5
