"""The Trainer's strategies across ranks: empty shares with a model that rejects empty batches,
count-weighted (token) losses under DDP, and the bucketed in-place gradient all-reduce.

One pair of gloo processes, started once for the module, runs every check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from evendp._core._errors import EvendpError
from evendp._distributed._group import all_reduce_gradients
from evendp._training._strategies import rank_strategy_names
from evendp._training._trainer import TrainConfig, Trainer
from tests._helpers import run_ranks, tiny_gpt2_config

N, L, VOCAB = 41, 6, 64
SIZES = [3, 5]  # 41 samples: five steps of 8, then a short step of 1 with an empty share
#: Every strategy of ranks this launch runs, read from the registry ("ddp" twice: OOM-safe and
#: torch's; DeepSpeed's engine has a launch of its own, test_strategy_deepspeed.py).
_VARIANTS = {"ddp": ["safe", "plain"], "deepspeed": []}
MODES = [mode for name in rank_strategy_names() for mode in _VARIANTS.get(name, [name])]


def _strategy(mode: str) -> dict[str, Any]:
    """The TrainConfig settings of a mode of this launch."""
    if mode in ("safe", "plain"):
        return {"strategy": "ddp", "oom_resplit": mode == "safe"}
    return {"strategy": mode}


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


class _Sentences(torch.utils.data.Dataset[Any]):
    """Padded token sequences with a class label (no batch() method: collated per sample)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (N, L), generator=g)
        lengths = torch.randint(2, L + 1, (N,), generator=g)
        self.mask = (torch.arange(L) < lengths[:, None]).long()  # (N, L), right padding
        self.ids = self.ids * self.mask
        self.labels = torch.randint(0, 2, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return self.ids[i], self.mask[i], self.labels[i]


def _bert_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # type: ignore[no-any-return]


class _Texts(_Sentences):
    """The same padded sequences as language-model rows: the padding's labels are -100."""

    def __getitem__(self, i: int) -> Any:
        return self.ids[i], self.mask[i], self.ids[i].masked_fill(self.mask[i] == 0, -100)


def _gpt2() -> nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(tiny_gpt2_config(vocab_size=VOCAB))


def _gpt2_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss  # type: ignore[no-any-return]


def _gpt2_count(batch: Any) -> torch.Tensor:
    return (batch[2][:, 1:] != -100).sum()  # the causal shift: position 0 predicts nothing


def _grads(model: nn.Module, sharded: bool = False) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad.full_tensor() if sharded else p.grad).reshape(-1)  # type: ignore[union-attr]
            for p in model.parameters()
        ]
    )


class _TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.fc = nn.Linear(8, 7)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.fc(torch.tanh(self.emb(x)))  # (B, T, 7)
        return nn.functional.cross_entropy(logits.reshape(-1, 7), y.reshape(-1))


def _params(model: nn.Module, sharded: bool = False) -> torch.Tensor:
    return torch.cat(
        [
            (p.full_tensor() if sharded else p).detach().reshape(-1)  # type: ignore[operator]
            for p in model.parameters()
        ]
    )


def _token_count(batch: Any) -> torch.Tensor:
    return (batch[1] != -100).sum()


class _Tokens(torch.utils.data.Dataset[Any]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randint(0, 7, (16, 5), generator=g)
        self.y = torch.randint(0, 7, (16, 5), generator=g)
        self.y[torch.rand(16, 5, generator=g) < 0.4] = -100
        self.y[torch.rand(16, generator=g) < 0.4] = -100  # whole sequences masked

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]

    def batch(self, indices: list[int]) -> Any:
        return self.x[indices], self.y[indices]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    data = _Sentences()
    # 1) Empty shares with HF BERT: six steps at lr=0, the last one [1, 0] or [0, 1].
    for mode in MODES:
        torch.manual_seed(0)
        model = _bert()
        cfg = TrainConfig(
            steps=6,
            batch_sizes=SIZES,
            lr=0.0,
            grad_clip=None,
            **_strategy(mode),
            progress=False,
        )
        trainer = Trainer(model, data, cfg, loss_fn=_bert_loss)
        trainer.sampler.set_epoch(0)
        every: list[Any] = [None, None]
        dist.all_gather_object(every, list(trainer.sampler))
        report = trainer.fit()
        results[f"bert-{mode}"] = {
            "grads": _grads(model, sharded=mode == "fsdp2"),
            "indices": every,
            "losses": report.losses,
        }
    # 1b) The same with HF GPT-2: padding, -100 labels, the loss a mean over shifted labels.
    for mode in MODES:
        torch.manual_seed(0)
        model = _gpt2()
        cfg = TrainConfig(
            steps=6, batch_sizes=SIZES, lr=0.0, grad_clip=None, progress=False,
            **_strategy(mode),
        )  # fmt: skip
        trainer = Trainer(model, _Texts(), cfg, loss_fn=_gpt2_loss, count_fn=_gpt2_count)
        trainer.sampler.set_epoch(0)
        every = [None, None]
        dist.all_gather_object(every, list(trainer.sampler))
        report = trainer.fit()
        results[f"gpt2-{mode}"] = {
            "grads": _grads(model, sharded=mode == "fsdp2"),
            "indices": every,
            "losses": report.losses,
        }
    # 2) Token-weighted loss under OOM-safe DDP with accumulation: sizes [5, 3].
    torch.manual_seed(0)
    model = _TokenLM()
    tokens = _Tokens()
    cfg = TrainConfig(steps=1, batch_sizes=[5, 3], accum=2, lr=0.0, grad_clip=None, progress=False)
    trainer = Trainer(model, tokens, cfg, count_fn=lambda b: (b[1] != -100).sum())
    trainer.sampler.set_epoch(0)
    mine: list[Any] = [None, None]
    dist.all_gather_object(mine, next(iter(trainer.sampler)))
    report = trainer.fit()
    results["tokens"] = {"grads": _grads(model), "indices": mine, "loss": report.losses[0]}
    # 2b) Rank 1 cannot fit even one sample in step 0: the flag, riding in the gradient
    # buckets, makes both ranks skip that step (neither hangs); step 1 trains exactly.
    torch.manual_seed(0)
    model = _TokenLM()
    cfg = TrainConfig(steps=2, batch_sizes=[5, 3], lr=0.0, grad_clip=None, progress=False)
    state: dict[str, Trainer] = {}

    def oom_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if rank == 1 and state["t"].step == 0:
            raise torch.OutOfMemoryError("injected")
        return model(*batch)  # type: ignore[no-any-return]

    state["t"] = trainer = Trainer(
        model, tokens, cfg, loss_fn=oom_loss, count_fn=lambda b: (b[1] != -100).sum()
    )
    trainer.sampler.set_epoch(0)
    both: list[Any] = [None, None]
    dist.all_gather_object(both, list(trainer.sampler)[:2])
    report = trainer.fit()
    results["skip"] = {
        "skipped": report.skipped_steps,
        "losses": report.losses,
        "grads": _grads(model),
        "indices": both,
    }
    # 2c) Every mode trains (AdamW, clipping) as one process does; ZeRO-1's sharded state
    # also resumes: saved at step 1 (every rank's slice gathered on rank 0), then step 2.
    for mode in MODES:
        settings = {"steps": 2, "batch_sizes": [5, 3], "lr": 0.05, "progress": False}
        torch.manual_seed(0)
        model = _TokenLM()
        cfg = TrainConfig(**settings, **_strategy(mode))  # type: ignore[arg-type]
        trained = Trainer(model, tokens, cfg, count_fn=_token_count)
        trained.fit()
        results[f"trained-{mode}"] = _params(model, sharded=mode == "fsdp2")
        if mode == "zero1":  # this rank's AdamW holds moments for its slice only
            results["zero1-held"] = len(trained.optimizer.optim.state)  # type: ignore[attr-defined]
    torch.manual_seed(0)
    first = TrainConfig(steps=1, batch_sizes=[5, 3], lr=0.05, progress=False, strategy="zero1",
                        out_dir=out, checkpoint_every=1)  # fmt: skip
    Trainer(_TokenLM(), tokens, first, count_fn=_token_count).fit()
    torch.manual_seed(1)  # another start: the resume must restore the weights and the moments
    model = _TokenLM()
    again = TrainConfig(steps=2, batch_sizes=[5, 3], lr=0.05, progress=False, strategy="zero1",
                        out_dir=out, checkpoint_every=1, resume=True)  # fmt: skip
    Trainer(model, tokens, again, count_fn=_token_count).fit()
    results["resumed-zero1"] = _params(model)
    other = torch.optim.SGD(_TokenLM().parameters(), lr=0.1)  # a scheduler zero1 cannot use
    try:
        Trainer(_TokenLM(), tokens, TrainConfig(batch_sizes=[5, 3], strategy="zero1"),
                scheduler=torch.optim.lr_scheduler.StepLR(other, 1))  # fmt: skip
        results["zero1-scheduler"] = "accepted"
    except EvendpError as refused:
        results["zero1-scheduler"] = str(refused)
    # 3) Buckets: three gradients, buckets of 40 bytes (a lone one in place, two flattened).
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 4, 12)]
    for p in params:
        p.grad = torch.arange(p.numel(), dtype=torch.float32) * (rank + 1)
    all_reduce_gradients(params, bucket_bytes=40)
    results["buckets"] = [p.grad for p in params]
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("strategy_ddp")
    return run_ranks(_worker, 2, out, 240, "strategy workers")


def _assert_one_device(
    r0: dict[str, Any], r1: dict[str, Any], steps: list[list[int]], data: Any,
    build: Any, loss_fn: Any,
) -> None:  # fmt: skip
    """Both ranks' last-step gradient and rank 0's losses equal one device's on each step."""
    torch.manual_seed(0)
    ref = build()
    losses = []
    for indices in steps:  # lr=0: every step at the initial weights
        ref.zero_grad()
        loss = loss_fn(ref, torch.utils.data.default_collate([data[i] for i in indices]))
        loss.backward()
        losses.append(float(loss.detach()))
    expected = _grads(ref)  # the short last step's gradient
    for r in (r0, r1):
        assert float((r["grads"] - expected).norm() / expected.norm()) <= 1e-5
    for got, want in zip(r0["losses"], losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_share_never_calls_bert_on_zero_rows_and_stays_exact(
    results: list[dict[str, Any]], mode: str
) -> None:
    r0, r1 = (r[f"bert-{mode}"] for r in results)
    steps = [a + b for a, b in zip(r0["indices"][0], r0["indices"][1], strict=True)]
    assert len(steps) == 6 and len(steps[-1]) == 1  # the short last step: one rank is empty
    assert not r0["indices"][0][-1] or not r0["indices"][1][-1]
    _assert_one_device(r0, r1, steps, _Sentences(), _bert, _bert_loss)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_share_of_gpt2_with_padding_labels_stays_exact(
    results: list[dict[str, Any]], mode: str
) -> None:
    r0, r1 = (r[f"gpt2-{mode}"] for r in results)
    steps = [a + b for a, b in zip(r0["indices"][0], r0["indices"][1], strict=True)]
    assert not r0["indices"][0][-1] or not r0["indices"][1][-1]  # the last step: one empty
    _assert_one_device(r0, r1, steps, _Texts(), _gpt2, _gpt2_loss)


@pytest.mark.multiprocess
def test_count_fn_under_ddp_is_the_token_mean_over_ranks(results: list[dict[str, Any]]) -> None:
    r0, r1 = (r["tokens"] for r in results)
    indices = r0["indices"][0] + r0["indices"][1]
    torch.manual_seed(0)
    ref = _TokenLM()
    x, y = _Tokens().batch(indices)
    loss = ref(x, y)  # one device: the mean over every non-ignored token
    loss.backward()
    expected = _grads(ref)
    for r in (r0, r1):
        assert float((r["grads"] - expected).norm() / expected.norm()) <= 1e-5
    assert abs(r0["loss"] - float(loss.detach())) <= 1e-5 * float(loss.detach())


@pytest.mark.multiprocess
def test_an_oom_no_rank_survives_skips_the_step_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["skip"] for r in results)
    assert r0["skipped"] == r1["skipped"] == 1
    assert len(r0["losses"]) == len(r1["losses"]) == 1
    step1 = r0["indices"][0][1] + r0["indices"][1][1]
    torch.manual_seed(0)
    ref = _TokenLM()
    x, y = _Tokens().batch(step1)
    loss = ref(x, y)
    loss.backward()
    expected = _grads(ref)
    for r in (r0, r1):
        assert float((r["grads"] - expected).norm() / expected.norm()) <= 1e-5
    assert abs(r0["losses"][0] - float(loss.detach())) <= 1e-5 * float(loss.detach())


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", MODES)
def test_every_strategy_trains_as_one_process_and_zero1_resumes(
    results: list[dict[str, Any]], mode: str
) -> None:
    """Two AdamW steps with clipping on ranks of [5, 3] equal one process on the batch of 8;
    for ZeRO-1 (its moments sharded) also a run saved at step 1 and resumed to step 2."""
    torch.manual_seed(0)
    ref = _TokenLM()
    cfg = TrainConfig(steps=2, batch_size=8, lr=0.05, progress=False)
    Trainer(ref, _Tokens(), cfg, device_ids=["cpu"], count_fn=_token_count).fit()
    want = _params(ref)
    runs = [r[f"trained-{mode}"] for r in results]
    if mode == "zero1":
        runs += [r["resumed-zero1"] for r in results]
    for got in runs:
        assert float((got - want).norm() / want.norm()) <= 1e-5
    if mode == "zero1":  # the moments are split: each rank holds some, together all
        held = [r["zero1-held"] for r in results]
        assert all(held) and sum(held) == len(list(ref.parameters()))
        for r in results:  # a scheduler of another optimizer would set no rate: refused
            assert "pass warmup_steps=" in r["zero1-scheduler"], r["zero1-scheduler"]


@pytest.mark.multiprocess
def test_bucketed_all_reduce_averages_in_place(results: list[dict[str, Any]]) -> None:
    for r in results:
        for n, grad in zip((3, 4, 12), r["buckets"], strict=True):
            assert torch.equal(grad, torch.arange(n, dtype=torch.float32) * 1.5)


# --- one process: weights="auto" and batch_sizes="auto" -----------------------------------


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("surface", ["weights", "batch_sizes"])
def test_auto_in_one_process_plans_the_devices_split_and_trains_exactly(
    surface: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: "auto" means one thing on every surface. In one process Trainer(weights=
    "auto") was refused and TrainConfig(batch_sizes="auto") warned that it was ignored; both
    now plan the devices' split for their memory (declared here), say it, and train the
    full batch's step."""
    import warnings

    import evendp

    monkeypatch.setenv("EVENDP_MEMORY", "3MiB,1500KiB")
    torch.manual_seed(0)
    x, y = torch.randn(2048, 64), torch.randint(0, 4, (2048,))
    data = torch.utils.data.TensorDataset(x, y)
    net, ref = _Classifier(), _Classifier()  # the loss in forward: what the planner prices
    ref.load_state_dict(net.state_dict())
    auto: dict[str, Any] = {"batch_sizes": "auto"} if surface == "batch_sizes" else {}
    cfg = TrainConfig(steps=1, batch_size=1024, progress=False, grad_clip=None, **auto)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is "ignored" any more
        trainer = Trainer(
            net, data, cfg, device_ids=["cpu", "cpu"],
            optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
            **({"weights": "auto"} if surface == "weights" else {}),
        )  # fmt: skip
    example = (x[:1], y[:1])
    want = evendp.plan(ref, example, "3MiB,1500KiB", mode="dp", batch_size=1024, cuda_context=0)
    assert trainer.wrapped.split(1024) == list(want.split) != [512, 512]
    said = capsys.readouterr().err
    assert f"'auto' planned {list(want.split)} per device" in said and "3MiB,1500KiB" in said
    trainer.sampler.set_epoch(0)
    indices = list(next(iter(trainer.sampler)))
    trainer.fit()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(x[indices], y[indices]).backward()
    opt.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5)
