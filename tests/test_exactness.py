"""Count-weighted exactness: any split of a batch gives one device's loss and gradients.

The rule (docs/exactness.md): a loss is a mean over counted items, and the step's loss is the
sum over all items divided by their global count, whatever the split. Here the items are
unmasked tokens, some sequences and some whole shares have none, and the split is random
(zeros included) over 1-4 virtual devices, through ``BalancedDataParallel`` (loss computed in
``forward``, ``count_fn``) and through ``ParallelCriterion`` (``gather_output=False``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from evendp import BalancedDataParallel, ParallelCriterion

VOCAB, WIDTH = 9, 8


class TokenModel(nn.Module):
    """Embedding -> tanh MLP -> logits (B, T, VOCAB); optionally its own masked mean loss."""

    def __init__(self, loss_in_forward: bool, masked_by: str = "mask") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.loss_in_forward = loss_in_forward
        self.masked_by = masked_by

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.hidden(self.embed(idx))))
        if not self.loss_in_forward:
            return logits
        assert targets is not None and mask is not None
        return token_loss(logits, targets, mask, self.masked_by)


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, masked_by: str = "mask"
) -> torch.Tensor:
    """The mean over unmasked tokens, written the two usual ways.

    ``"ignore_index"``: cross-entropy's own mean over targets not equal to -100 (NaN, in
    forward, when there is none); ``"mask"``: a masked sum over ``mask.sum()`` (NaN in forward
    and backward when there is none).
    """
    if masked_by == "ignore_index":
        labels = targets.masked_fill(mask == 0, -100)
        return nn.functional.cross_entropy(logits.transpose(1, 2), labels)
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (per_token * mask).sum() / mask.sum()


def count_tokens(*args: torch.Tensor) -> torch.Tensor:
    """The count of either signature: forward's (idx, targets, mask), the criterion's
    (logits, targets, mask): unmasked tokens."""
    return args[-1].sum()


@dataclass
class Case:
    sizes: list[int]  # per device, zeros allowed
    lengths: list[int]  # unmasked tokens per sequence, 0 = fully masked
    seq_len: int
    seed: int

    @property
    def batch(self) -> int:
        return sum(self.sizes)

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        idx = torch.randint(0, VOCAB, (self.batch, self.seq_len), generator=generator)
        targets = torch.randint(0, VOCAB, (self.batch, self.seq_len), generator=generator)
        positions = torch.arange(self.seq_len)[None, :]
        mask = (positions < torch.tensor(self.lengths)[:, None]).float()
        return idx, targets, mask


@st.composite
def cases(draw: st.DrawFn) -> Case:
    devices = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 4), min_size=devices, max_size=devices))
    if sum(sizes) == 0:
        sizes[draw(st.integers(0, devices - 1))] = draw(st.integers(1, 4))
    seq_len = draw(st.integers(1, 5))
    # Fully masked and full sequences are likely, so whole shares often have no token.
    length = st.sampled_from([0, 0, seq_len]) | st.integers(0, seq_len)
    lengths = draw(st.lists(length, min_size=sum(sizes), max_size=sum(sizes)))
    return Case(sizes, lengths, seq_len, draw(st.integers(0, 2**16)))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@dataclass(frozen=True)
class Run:
    """One way through evendp: the loss inside ``forward``, or ``ParallelCriterion``."""

    loss_in_forward: bool
    masked_by: str  # "mask" or "ignore_index", see token_loss
    count_fn: Callable[..., torch.Tensor] | None = count_tokens  # None: weight by samples

    def by_samples(self) -> Run:
        return Run(self.loss_in_forward, self.masked_by, count_fn=None)

    def model(self) -> TokenModel:
        return TokenModel(loss_in_forward=True, masked_by=self.masked_by)

    def __call__(self, model: TokenModel, case: Case) -> torch.Tensor:
        devices = ["cpu"] * len(case.sizes)
        idx, targets, mask = case.data()
        if self.loss_in_forward:
            wrapped = BalancedDataParallel(model, devices, count_fn=self.count_fn)
            with wrapped.fixed_sizes(case.sizes):
                loss: torch.Tensor = wrapped(idx, targets, mask)
            return loss
        model.loss_in_forward = False  # logits out; the loss is computed per device
        wrapped = BalancedDataParallel(model, devices, gather_output=False)
        with wrapped.fixed_sizes(case.sizes):
            parts = wrapped(idx)
        masked_by = self.masked_by
        criterion = ParallelCriterion(
            lambda logits, y, m: token_loss(logits, y, m, masked_by), count_fn=self.count_fn
        )
        return criterion(parts, targets, mask)


def check_exact(run: Run, case: Case) -> None:
    """Loss and every gradient of ``run`` equal one device's sum over tokens / global count."""
    torch.manual_seed(case.seed)
    model = run.model()
    reference = copy.deepcopy(model)

    loss = run(model, case)
    loss.backward()
    idx, targets, mask = case.data()
    count = mask.sum()
    reference.loss_in_forward = False
    per_token = nn.functional.cross_entropy(
        reference(idx).transpose(1, 2), targets, reduction="none"
    )
    ref_loss = (per_token * mask).sum() / count.clamp_min(1)  # sum / global count (0 if none)
    ref_loss.backward()

    assert torch.isfinite(loss), f"loss {loss.item()} for {case}"
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(abs(ref_loss.item()), 1e-6), case
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if count == 0:  # no item anywhere: nothing contributes, and no NaN either
            assert p.grad is None or (p.grad == 0).all(), name
            continue
        assert p.grad is not None and q.grad is not None, name
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {case}"
        assert relative_error(p.grad, q.grad) <= 1e-5, f"{name} for {case}"


RUNS = {
    f"{where}/{masked_by}": Run(where == "loss_in_forward", masked_by)
    for where in ("loss_in_forward", "criterion")
    for masked_by in ("mask", "ignore_index")
}


@pytest.mark.parametrize("how", sorted(RUNS))
@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_any_split_and_masking_gives_one_devices_loss_and_gradients(how: str, case: Case) -> None:
    check_exact(RUNS[how], case)


# One split where shares hold different numbers of tokens per sample, and one share none.
UNEVEN = Case(sizes=[2, 1, 0, 2], lengths=[5, 4, 1, 0, 0], seq_len=5, seed=3)


@pytest.mark.parametrize("how", sorted(RUNS))
def test_weighting_the_same_data_by_samples_fails_the_same_check(how: str) -> None:
    check_exact(RUNS[how], UNEVEN)  # passes with the token count ...
    with pytest.raises(AssertionError):  # ... and fails when the shares are weighted by samples
        check_exact(RUNS[how].by_samples(), UNEVEN)


def test_weighting_by_samples_is_off_by_more_than_the_tolerance() -> None:
    case = Case(sizes=[2, 1], lengths=[5, 5, 1], seq_len=5, seed=4)  # no empty share: no NaN
    run = RUNS["loss_in_forward/mask"]
    torch.manual_seed(case.seed)
    model = run.model()
    assert abs(run(model, case).item() - run.by_samples()(model, case).item()) > 1e-3


# ---------------------------------------------------------------- the seeds' example


class PerSampleMean(nn.Module):
    def forward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        return per_sample_loss.mean()


def test_the_seed_example_gives_0_4333_not_the_mean_of_means_0_525() -> None:
    losses = torch.tensor([0.3, 0.2, 0.8])
    wrapped = BalancedDataParallel(PerSampleMean(), ["cpu", "cpu"], weights=[2, 1])
    parts = BalancedDataParallel(
        PerSampleMean(), ["cpu", "cpu"], weights=[2, 1], gather_output=False
    )(losses)
    mean_of_means = sum(o.item() for o in parts.outputs) / len(parts.outputs)
    assert mean_of_means == pytest.approx(0.525)  # DataParallelCriterion's answer
    assert wrapped(losses).item() == pytest.approx(0.4333333, abs=1e-6)
    counted = BalancedDataParallel(
        PerSampleMean(), ["cpu", "cpu"], weights=[2, 1], count_fn=lambda t: t.numel()
    )
    assert counted(losses).item() == pytest.approx(0.4333333, abs=1e-6)


# ---------------------------------------------------------------- a per-pixel loss


def test_a_per_pixel_segmentation_loss_with_ignored_pixels_is_exact() -> None:
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 4, 1))
    reference = copy.deepcopy(net)
    images = torch.randn(5, 3, 6, 6)
    targets = torch.randint(0, 4, (5, 6, 6))
    targets[1] = 255  # an image with no labelled pixel (its share: only it)
    targets[3, :4] = 255  # partly labelled
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    wrapped = BalancedDataParallel(net, ["cpu"] * 3, gather_output=False)
    with wrapped.fixed_sizes([1, 1, 3]):
        parts = wrapped(images)
    loss = ParallelCriterion(criterion)(parts, targets)  # counts labelled pixels itself
    loss.backward()
    ref_loss = criterion(reference(images), targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert relative_error(p.grad, q.grad) <= 1e-5
