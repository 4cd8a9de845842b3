"""Evaluation and prediction on three uneven gloo ranks ([1, 4, 2]), spawned once.

- The Trainer's eval loss and accuracy (sum, count) over 101 samples, under DDP and FSDP2,
  equal one device's over all 101; a plain ``DistributedSampler`` (which pads with duplicate
  samples to even out the ranks) gives a different value, so the check can fail.
- Training (issue 10): the first step's gradient of the token-mean loss of a real GPT-2 with
  padding and ``-100`` labels, under 3-rank DDP and FSDP2 with uneven sizes, equals one
  device's on the step's global batch.
- The same step with dict samples, the default loss and no ``count_fn`` (issue 27): the
  model's class says its labels are counted shifted, on every rank alike.
- ``predict`` over 53 padded samples: each rank's rows, gathered and put in index order,
  equal one device's features.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from evendp import TrainConfig, Trainer, UnevenBatchSampler, predict
from evendp._distributed._group import finish_distributed
from tests._helpers import run_ranks
from tests.parallel.test_predict import one_device_features, padded_samples, tiny_bert
from tests.training.test_eval import (
    N_EVAL,
    lm_count,
    lm_loss,
    lm_metrics,
    lm_samples,
    one_device,
    tiny_gpt2,
)

pytestmark = pytest.mark.multiprocess

WORLD = 3
SIZES = [1, 4, 2]


def _padded_sampler_metrics(model: Any, val: list[Any], rank: int) -> dict[str, float]:
    """What a loop over ``DistributedSampler`` computes: 101 padded to 102, one sample twice."""
    sampler = DistributedSampler(val, num_replicas=WORLD, rank=rank, shuffle=False)
    sums = torch.zeros(4, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for batch in DataLoader(val, batch_size=4, sampler=sampler):
            m = lm_metrics(model, tuple(batch))
            sums += torch.tensor([float(v) for pair in m.values() for v in pair])
    dist.all_reduce(sums)
    return {"loss": float(sums[0] / sums[1]), "accuracy": float(sums[2] / sums[3])}


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    # Dropout draws different masks on every rank than on one device: off for exactness.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _one_device_grads(train: list[Any]) -> dict[str, torch.Tensor]:
    """The reference: the token-mean loss of step 0's global batch on one device."""
    step0 = [
        i
        for r in range(WORLD)
        for i in next(iter(UnevenBatchSampler(train, SIZES, rank=r, world_size=WORLD)))
    ]
    ref = _no_dropout(tiny_gpt2())
    ids, labels = torch.utils.data.default_collate([train[i] for i in step0])
    lm_loss(ref, (ids, labels)).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    full = {}
    for n, p in model.named_parameters():
        if p.grad is not None:  # FSDP2: a sharded DTensor, gathered here for the check only
            g = p.grad
            full[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    return full


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    try:
        train, val = lm_samples(24, seed=1), lm_samples(N_EVAL, seed=2)
        for strategy in ("ddp", "fsdp2"):
            model = _no_dropout(tiny_gpt2())
            cfg = TrainConfig(
                steps=1, batch_sizes=SIZES, strategy=strategy, grad_clip=None, progress=False
            )
            # DDP: the user's metrics; FSDP2: the default eval_fn (the loss, token-counted).
            eval_fn = lm_metrics if strategy == "ddp" else None
            report = Trainer(model, train, cfg, loss_fn=lm_loss, count_fn=lm_count,
                             eval_data=val, eval_fn=eval_fn).fit()  # fmt: skip
            results[strategy] = {"eval": report.eval, "mode": report.mode}
            # The step's gradient, read before any evaluation (an FSDP2 forward after the step
            # may drop the root unit's gradients, which the optimizer has already used).
            trained = _no_dropout(tiny_gpt2())
            Trainer(trained, train, cfg, loss_fn=lm_loss, count_fn=lm_count).fit()
            results[strategy]["grads"] = _grads(trained)
            if strategy == "ddp":  # the reference and the padded loop, on the same weights
                results["one_device"] = one_device(model, val)
                results["padded"] = _padded_sampler_metrics(model, val, rank)
            else:  # FSDP2's weights are sharded: the reference needs the full tensors
                full = tiny_gpt2()
                full.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
                results["fsdp2_one_device"] = one_device(full, val)
        results["one_device_grads"] = _one_device_grads(train)
        # Issue 27: dict samples, the default loss, no count_fn: GPT-2's shifted labels are
        # counted from its class, the same decision on every rank (one all-reduce per step).
        auto = _no_dropout(tiny_gpt2())
        as_dicts = [{"input_ids": ids, "labels": labels} for ids, labels in train]
        cfg = TrainConfig(steps=1, batch_sizes=SIZES, grad_clip=None, progress=False)
        Trainer(auto, as_dicts, cfg).fit()
        results["auto_grads"] = _grads(auto)
        bert, samples = tiny_bert(), padded_samples()
        pred = predict(bert, samples, weights=SIZES, batch_size=7)
        parts: list[Any] = [None] * WORLD
        dist.all_gather_object(parts, (pred.outputs.last_hidden_state, pred.indices))
        results["predict"] = {
            "mine": pred.indices.tolist(),
            "features": torch.cat([f for f, _ in parts]),
            "indices": torch.cat([i for _, i in parts]),
            "expected": one_device_features(bert, samples),
        }
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finish_distributed()  # reached on success only: a failed rank meets no barrier


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("eval_gloo")
    return run_ranks(_worker, WORLD, out, timeout_s=240, what="the eval/predict gloo ranks")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_eval_on_uneven_ranks_equals_one_device(ranks: list[dict[str, Any]], strategy: str) -> None:
    for r in ranks:
        assert r[strategy]["mode"] == strategy
        got = r[strategy]["eval"][-1]["metrics"]
        expected = r["one_device" if strategy == "ddp" else "fsdp2_one_device"]
        names = ("loss", "accuracy") if strategy == "ddp" else ("loss",)
        assert sorted(got) == sorted(names)
        for name in names:
            assert got[name] == pytest.approx(expected[name], rel=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_gpt2_token_gradient_on_uneven_ranks_equals_one_device(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    expected = ranks[0]["one_device_grads"]
    for r in ranks:
        got = r[strategy]["grads"]
        assert sorted(got) == sorted(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_dict_batches_without_count_fn_count_gpt2s_labels_on_uneven_ranks(
    ranks: list[dict[str, Any]],
) -> None:
    expected = ranks[0]["one_device_grads"]
    for r in ranks:
        for name, grad in expected.items():
            torch.testing.assert_close(r["auto_grads"][name], grad, rtol=1e-5, atol=1e-7)


def test_a_padded_distributed_sampler_differs(ranks: list[dict[str, Any]]) -> None:
    expected, padded = ranks[0]["one_device"]["loss"], ranks[0]["padded"]["loss"]
    assert abs(padded - expected) > 1e-6 * expected  # the duplicate sample is counted twice


def test_predict_on_uneven_ranks_returns_each_ranks_rows_in_order(
    ranks: list[dict[str, Any]],
) -> None:
    mine = [r["predict"]["mine"] for r in ranks]
    assert all(m == sorted(m) for m in mine)  # ascending within each rank
    assert sorted(i for m in mine for i in m) == list(range(53))  # every sample exactly once
    # Uneven: rank r holds about SIZES[r] / 7 of the rows.
    assert [len(m) for m in mine] == [8, 30, 15]
    p = ranks[0]["predict"]
    features = p["features"][p["indices"].argsort()]
    torch.testing.assert_close(features, p["expected"], rtol=1e-5, atol=1e-5)
