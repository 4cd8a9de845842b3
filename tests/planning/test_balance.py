"""Balance in the evendp Trainer on 2 gloo ranks: speed, ``batch_sizes="auto"``, token budgets.

One spawn runs four trainings. Speed: rank 1 sleeps per sample in its forward; with
``TrainConfig(balance="speed")`` samples move to rank 0 and the parameters still equal one
process's on the same global batches (SGD, 1e-5). Speed resumed: the same run stopped after
``STOP`` steps and resumed goes on with the split it had saved (not the even one), says so
in ``report.json`` and ends with the same parameters. Auto: each rank plans its share from its own
declared memory (``EVENDP_MEMORY``); both ranks get the same sizes, the ones the planner gives
for those memories. Token budget: ``Trainer(costs=, max_tokens=)`` with a token-mean loss equals
one process with the same budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import evendp
from evendp._core._errors import EvendpError
from evendp._distributed._batch_plan import BatchPlan
from evendp._planning._balance import NoBalance, rank_batch_plan, sizes_from_capacities
from evendp._training._report import plot_panels
from tests._helpers import run_ranks, torchrun_env

pytestmark = pytest.mark.multiprocess

SIZES, STEPS, SLEEP = [4, 4], 8, 0.01
STOP = 4  # the speed run resumed: stopped after this step (the split has moved by step 3)
MEMORY = "128MiB,64MiB"  # unequal; CPU ranks are charged no CUDA context
AUTO_BATCH = 12
TOKENS, BUDGET, TOKEN_STEPS = 6, 20, 4  # at most 6 tokens a sample, 20 a step
TOL = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), y)


def _data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


class TokenData(torch.utils.data.Dataset):
    """Sequences of 1..TOKENS tokens, right-padded to TOKENS; label -100 on the padding."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(4)
        self.lengths = torch.randint(1, TOKENS + 1, (n,), generator=g).tolist()
        self.x = torch.randn(n, TOKENS, 8, generator=g)
        self.y = torch.randint(0, 3, (n, TOKENS), generator=g)
        for i, n_i in enumerate(self.lengths):
            self.y[i, n_i:] = -100

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def token_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model.body(x)  # (n, TOKENS, 3)
    return F.cross_entropy(logits.reshape(-1, 3), y.reshape(-1), ignore_index=-100)


def tokens(batch: Any) -> torch.Tensor:
    return (batch[1] != -100).sum()


def _config(**options: Any) -> evendp.TrainConfig:
    settings: dict[str, Any] = {"lr": 0.3, "grad_clip": None, "progress": False, "seed": 1}
    return evendp.TrainConfig(**{**settings, **options})


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _Splits(evendp.Callback):
    """The ``split/rank*`` metrics every logger gets, by step."""

    def __init__(self) -> None:
        self.logged: dict[int, list[float]] = {}

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.logged[step] = [metrics[k] for k in sorted(metrics) if k.startswith("split/")]


def _speed(rank: int) -> dict[str, Any]:
    model = Net()
    if rank == 1:  # a device at a fraction of the speed: time spent in its forward
        model.body.register_forward_pre_hook(lambda m, a: time.sleep(SLEEP * a[0].shape[0]))
    cfg = _config(
        steps=STEPS, batch_size=sum(SIZES), batch_sizes=SIZES, balance="speed", log_every=1
    )
    splits = _Splits()
    trainer = evendp.Trainer(
        model, _data(sum(SIZES) * STEPS), cfg, optimizer=_sgd(model), callbacks=[splits]
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        report = trainer.fit()
    lines = [line for line in said.getvalue().splitlines() if "speed re-split" in line]
    return {
        "params": _params(model),
        "history": trainer.balancer.history,
        "said": lines,
        "logged": splits.logged,
        "per_step": report.batch_sizes_per_step,
        "panels": [panel.__name__ for panel in plot_panels(report)],
    }


class _FirstSplit(evendp.Callback):
    """The split the first step of ``fit`` trains with (set before it, after any resume)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_fit_start(self, trainer: Any) -> None:
        self.sizes = list(trainer.sampler.batch_sizes)


def _speed_resumed(rank: int, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for steps, resume in ((STOP, False), (STEPS, True)):
        model = Net()
        if rank == 1:
            model.body.register_forward_pre_hook(lambda m, a: time.sleep(SLEEP * a[0].shape[0]))
        cfg = _config(
            steps=steps, batch_size=sum(SIZES), batch_sizes=SIZES, balance="speed",
            out_dir=out, resume=resume,
        )  # fmt: skip
        first = _FirstSplit()
        trainer = evendp.Trainer(
            model, _data(sum(SIZES) * STEPS), cfg, optimizer=_sgd(model), callbacks=[first]
        )
        trainer.fit()
        key = "resumed" if resume else "stopped"
        result[key] = {
            "first": first.sizes, "history": list(trainer.balancer.history),
            "notes": list(trainer.state.notes),
        }  # fmt: skip
    result["params"] = _params(model)
    result["last"] = trainer.sampler.batch_sizes
    if rank == 0:
        result["report"] = json.loads((out / "report.json").read_text())
    return result


def _slowed_elsewhere(rank: int, where: str) -> list[tuple[int, list[int]]]:
    """The split's history when rank 1 is slow only in its backward (per sample) or only in
    its optimizer step (a fixed time per step): parts the balancer timed no part of before
    (issue 37: it timed the forward only)."""
    model = Net()
    optimizer = _sgd(model)
    if rank == 1 and where == "backward":
        model.body.register_full_backward_hook(
            lambda m, grad_in, grad_out: time.sleep(2 * SLEEP * grad_out[0].shape[0])
        )
    if rank == 1 and where == "optimizer":
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: time.sleep(8 * SLEEP))
    cfg = _config(steps=STEPS, batch_size=sum(SIZES), batch_sizes=SIZES, balance="speed")
    trainer = evendp.Trainer(model, _data(sum(SIZES) * STEPS), cfg, optimizer=optimizer)
    with contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return list(trainer.balancer.history)


def _auto() -> dict[str, Any]:
    os.environ["EVENDP_MEMORY"] = MEMORY
    model = Net()
    cfg = _config(steps=1, batch_size=AUTO_BATCH, batch_sizes="auto", balance="speed")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        trainer = evendp.Trainer(model, _data(AUTO_BATCH), cfg, optimizer=_sgd(model))
    # The capacities bound speed balance too: each rank's planned most samples.
    caps = trainer.balancer.caps
    return {"sizes": trainer.sampler.batch_sizes, "caps": caps, "said": said.getvalue()}


def _tokens(world: int) -> list[torch.Tensor]:
    model = Net()
    data = TokenData()
    # The ranks' capacities 1:2 (their sum is the global batch), one process's 8: token steps
    sizes: dict[str, Any] = {"batch_sizes": [1, 2]} if world > 1 else {"batch_size": 8}
    cfg = _config(steps=TOKEN_STEPS, **sizes)
    evendp.Trainer(
        model, data, cfg, optimizer=_sgd(model), loss_fn=token_loss, count_fn=tokens,
        costs=data.lengths, max_tokens=BUDGET,
    ).fit()  # fmt: skip
    return _params(model)


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    evendp.init_distributed("gloo")
    result = {
        "speed": _speed(rank),
        "slow backward": _slowed_elsewhere(rank, "backward"),
        "slow optimizer": _slowed_elsewhere(rank, "optimizer"),
        "resumed": _speed_resumed(rank, Path(out) / "resumed"),
        "auto": _auto(),
        "tokens": _tokens(2),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    evendp.finish_distributed()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("balance"), 300, "balanced Trainer")


def _error(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    num = sum(float((g - w).norm() ** 2) for g, w in zip(got, want, strict=True)) ** 0.5
    return num / sum(float((w - s).norm() ** 2) for w, s in zip(want, start, strict=True)) ** 0.5


def test_speed_balance_moves_samples_and_keeps_one_process_parameters(
    ranks: list[dict[str, Any]],
) -> None:
    model = Net()
    start = _params(model)
    cfg = _config(steps=STEPS, batch_size=sum(SIZES))
    evendp.Trainer(
        model, _data(sum(SIZES) * STEPS), cfg, device_ids=["cpu"], optimizer=_sgd(model)
    ).fit()
    want = _params(model)
    for rank in ranks:
        assert _error(rank["speed"]["params"], want, start) < TOL
    history = ranks[0]["speed"]["history"]
    assert history == ranks[1]["speed"]["history"]
    sizes = history[-1][1]
    assert len(history) > 1 and sizes[1] < sizes[0] and sum(sizes) == sum(SIZES)
    # Issue 36: each re-split is said once, by rank 0, with the split it made.
    said = ranks[0]["speed"]["said"]
    assert len(said) == len(history) - 1 and ranks[1]["speed"]["said"] == [], said
    for (step, split), line in zip(history[1:], said, strict=True):
        assert line.startswith(f"evendp: step {step}: speed re-split ") and str(split) in line
    # The split each step trained with, in every logger (split/rank0, ...) and report.png.
    per_step = ranks[0]["speed"]["per_step"]
    assert len(per_step) == STEPS and per_step[-1] == sizes and per_step[0] == SIZES
    logged = ranks[0]["speed"]["logged"]
    assert [logged[step] for step in range(1, STEPS + 1)] == per_step
    assert ranks[0]["speed"]["panels"] == ["_plot_split", "_plot_loss"]


@pytest.mark.parametrize("where", ["slow backward", "slow optimizer"])
def test_a_rank_slow_only_in_backward_or_in_its_optimizer_step_gets_fewer_samples(
    ranks: list[dict[str, Any]], where: str
) -> None:
    """The balancer times the whole step where the default DDP runs it alone (forward,
    backward, the optimizer step; not the all-reduce, which waits for the slowest rank)."""
    history = ranks[0][where]
    assert history == ranks[1][where]  # every rank alike
    sizes = history[-1][1]
    # Far past timing noise (forward-only timing drifted to [5, 3] at most, by chance): the
    # slowdown is tens of times the step's compute.
    assert len(history) > 1 and sizes[1] <= 2 and sum(sizes) == sum(SIZES), history


def test_a_resumed_speed_run_goes_on_with_its_saved_split(ranks: list[dict[str, Any]]) -> None:
    stopped, resumed = ranks[0]["resumed"]["stopped"], ranks[0]["resumed"]["resumed"]
    saved = stopped["history"][-1][1]
    assert stopped["first"] == SIZES and saved != SIZES  # it moved before the stop
    assert resumed["first"] == saved  # the first resumed step: the saved split, not the even
    # ... and the data position restored after it sees that split: no note says otherwise.
    assert not any("was split" in note for note in resumed["notes"]), resumed["notes"]
    assert resumed["history"][: len(stopped["history"])] == stopped["history"]
    assert ranks[1]["resumed"]["resumed"] == resumed  # every rank alike
    # report.json: each resumed step's per-rank sizes, from the saved split on.
    per_step = ranks[0]["resumed"]["report"]["batch_sizes_per_step"]
    assert len(per_step) == STEPS - STOP and per_step[0] == saved
    assert per_step[-1] == ranks[0]["resumed"]["last"]
    # Stopped, resumed and re-split, the parameters are still one process's.
    model = Net()
    start = _params(model)
    cfg = _config(steps=STEPS, batch_size=sum(SIZES))
    evendp.Trainer(
        model, _data(sum(SIZES) * STEPS), cfg, device_ids=["cpu"], optimizer=_sgd(model)
    ).fit()
    for rank in ranks:
        assert _error(rank["resumed"]["params"], _params(model), start) < TOL


def test_auto_batch_sizes_are_planned_per_rank_and_the_same_everywhere(
    ranks: list[dict[str, Any]],
) -> None:
    auto = ranks[0]["auto"]
    said = auto.pop("said")
    assert ranks[1]["auto"].pop("said") == ""  # said once, by rank 0
    assert ranks[1]["auto"] == auto  # the same sizes and capacities on every rank
    caps, sizes = auto["caps"], auto["sizes"]
    # issue 36: the chosen sizes are printed, not only used
    assert f"batch_sizes='auto' planned {sizes} per rank for a global batch of {AUTO_BATCH}" in said
    assert f"the most each holds: {caps}" in said
    assert caps[0] > caps[1] > 0  # each rank planned on its own memory: more, more samples
    assert sizes == sizes_from_capacities(caps, AUTO_BATCH)
    assert sum(sizes) == AUTO_BATCH and sizes[0] > sizes[1]


def test_token_budget_steps_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    start = _params(Net())
    want = _tokens(1)
    for rank in ranks:
        assert _error(rank["tokens"], want, start) < TOL


def test_one_process_and_bad_options() -> None:
    sampler = evendp.UnevenBatchSampler(8, [8], rank=0)
    with pytest.warns(UserWarning, match="balance='speed' is ignored in one process"):
        trainer = evendp.Trainer(
            Net(), _data(8), _config(balance="speed", batch_size=8), device_ids=["cpu"]
        )
    assert isinstance(trainer.balancer, NoBalance)  # one process: no ranks to balance
    assert rank_batch_plan(None, 9, 2, model=Net, example=list).sizes == (5, 4)
    assert sampler.batch_sizes == [8]
    with pytest.raises(evendp.EvendpError, match="balance='fast' is not a balance"):
        _config(balance="fast")
    with pytest.raises(evendp.EvendpError, match="expected 'auto'"):
        _config(batch_sizes="max")


def test_the_launchers_sizes_are_the_plan_unless_the_config_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51: the Trainer under ``evendp launch --batch-sizes 12,4`` trained an even split
    of its own batch. The launcher's plan (caps too) is the run's, read (the launcher does not
    warn); sizes or a global batch in the config that contradict it are refused, naming both."""
    from evendp._core._defaults import NotGiven
    from evendp._distributed import _launch_notes

    monkeypatch.setattr(_launch_notes, "_read_here", False)
    launched = BatchPlan((12, 4), caps=(20, 8))

    def plan(sizes: object, batch: int) -> BatchPlan:
        return rank_batch_plan(sizes, batch, 2, model=Net, example=list, launched=launched)  # type: ignore[arg-type]

    assert plan(None, NotGiven(32)) == launched and _launch_notes.sizes_read_here()
    assert plan([12, 4], NotGiven(16)) == launched
    assert plan(None, 16) == launched  # the global batch given, and their sum
    fix = "drop it to train the launcher's EVENDP_BATCH_SIZES=12,4, or start the launcher with"
    for sizes, batch, said in (
        ([8, 8], NotGiven(16), "TrainConfig(batch_sizes=[8, 8]) contradicts"),
        ("auto", NotGiven(32), "TrainConfig(batch_sizes='auto') contradicts"),
        (None, 32, "TrainConfig(batch_size=32) contradicts the launcher's batch sizes [12, 4] "
                   "(16 a step); "),
    ):  # fmt: skip
        with pytest.raises(EvendpError) as refused:
            plan(sizes, batch)
        assert str(refused.value).startswith(said) and fix in str(refused.value)


def test_a_configs_own_sizes_win_over_the_launchers_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``evendp launch --nproc 2 script.py`` with no --batch, --batch-sizes or --model exports
    an even split of its default batch: a script whose config gives sizes or a batch of its
    own trains those (the launcher's split was a guess, not the user's), and the launcher is
    told they were read; without the launcher's default mark they are refused as above."""
    from evendp._core._defaults import NotGiven
    from evendp._distributed import _launch_notes
    from evendp._distributed._launch_notes import ENV_BATCH_DEFAULTED

    monkeypatch.setattr(_launch_notes, "_read_here", False)
    launched = BatchPlan((16, 16))

    def plan(sizes: object, batch: int) -> BatchPlan:
        return rank_batch_plan(sizes, batch, 2, model=Net, example=list, launched=launched)  # type: ignore[arg-type]

    monkeypatch.setenv(ENV_BATCH_DEFAULTED, "1")
    assert plan([2, 3], NotGiven(5)).sizes == (2, 3) and _launch_notes.sizes_read_here()
    assert plan(None, 12).sizes == (6, 6)
    assert plan(None, NotGiven(32)) == launched  # nothing of its own: the launcher's
    monkeypatch.delenv(ENV_BATCH_DEFAULTED)
    with pytest.raises(EvendpError, match=r"batch_sizes=\[2, 3\]\) contradicts"):
        plan([2, 3], NotGiven(5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU rank's planning (no CUDA here)")
def test_auto_sizes_on_cpu_budgets_charge_no_cuda_context_and_a_small_budget_says_so() -> None:
    """Issue 36: batch_sizes="auto" with declared budgets of 24MiB on CPU ranks failed with
    "capacities [0, 0]": a 512 MiB CUDA context was charged to a CPU device. A budget too small
    with a context given names the allowance and how to change it."""
    from transformers import GPT2LMHeadModel

    from evendp._planning._balance import auto_batch_sizes
    from tests._helpers import tiny_gpt2_config

    def model() -> nn.Module:
        return GPT2LMHeadModel(tiny_gpt2_config())

    ids = torch.randint(0, 64, (1, 16))
    batch = {"input_ids": ids, "labels": ids}
    sizes, caps = auto_batch_sizes(model, batch, global_batch=8, memory="24MiB")
    assert sizes == [8] and caps[0] >= 8
    with pytest.raises(evendp.PlanError) as info:
        auto_batch_sizes(model, batch, global_batch=8, memory="24MiB", cuda_context="512MiB")
    message = str(info.value)
    assert "capacities [0]" in message and "512.0 MiB for the CUDA context" in message, message
    assert "cuda_context=, --context" in message and "\n" not in message


# --- one process: "auto" over the devices -------------------------------------------------


def test_one_processs_auto_is_the_planners_split_for_the_declared_memory() -> None:
    """One meaning of "auto" (issue 33): in one process, the planner's dp split over each
    device's memory, the same as evendp.plan gives; CPU devices without a declaration split
    evenly and say how to plan them; a spec of the wrong length names the fix."""
    import evendp
    from evendp._planning._balance import device_sizes_for_memory

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    cpu = [torch.device("cpu")] * 2
    example = torch.randn(1, 64)
    sizes, source = device_sizes_for_memory(net, example, cpu, 1024, memory="3MiB,1500KiB")
    want = evendp.plan(net, example, "3MiB,1500KiB", mode="dp", batch_size=1024, cuda_context=0)
    assert sizes == list(want.split) and sizes[0] > sizes[1] and sum(sizes) == 1024
    assert source == "declared memory 3MiB,1500KiB"
    even, note = device_sizes_for_memory(net, example, cpu, 1024, environ={})
    assert even == [512, 512] and "EVENDP_MEMORY" in note
    with pytest.raises(evendp.EvendpError, match="3 entries for 2 devices"):
        device_sizes_for_memory(net, example, cpu, 1024, memory="1MiB,1MiB,1MiB")
