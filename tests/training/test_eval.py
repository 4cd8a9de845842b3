"""Validation in the Trainer, one process: the eval loss (and a user metric given as sum and
count) over 101 samples on three uneven virtual devices equals one device's over all 101.

The same checks on three gloo ranks (and the padded ``DistributedSampler`` they must beat)
run in tests/training/test_eval_gloo.py; the shared workload lives here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from evendp import EvendpError, TrainConfig, Trainer
from evendp._training._evaluate import EvalRun, evaluate_devices, loss_eval_fn
from evendp._training._report import write_report

IGNORE = -100
N_EVAL = 101


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=1, eos_token_id=1, loss_type="ForCausalLM")  # fmt: skip
    return GPT2LMHeadModel(config)


def lm_samples(n: int, length: int = 10, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded token windows of random lengths; padded labels are ``-100``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        used = int(torch.randint(2, length + 1, (), generator=g))
        ids = torch.zeros(length, dtype=torch.long)
        ids[:used] = torch.randint(1, 64, (used,), generator=g)
        labels = torch.full((length,), IGNORE)
        labels[:used] = ids[:used]
        out.append((ids, labels))
    return out


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss  # mean over non-ignored (shifted) tokens


def lm_count(batch: Any) -> torch.Tensor:
    """The items ``lm_loss`` averages over: non-ignored labels after the causal shift."""
    return (batch[1][:, 1:] != IGNORE).sum()


def lm_metrics(model: nn.Module, batch: Any) -> dict[str, tuple[Any, Any]]:
    """Token-weighted loss and next-token accuracy, each as (sum, count)."""
    ids, labels = batch
    logits = model(input_ids=ids).logits[:, :-1]
    target = labels[:, 1:]  # the causal shift: the first position has no label
    mask = target != IGNORE
    count = mask.sum()
    ce = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE,
        reduction="sum",
    )  # fmt: skip
    correct = ((logits.argmax(-1) == target) & mask).sum()
    return {"loss": (ce, count), "accuracy": (correct, count)}


def one_device(model: nn.Module, samples: list[Any]) -> dict[str, float]:
    """The reference: the whole set in one forward on one device."""
    ids, labels = torch.utils.data.default_collate(samples)
    model.eval()
    with torch.no_grad():
        s = {k: (float(a), float(b)) for k, (a, b) in lm_metrics(model, (ids, labels)).items()}
        mean_loss = float(lm_loss(model, (ids, labels)))
    assert s["loss"][0] / s["loss"][1] == pytest.approx(mean_loss, rel=1e-6)
    return {k: a / b for k, (a, b) in s.items()}


@pytest.mark.parametrize("user_metrics", [True, False], ids=["eval_fn", "default"])
def test_eval_over_uneven_virtual_devices_equals_one_device(
    tmp_path: Path, user_metrics: bool
) -> None:
    model = tiny_gpt2()
    train, val = lm_samples(64, seed=1), lm_samples(N_EVAL, seed=2)
    cfg = TrainConfig(steps=2, batch_size=8, lr=1e-3, eval_every=1, progress=False)
    # Default eval_fn: loss_fn's mean x count_fn's count (tokens), as training weights it.
    eval_fn = lm_metrics if user_metrics else None
    trainer = Trainer(model, train, cfg, device_ids=["cpu"] * 3, weights=[2, 1, 1],
                      loss_fn=lm_loss, count_fn=lm_count, eval_data=val,
                      eval_fn=eval_fn)  # fmt: skip
    report = trainer.fit()
    assert [e["step"] for e in report.eval] == [1, 2]
    assert model.training  # the Trainer's mode is given back after each evaluation
    expected = one_device(model, val)  # the final weights: the step-2 evaluation's
    got = report.eval[-1]["metrics"]
    if not user_metrics:
        del expected["accuracy"]
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-6)
    # The report carries it: JSON key "eval", the summary line, a curve on the PNG.
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["eval"][-1]["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert "validation at step 2" in (tmp_path / "report.txt").read_text()
    assert (tmp_path / "report.png").stat().st_size > 0


def ragged_samples(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`lm_samples` unpadded: token windows of 2 to 10 tokens, which need a collate_fn."""
    return [(ids[labels != IGNORE], labels[labels != IGNORE]) for ids, labels in
            lm_samples(n, seed=seed)]  # fmt: skip


def pad(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a ragged batch: ids with 0, labels with -100 (a causal LM's left context and
    absolute positions are unchanged, so each token's loss is the one unpadded)."""
    ids = nn.utils.rnn.pad_sequence([i for i, _ in samples], batch_first=True)
    labels = nn.utils.rnn.pad_sequence([y for _, y in samples], batch_first=True,
                                       padding_value=IGNORE)  # fmt: skip
    return ids, labels


def test_eval_data_is_collated_with_the_users_collate_fn() -> None:
    """Ragged samples that train only through collate_fn= evaluate through it too (before the
    fix, evaluation stacked them with default_collate and fit() failed at the first eval)."""
    model = tiny_gpt2()
    train, val = ragged_samples(48, seed=1), ragged_samples(N_EVAL, seed=2)
    cfg = TrainConfig(steps=2, batch_size=8, lr=1e-3, eval_every=1, progress=False)
    trainer = Trainer(model, train, cfg, device_ids=["cpu"] * 2, weights=[3, 1], loss_fn=lm_loss,
                      count_fn=lm_count, collate_fn=pad, eval_data=val)  # fmt: skip
    report = trainer.fit()
    expected = one_device(model, lm_samples(N_EVAL, seed=2))["loss"]  # padded to 10 at once
    assert [e["step"] for e in report.eval] == [1, 2]
    assert report.eval[-1]["metrics"]["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_mean_of_batch_means_would_be_caught() -> None:
    # Averaging each batch's (or device's) mean, the usual shortcut, weights the short last
    # batch and the short sequences wrongly: it differs, so the check above can fail.
    model, val = tiny_gpt2(), lm_samples(N_EVAL, seed=2)
    expected = one_device(model, val)["loss"]
    with torch.no_grad():
        means = [
            float(lm_loss(model, torch.utils.data.default_collate(val[i : i + 8])))
            for i in range(0, N_EVAL, 8)
        ]
    assert abs(sum(means) / len(means) - expected) > 1e-4 * expected


@pytest.mark.parametrize("weights", [[2, 1, 1], [0, 3, 1], [1, 0, 0]])
def test_default_eval_fn_weights_the_loss_by_samples(weights: list[int]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).eval()
    x, y = torch.randn(N_EVAL, 4), torch.randn(N_EVAL, 1)

    def mse(model: nn.Module, batch: Any) -> torch.Tensor:
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    run = EvalRun(
        net, list(zip(x, y, strict=True)), loss_eval_fn(mse), [8], lambda idx: (x[idx], y[idx])
    )
    got = evaluate_devices(run, device_ids=["cpu"] * 3, weights=weights)
    with torch.no_grad():
        assert got["loss"] == pytest.approx(float(mse(net, (x, y))), rel=1e-6)


def test_bad_eval_settings_are_named() -> None:
    with pytest.raises(EvendpError, match="eval_every"):
        TrainConfig(eval_every=-1)
    net = nn.Linear(2, 1)
    data = [(torch.randn(2), torch.randn(1)) for _ in range(5)]
    collate = torch.utils.data.default_collate
    for bad, match in (
        (lambda m, b: m(b[0]).mean(), "must return"),
        (lambda m, b: {"loss": m(b[0]).mean()}, r"\(sum, count\) pair"),
    ):
        with pytest.raises(EvendpError, match=match):
            run = EvalRun(net, data, bad, [2], lambda idx: collate([data[i] for i in idx]))
            evaluate_devices(run, device_ids=["cpu"], weights=None)
