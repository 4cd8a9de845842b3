"""An empty share in every one-process path: real GPT-2 and BERT, padding and -100 labels.

A device whose share has no rows (weight 0) and a device whose rows count no label both add
exactly nothing: the gradient through BalancedDataParallel, ParallelCriterion and the Trainer
equals one device's on the whole batch (rel 1e-5). The ranks' side (DDP, FSDP2) is in
tests/training/test_strategy.py's shared gloo spawn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from evendp import BalancedDataParallel, ParallelCriterion, TrainConfig, Trainer
from tests._helpers import tiny_gpt2_config

transformers = pytest.importorskip("transformers")

N, L, VOCAB = 6, 8, 64
# Rows 2-3 (device 1's share under SIZES) have every label ignored; device 2 gets no rows.
SIZES = [2, 2, 0, 2]
DEVICES = ["cpu"] * 4


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (N, L), generator=g)
    lengths = torch.tensor([8, 5, 3, 6, 2, 7])
    mask = (torch.arange(L) < lengths[:, None]).long()  # (N, L), right padding
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    labels[2:4] = -100  # a share with rows but no counted label
    return ids, mask, labels


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config())


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=VOCAB,
    )  # fmt: skip
    return transformers.BertForTokenClassification(config)


MODELS = {"gpt2": _gpt2, "bert": _bert}
# GPT-2 shifts its labels (position 0 predicts nothing); BERT tags every position.
SHIFT = {"gpt2": 1, "bert": 0}


def _count(name: str, labels: torch.Tensor) -> torch.Tensor:
    return (labels[..., SHIFT[name] :] != -100).sum()


def _grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flat (zeros where none reached it)."""
    return torch.cat(
        [
            (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
            for p in model.parameters()
        ]
    )


def _one_device(name: str) -> torch.Tensor:
    model = MODELS[name]()
    ids, mask, labels = _batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return _grads(model)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm())


class _HFLoss(nn.Module):
    """``model(...).loss`` as a module BalancedDataParallel splits: batch in, mean loss out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


@pytest.mark.parametrize("name", MODELS)
def test_balanced_data_parallel_with_an_empty_share_equals_one_device(name: str) -> None:
    model = MODELS[name]()
    dp = BalancedDataParallel(
        _HFLoss(model), DEVICES, count_fn=lambda ids, mask, labels: _count(name, labels)
    )
    with dp.fixed_sizes(SIZES):
        loss = dp(*_batch())
    loss.backward()
    assert dp.last_sizes == SIZES
    assert _rel(_grads(model), _one_device(name)) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_parallel_criterion_with_an_empty_share_equals_one_device(name: str) -> None:
    model = MODELS[name]()
    shift = SHIFT[name]

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, attention_mask=mask).logits  # type: ignore[no-any-return]

    def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = logits[:, : logits.shape[1] - shift], labels[:, shift:]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    ids, mask, labels = _batch()
    dp = BalancedDataParallel(Logits(), DEVICES, gather_output=False)
    criterion = ParallelCriterion(token_loss, count_fn=lambda out, y: _count(name, y))
    with dp.fixed_sizes(SIZES):
        loss = criterion(dp(ids, mask), labels)
    loss.backward()
    assert _rel(_grads(model), _one_device(name)) <= 1e-5


class _Rows(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return tuple(t[i] for t in _batch())

    def batch(self, indices: list[int]) -> Any:
        return tuple(t[sorted(indices)] for t in _batch())  # the batch's own row order


@pytest.mark.parametrize("name", MODELS)
def test_trainer_with_an_empty_share_steps_by_one_devices_gradient(name: str) -> None:
    model = MODELS[name]()
    before = [p.detach().clone() for p in model.parameters()]
    lr = 1.0  # SGD with lr 1: the update is minus the step's gradient

    def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        ids, mask, labels = batch
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # type: ignore[no-any-return]

    cfg = TrainConfig(steps=1, batch_size=N, lr=lr, grad_clip=None, progress=False)
    trainer = Trainer(
        model, _Rows(), cfg, device_ids=DEVICES, weights=[2, 2, 0, 2], loss_fn=hf_loss,
        count_fn=lambda b: _count(name, b[2]),
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
    )  # fmt: skip
    report = trainer.fit()
    assert [d.samples_per_step for d in report.devices] == [2.0, 2.0, 0.0, 2.0]
    update = torch.cat(
        [(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)]
    )
    assert _rel(update, _one_device(name)) <= 1e-5
