"""The Trainer: exact steps under uneven splits, accumulation and OOM; resume; AMP; Ctrl-C.

The DDP checks run in one pair of gloo processes, started once for the module.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from evendp._core._errors import EvendpError
from evendp._distributed._group import finish_distributed
from evendp._training import _peak_memory
from evendp._training._trainer import TrainConfig, Trainer
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.stdlib_text import CharWindows
from tests._helpers import OomInBackward, requires_cuda, run_ranks

V = 7  # vocabulary of the toy data


class TinyLM(nn.Module):
    """Embedding + MLP next-token model; raises OOM for batches above ``limit`` (forward) or
    ``backward_limit`` (backward, after fc's gradient was already accumulated)."""

    def __init__(
        self, limit: int = 10**9, batchnorm: bool = False, backward_limit: int = 10**9
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.fc = nn.Linear(16, V)
        self.limit = limit
        self.backward_limit = backward_limit

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("injected")
        h = OomInBackward.apply(self.emb(x), self.backward_limit)  # (B, T, 16)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        logits = self.fc(torch.tanh(h))  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def _data(n: int = 400, block: int = 6) -> CharWindows:
    g = torch.Generator().manual_seed(1)
    return CharWindows(torch.randint(0, V, (n,), generator=g), block_size=block)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model(x, y).backward()
    opt.step()


def test_one_step_equals_the_full_batch_step_with_zeros_accum_and_oom() -> None:
    data = _data()
    torch.manual_seed(0)
    ours = TinyLM(limit=3)  # device 0's share of 8 (weight 2 of 3) does not fit: re-split
    ref = TinyLM()
    ref.load_state_dict(ours.state_dict())
    cfg = TrainConfig(steps=1, batch_size=12, accum=1, grad_clip=None, progress=False)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    trainer = Trainer(ours, data, cfg, device_ids=["cpu"] * 3, weights=[2, 1, 0], optimizer=opt)
    indices = next(iter(trainer.sampler))
    report = trainer.fit()
    assert report.resplits >= 1 and report.skipped_steps == 0
    assert [d.samples_per_step for d in report.devices] == [8, 4, 0]
    x, y = data.batch(indices)
    _reference_step(ref, x, y, lr=0.5)
    assert _rel(_flat(ours), _flat(ref)) <= 1e-5


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    ("limits", "accum", "caps", "micro_steps"),
    [
        # Only device 1's share (6) is above 4: only its cap shrinks; devices 0 and 2 still
        # run their whole shares in the first micro-step.
        ({"limit": 4}, 1, [None, 3, None], [[3, 3, 3], [0, 3, 0]]),
        # Accumulation caps every share at ceil(share / 2) = [2, 3, 2]; device 1 fits 2.
        ({"limit": 2}, 2, [None, 2, None], [[2, 2, 2], [1, 2, 1], [0, 2, 0]]),
        # An OOM in backward names no device: every share is halved.
        ({"backward_limit": 5}, 1, [2, 3, 2], [[2, 3, 2], [1, 3, 1]]),
    ],
)
def test_oom_on_one_device_shrinks_its_share_only_and_stays_exact(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    limits: dict[str, int],
    accum: int,
    caps: list[int | None],
    micro_steps: list[list[int]],
) -> None:
    data = _data()
    torch.manual_seed(0)
    ours = TinyLM(**limits)
    ref = TinyLM()
    ref.load_state_dict(ours.state_dict())
    cfg = TrainConfig(
        steps=2, batch_size=12, accum=accum, grad_clip=None, progress=False, out_dir=tmp_path
    )
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    trainer = Trainer(ours, data, cfg, device_ids=["cpu"] * 3, weights=[1, 2, 1], optimizer=opt)
    batches = [data.batch(list(i)) for i in itertools.islice(trainer.sampler, 2)]
    report = trainer.fit()
    # One OOM in all: the second step reused the remembered caps.
    assert report.resplits == 1 and report.skipped_steps == 0
    assert trainer.guard.micro_batch_sizes == caps
    # Issue 36: the re-split is said once, at its step, with what it decided and why.
    where = " on device 1" if "limit" in limits else ""
    now = "/".join("all" if c is None else str(c) for c in caps)
    said = [line for line in capsys.readouterr().err.splitlines() if "memory" in line]
    assert said == [
        f"evendp: step 1: out of memory{where}: micro-batches now {now} per device, the step "
        "runs again"
    ]
    assert trainer.micro_steps == micro_steps  # the second step's micro-steps
    assert [d.samples_per_step for d in report.devices] == [3, 6, 3]
    assert trainer.wrapped.weights == [1, 2, 1]  # the user's weights, back after the step
    # The reference: SGD on the full batches; compare the second step's gradient and weights.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in batches:
        ref_opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
    assert _rel(_grads(ours), _grads(ref)) <= 1e-5
    assert _rel(_flat(ours), _flat(ref)) <= 1e-5
    # The caps travel in the checkpoint.
    cfg.resume = True
    resumed = Trainer(TinyLM(), data, cfg, device_ids=["cpu"] * 3, weights=[1, 2, 1])
    resumed.fit()
    assert resumed.guard.micro_batch_sizes == caps


def test_accumulation_gives_the_same_step() -> None:
    data = _data()
    results = []
    for accum in (1, 4):
        torch.manual_seed(0)
        model = TinyLM()
        cfg = TrainConfig(steps=3, batch_size=10, accum=accum, grad_clip=0.5, progress=False)
        Trainer(model, data, cfg, device_ids=["cpu", "cpu"], weights=[3, 1]).fit()
        results.append(_flat(model))
    assert _rel(results[1], results[0]) <= 1e-5


def _run(tmp: Path | None, steps: int, resume: bool = False, every: int = 0) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    cfg = TrainConfig(
        steps=steps,
        batch_size=16,
        out_dir=tmp,
        resume=resume,
        checkpoint_every=every,
        progress=False,
        prefetch=2,  # batches wait in the queue when a checkpoint is taken: still exact
    )
    trainer = Trainer(
        model,
        _data(n=200),
        cfg,
        device_ids=["cpu", "cpu"],
        weights=[1, 1],
        optimizer=opt,
        scheduler=sched,
    )
    return trainer.fit().losses


def test_resume_continues_the_same_loss_curve(tmp_path: Path) -> None:
    straight = _run(None, 20)
    first = _run(tmp_path, 10, every=4)
    assert (tmp_path / "ckpt.pt").exists() and (tmp_path / "ckpt.prev.pt").exists()
    resumed = _run(tmp_path, 20, resume=True)
    assert len(first) == 10 and len(resumed) == 20  # epochs cross over (200 windows / 16)
    assert resumed[:10] == first
    for a, b in zip(resumed, straight, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_a_resume_keeps_this_runs_optimizer_implementation(tmp_path: Path) -> None:
    """A checkpoint from an unfused AdamW (ZeRO-1's, or a user's) resumed by a run whose
    AdamW is fused: the saved groups' 'fused': None must not turn it unfused under the
    device-side gate (torch asserted on found_inf at the first step)."""
    data = CharWindows(torch.randint(0, 5, (60,)), block_size=4)
    cfg = TrainConfig(steps=1, batch_size=4, progress=False, out_dir=tmp_path, checkpoint_every=1)
    model = nn.Embedding(5, 5)
    unfused = torch.optim.AdamW(model.parameters(), lr=0.01, fused=False)
    Trainer(model, data, cfg, device_ids=["cpu"], loss_fn=_bigram_loss, optimizer=unfused).fit()
    again = TrainConfig(
        steps=2, batch_size=4, progress=False, out_dir=tmp_path, checkpoint_every=1, resume=True
    )
    resumed = Trainer(nn.Embedding(5, 5), data, again, device_ids=["cpu"], loss_fn=_bigram_loss)
    fused = resumed.optimizer.param_groups[0]["fused"]
    resumed.fit()
    assert resumed.state.step == 2
    assert resumed.optimizer.param_groups[0]["fused"] == fused


def test_ctrl_c_saves_and_returns(tmp_path: Path) -> None:
    calls = {"n": 0}

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return model(*batch)

    torch.manual_seed(0)
    cfg = TrainConfig(steps=10, batch_size=8, out_dir=tmp_path, progress=False)
    report = Trainer(TinyLM(), _data(), cfg, device_ids=["cpu"], loss_fn=loss_fn).fit()
    assert report.interrupted and report.steps == 3
    from evendp._training._checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "ckpt.pt", model=TinyLM())["step"] == 3


def test_bf16_autocast_on_cpu_trains_and_keeps_batchnorm_fp32() -> None:
    torch.manual_seed(0)
    model = TinyLM(batchnorm=True)
    cfg = TrainConfig(steps=25, batch_size=16, amp="bf16", lr=3e-2, progress=False)
    report = Trainer(model, _data(), cfg, device_ids=["cpu", "cpu"], weights=[2, 1]).fit()
    assert all(torch.isfinite(torch.tensor(report.losses)))
    assert report.final_loss is not None and report.first_loss is not None
    assert report.final_loss < report.first_loss
    assert isinstance(model.norm, nn.BatchNorm1d)
    assert model.norm.running_mean.dtype == torch.float32
    assert model.norm.weight.dtype == torch.float32
    # The model feeds BatchNorm fp32 anyway (an embedding); a bf16 input shows the hook works.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.norm(torch.randn(4, model.norm.num_features).bfloat16())
    assert out.dtype == torch.float32


@requires_cuda
@pytest.mark.gpu
def test_fp16_with_grad_scaler_on_cuda() -> None:
    torch.manual_seed(0)
    model = TinyLM(batchnorm=True).cuda()
    cfg = TrainConfig(steps=20, batch_size=16, amp="fp16", lr=3e-2, progress=False)
    trainer = Trainer(model, _data(), cfg, device_ids=["cuda:0", "cuda:0"], weights=[2, 1])
    report = trainer.fit()
    assert trainer.scaler is not None and trainer.scaler.get_scale() > 0
    assert report.final_loss is not None and report.first_loss is not None
    assert report.final_loss < report.first_loss
    assert report.devices[0].peak_bytes is not None


def test_activation_checkpointing_keeps_the_gradient_and_keys() -> None:
    cfg_gpt = GPTConfig(vocab_size=V, block_size=6, n_layer=2, n_head=2, n_embd=16)
    data = _data()
    params = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg_gpt)
        keys = list(model.state_dict())
        cfg = TrainConfig(steps=2, batch_size=8, activation_checkpointing=ckpt, progress=False)
        Trainer(model, data, cfg, device_ids=["cpu", "cpu"]).fit()
        assert list(model.state_dict()) == keys
        wrapped = any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
        assert wrapped == ckpt  # the option really wraps the blocks
        params.append(_flat(model))
    assert _rel(params[1], params[0]) <= 1e-5
    with pytest.raises(EvendpError, match="ModuleList"):
        Trainer(TinyLM(), data, TrainConfig(activation_checkpointing=True), device_ids=["cpu"])


def test_oom_resplit_false_lets_an_oom_propagate() -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=1, batch_size=8, oom_resplit=False, progress=False)
    trainer = Trainer(TinyLM(limit=3), _data(), cfg, device_ids=["cpu"])
    assert not trainer.guard.catch
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit()
    assert trainer.guard.resplits == 0


def test_skipped_steps_do_not_dilute_the_samples_per_step() -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=3, batch_size=8, progress=False)
    trainer: Trainer

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if trainer.step == 1:  # the second step never fits, not even one sample
            raise torch.OutOfMemoryError("injected")
        return model(*batch)

    trainer = Trainer(TinyLM(), _data(), cfg, device_ids=["cpu", "cpu"], loss_fn=loss_fn)
    report = trainer.fit()
    assert report.steps == 3 and report.skipped_steps == 1 and len(report.losses) == 2
    assert [d.samples_per_step for d in report.devices] == [4, 4]
    assert report.global_batch == 8


def _bigram_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).view(-1, 5), batch[1].view(-1))


def test_warmup_steps_ramp_the_learning_rate_then_hold_it() -> None:
    """TrainConfig(warmup_steps=3): lr/3, 2lr/3, then lr, from the Trainer's own schedule;
    with a scheduler of the user's too, refused in one line."""
    data = CharWindows(torch.randint(0, 5, (60,)), block_size=4)
    cfg = TrainConfig(steps=4, batch_size=4, lr=0.3, progress=False, warmup_steps=3)
    trainer = Trainer(nn.Embedding(5, 5), data, cfg, device_ids=["cpu"], loss_fn=_bigram_loss)
    rates: list[float] = []  # the rate each update ran at (the schedule may step a step late)
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: rates.append(opt.param_groups[0]["lr"])
    )
    trainer.fit()
    assert rates == pytest.approx([0.1, 0.2, 0.3, 0.3])
    own = torch.optim.SGD(nn.Embedding(5, 5).parameters(), lr=0.1)
    with pytest.raises(EvendpError, match=r"warmup_steps=3 builds.*scheduler= was given"):
        Trainer(
            nn.Embedding(5, 5), data, cfg, loss_fn=_bigram_loss, optimizer=own,
            scheduler=torch.optim.lr_scheduler.StepLR(own, 1),
        )  # fmt: skip
    with pytest.raises(EvendpError, match="warmup_steps"):
        TrainConfig(warmup_steps=-1)


def test_config_validation() -> None:
    with pytest.raises(EvendpError, match="amp"):
        TrainConfig(amp="fp8")  # type: ignore[arg-type]
    with pytest.raises(EvendpError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(EvendpError, match="out_dir"):
        TrainConfig(resume=True)
    with pytest.raises(EvendpError, match="prefetch"):
        TrainConfig(prefetch=-1)


# --- uneven DDP on gloo: 2 processes, spawned once for the module ----------------------------

SIZES = [5, 3]


def _ddp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    data = _data()
    for oom_resplit in (True, False):
        torch.manual_seed(0)
        # Rank 0 cannot run more than 2 samples at once (OOM-safe mode only: plain DDP
        # would hang on an OOM in one rank's backward, which is why the safe mode exists).
        model = TinyLM(limit=2 if rank == 0 and oom_resplit else 10**9)
        initial = _flat(model).clone()
        cfg = TrainConfig(
            steps=1, batch_sizes=SIZES, oom_resplit=oom_resplit, grad_clip=None, progress=False
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        trainer = Trainer(model, data, cfg, optimizer=opt)
        trainer.sampler.set_epoch(0)
        mine = next(iter(trainer.sampler))
        both: list[Any] = [None, None]
        dist.all_gather_object(both, mine)
        report = trainer.fit()
        results[str(oom_resplit)] = {
            "initial": initial,
            "after": _flat(model).clone(),
            "indices": both,
            "resplits": report.resplits,
            "samples": [d.samples_per_step for d in report.devices],
            "loss": report.losses[0],
        }
    # FSDP2: sharded parameters, two micro-batches (gradient sync only on the last), clipping
    # by the global norm of the sharded gradients.
    torch.manual_seed(0)
    model = TinyLM()
    cfg = TrainConfig(steps=1, batch_sizes=SIZES, accum=2, grad_clip=0.05, strategy="fsdp2",
                      progress=False)  # fmt: skip
    trainer = Trainer(model, data, cfg)
    trainer.sampler.set_epoch(0)
    mine = next(iter(trainer.sampler))
    both = [None, None]
    dist.all_gather_object(both, mine)
    report = trainer.fit()
    grads = [p.grad.full_tensor().reshape(-1) for p in model.parameters()]  # type: ignore[union-attr]
    results["fsdp2"] = {
        "grads": torch.cat(grads),
        "indices": both,
        "mode": report.mode,
        "loss": report.losses[0],
    }
    # Empty shares: a rank of size 0, and the short last step of an epoch ([5, 3] over 9
    # samples: the second step is [1, 0]), on a dataset without batch() (collated per sample).
    # lr=0 keeps the weights, so every step's gradient is checked at the initial weights.
    nine = _NoBatch(_data(n=9 + 6))
    from evendp._training._recorder import TrainProgress

    shown: list[int] = []  # the samples the progress bar is given, per step
    real_update = TrainProgress.update

    def update(bar: TrainProgress, step: int, loss: Any, samples: int, memory: str) -> None:
        shown.append(samples)
        real_update(bar, step, loss, samples, memory)

    TrainProgress.update = update  # type: ignore[method-assign]
    # A fake GPU memory reader, a figure of its own on each rank: the report must gather
    # every rank's peak (each rank reads only its own GPU). Put back below (a pooled rank).
    real_reader = _peak_memory.reserved_peak
    _peak_memory.reserved_peak = lambda device: (rank + 1) << 20
    for name, sizes, steps in EMPTY_CASES:
        for mode in EMPTY_MODES:
            torch.manual_seed(0)
            model = TinyLM()
            cfg = TrainConfig(
                steps=steps,
                batch_sizes=sizes,
                accum=2,
                lr=0.0,
                grad_clip=None,
                oom_resplit=mode != "plain",
                strategy="fsdp2" if mode == "fsdp2" else "ddp",
                progress=False,
            )
            trainer = Trainer(model, nine, cfg)
            shown.clear()
            trainer.sampler.set_epoch(0)
            every: list[Any] = [None, None]
            dist.all_gather_object(every, list(trainer.sampler))
            report = trainer.fit()
            grads = [
                (p.grad.full_tensor() if mode == "fsdp2" else p.grad).reshape(-1)  # type: ignore[union-attr]
                for p in model.parameters()
            ]
            results[f"{name}-{mode}"] = {
                "grads": torch.cat(grads),
                "indices": every,
                "losses": report.losses,
                "samples": [d.samples_per_step for d in report.devices],
                "shown": list(shown),
                "split": report.batch_sizes_per_step,
                "peaks": [(d.peak_bytes, d.peak_kind) for d in report.devices],
            }
    _peak_memory.reserved_peak = real_reader
    # BatchNorm on uneven ranks: rank 0 warns, as one process does for its devices (issue 36).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bn = nn.Sequential(nn.Embedding(64, 8), nn.BatchNorm1d(16))
        Trainer(bn, data, TrainConfig(steps=1, batch_sizes=[3, 1], progress=False))
    results["batchnorm"] = [str(w.message) for w in seen if "BatchNorm" in str(w.message)]
    # Ranks given other plans (two nodes started with other --batch-sizes): every rank stops.
    sizes = [1, 3] if rank == 0 else [3, 1]
    try:
        Trainer(TinyLM(), data, TrainConfig(steps=1, batch_sizes=sizes, progress=False))
        results["disagree"] = "trained"
    except EvendpError as exc:
        results["disagree"] = str(exc)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    finish_distributed()


class _NoBatch(torch.utils.data.Dataset[Any]):
    """A dataset without ``batch(indices)``: the Trainer collates it sample by sample."""

    def __init__(self, data: CharWindows) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data[i]


EMPTY_CASES = [("zero", [0, 4], 1), ("ragged", [5, 3], 2)]
EMPTY_MODES = ["safe", "plain", "fsdp2"]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trainer_ddp")
    return run_ranks(_ddp_worker, 2, out, 150, "DDP trainer workers")


@pytest.mark.multiprocess
def test_batchnorm_on_uneven_ranks_is_warned_once(ddp_results: list[dict[str, Any]]) -> None:
    said = [r["batchnorm"] for r in ddp_results]
    assert len(said[0]) == 1 and said[1] == []  # rank 0 says it, once
    assert "batch_sizes=[3, 1] split each step unevenly" in said[0][0]


@pytest.mark.multiprocess
def test_ranks_given_other_batch_plans_all_stop_before_training(
    ddp_results: list[dict[str, Any]],
) -> None:
    """issue 35: each rank trained its own plan (exit 0, samples unused); now every rank
    raises the same line, naming both plans."""
    said = [r["disagree"] for r in ddp_results]
    assert said[0] == said[1], said
    assert "rank 0 (node 0) has sizes [1, 3], rank 1 (node 0) has sizes [3, 1]" in said[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("oom_resplit", ["True", "False"])
def test_uneven_ddp_step_equals_the_full_batch_step(
    ddp_results: list[dict[str, Any]], oom_resplit: str
) -> None:
    r0, r1 = (r[oom_resplit] for r in ddp_results)
    assert r0["samples"] == r1["samples"] == [5, 3]
    indices = r0["indices"][0] + r0["indices"][1]
    torch.manual_seed(0)
    ref = TinyLM()
    assert torch.equal(_flat(ref), r0["initial"])
    x, y = _data().batch(indices)
    with torch.no_grad():
        expected_loss = float(ref(x, y))
    _reference_step(ref, x, y, lr=0.5)
    assert _rel(r0["after"], _flat(ref)) <= 1e-5 and _rel(r1["after"], _flat(ref)) <= 1e-5
    assert abs(r0["loss"] - expected_loss) <= 1e-5 * expected_loss
    if oom_resplit == "True":
        assert r0["resplits"] > 0 and r1["resplits"] == 0


@pytest.mark.multiprocess
def test_fsdp2_step_has_the_full_batch_gradient_clipped_globally(
    ddp_results: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["fsdp2"] for r in ddp_results)
    assert r0["mode"] == "fsdp2"
    indices = r0["indices"][0] + r0["indices"][1]
    torch.manual_seed(0)
    ref = TinyLM()
    x, y = _data().batch(indices)
    loss = ref(x, y)
    loss.backward()
    nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
    assert _rel(r0["grads"], expected) <= 1e-5 and _rel(r1["grads"], expected) <= 1e-5
    value = float(loss.detach())
    assert abs(r0["loss"] - value) <= 1e-5 * value


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", EMPTY_MODES)
@pytest.mark.parametrize(("name", "sizes", "steps"), EMPTY_CASES)
def test_a_rank_with_no_samples_neither_hangs_nor_changes_the_gradient(
    ddp_results: list[dict[str, Any]], name: str, sizes: list[int], steps: int, mode: str
) -> None:
    r0, r1 = (r[f"{name}-{mode}"] for r in ddp_results)
    data = _NoBatch(_data(n=9 + 6))
    per_step = [a + b for a, b in zip(r0["indices"][0], r0["indices"][1], strict=True)]
    assert len(per_step) >= steps
    # Some step has an empty share: the case under test really happens.
    assert any(not part for rank in r0["indices"] for part in rank[:steps])
    torch.manual_seed(0)
    ref = TinyLM()
    losses = []
    for indices in per_step[:steps]:
        ref.zero_grad()
        x, y = torch.utils.data.default_collate([data[i] for i in indices])
        loss = ref(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
    expected = _grads(ref)  # the last step's gradient at the initial weights (lr=0)
    assert _rel(r0["grads"], expected) <= 1e-5 and _rel(r1["grads"], expected) <= 1e-5
    assert len(r0["losses"]) == steps
    for got, want in zip(r0["losses"], losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    # The progress bar counts every rank's samples (the short last step included).
    assert r0["shown"] == r1["shown"] == [len(i) for i in per_step[:steps]]
    total = sum(len(i) for i in per_step[:steps])
    assert sum(r0["samples"]) * steps == pytest.approx(total)
    # The report's split is what each rank trained at each step, the short last step too.
    split = [[len(i) for i in parts] for parts in zip(*r0["indices"], strict=True)][:steps]
    assert r0["split"] == r1["split"] == split
    # Each rank's GPU peak (a fake reader: no GPU here) is in the report, not rank 0's alone.
    assert r0["peaks"] == r1["peaks"] == [(1 << 20, "reserved"), (2 << 20, "reserved")]


def test_fsdp2_refuses_a_prebuilt_optimizer() -> None:
    from evendp._training._strategies._fsdp2 import refuse_prebuilt_optimizer

    model = TinyLM()
    with pytest.raises(EvendpError, match="optimizer=None"):
        refuse_prebuilt_optimizer(torch.optim.SGD(model.parameters(), 0.1))


# --- fp16's skipped steps, count-weighted (token) losses ------------------------------------


def test_fp16_does_not_advance_the_schedule_when_the_scaler_skips_the_step() -> None:
    # GradScaler runs on CPU: an inf gradient on the second step makes it skip that optimizer
    # step and halve its scale; the learning-rate schedule must skip that step as well.
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cfg = TrainConfig(steps=3, batch_size=4, amp="fp16", grad_clip=None, progress=False)
    trainer: Trainer

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = model(*batch)
        return loss * float("inf") if trainer.step == 1 else loss

    trainer = Trainer(
        model, _data(), cfg, device_ids=["cpu"], loss_fn=loss_fn, optimizer=opt, scheduler=sched
    )
    assert trainer.scaler is not None
    trainer.fit()
    assert sched.last_epoch == 2  # three steps, one of them skipped by the scaler
    assert opt.param_groups[0]["lr"] == 0.25


class _Masked(torch.utils.data.Dataset[Any]):
    """Token windows with -100 labels: whole sequences and single tokens masked at random."""

    def __init__(self, n: int, block: int, masked: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, V, (n, block), generator=g)
        self.y = torch.randint(0, V, (n, block), generator=g)
        self.y[torch.rand(n, block, generator=g) < 0.3] = -100
        self.y[torch.rand(n, generator=g) < masked] = -100  # fully masked sequences
        self.y[0, 0] = 3  # at least one counted token (the batch of 12 has most samples)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


def _tokens(batch: Any) -> torch.Tensor:
    return (batch[1] != -100).sum()


def _count_weighted_grads(
    data: _Masked, weights: list[int], accum: int, limit: int, count: bool
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    torch.manual_seed(0)
    model = TinyLM(limit=limit)
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    cfg = TrainConfig(steps=1, batch_size=12, accum=accum, lr=0.0, grad_clip=None, progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = Trainer(
        model,
        data,
        cfg,
        device_ids=["cpu"] * len(weights),
        weights=[float(w) for w in weights],
        optimizer=opt,
        count_fn=_tokens if count else None,
    )
    indices = list(next(iter(trainer.sampler)))
    report = trainer.fit()
    x, y = data.batch(indices)
    loss = ref(x, y)  # one device: the mean over every non-ignored token of the batch
    loss.backward()
    return _grads(model), _grads(ref), report.losses[0], float(loss.detach())


@settings(max_examples=12, deadline=None, phases=[Phase.generate])
@given(
    weights=st.lists(st.integers(0, 3), min_size=1, max_size=4).filter(any),
    accum=st.integers(1, 3),
    limit=st.sampled_from([2, 10**9]),
    masked=st.sampled_from([0.3, 0.8]),
    seed=st.integers(0, 50),
)
def test_count_fn_gives_the_token_mean_under_any_split_accum_and_oom(
    weights: list[int], accum: int, limit: int, masked: float, seed: int
) -> None:
    data = _Masked(12, 5, masked, seed)  # every step is the whole dataset
    ours, ref, loss, ref_loss = _count_weighted_grads(data, weights, accum, limit, count=True)
    assert torch.isfinite(ours).all()
    assert _rel(ours, ref) <= 1e-5
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss  # a NaN from an all-masked share fails


def test_without_count_fn_a_masked_loss_is_weighted_by_samples_and_differs() -> None:
    # The control: the same split weighted by samples is not the token mean, so the property
    # above can fail.
    data = _Masked(12, 5, 0.5, 3)
    ours, ref, *_ = _count_weighted_grads(data, [2, 1, 1], 1, 10**9, count=False)
    assert _rel(ours, ref) > 1e-3
    ours, ref, *_ = _count_weighted_grads(data, [2, 1, 1], 1, 10**9, count=True)
    assert _rel(ours, ref) <= 1e-5


class _Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Variable-length samples with no batch(indices): default_collate cannot stack them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, 8, (int(n),), generator=g) for n in range(3, 9)] * 4

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i][:-1], self.items[i][1:]


def test_collate_fn_pads_variable_length_samples_and_fit_writes_the_report(
    tmp_path: Path,
) -> None:
    from evendp.examples.stdlib_text import CodeParagraphs

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=8))
    cfg = TrainConfig(steps=2, batch_size=6, progress=False, out_dir=tmp_path)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        Trainer(model, _Sequences(), cfg, device_ids=["cpu", "cpu"]).fit()
    padder = CodeParagraphs([torch.arange(2)], block_size=8)  # its collate pads (x, y) pairs
    report = Trainer(
        model, _Sequences(), cfg, device_ids=["cpu", "cpu"], collate_fn=padder.collate,
        count_fn=CodeParagraphs.count_tokens,
    ).fit()  # fmt: skip
    assert report.steps == 2
    assert sorted(p.name for p in tmp_path.glob("report.*")) == [
        "report.json",
        "report.png",
        "report.txt",
    ]
    with pytest.raises(EvendpError, match="collate_fn must be a function"):
        Trainer(model, _Sequences(), cfg, collate_fn=3)  # type: ignore[arg-type]
