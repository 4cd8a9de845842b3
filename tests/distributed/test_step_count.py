"""No hidden cost per step: the progress bar's loss and the global token count under DDP.

Two gloo ranks (spawned once) train a tiny token model with ``count_fn`` under plain DDP
(``oom_resplit=False``: the loss parts are per rank, so showing a loss is a collective), with
the progress bar on and off, recording every ``torch.distributed.all_reduce`` call. The bar
may read the loss only on display steps, the count's all-reduce must be started
asynchronously (it overlaps the forward), and ``report.json`` must still hold every step's
exact loss: equal to one process on the same global batches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from evendp import TrainConfig, Trainer
from evendp._distributed._group import finish_distributed
from evendp._training._recorder import display_due
from evendp._training._step import StepWeight
from tests._helpers import run_ranks
from tests.training.test_trainer_cost import Lines, TokenLM, tokens

STEPS, LOG_EVERY = 12, 5
SIZES = [3, 5]
LENGTHS = [2, 7, 3, 5, 1, 6, 4, 2] * 4  # 32 rows: 4 steps of 8 per epoch, 3 epochs


def _config(out: Path | None, progress: bool, **kw: Any) -> TrainConfig:
    return TrainConfig(
        steps=STEPS, lr=0.05, grad_clip=None, progress=progress, log_every=LOG_EVERY,
        out_dir=out, **kw,
    )  # fmt: skip


def _fit_recording(out: Path, progress: bool, rank: int, **kw: Any) -> list[tuple[str, bool]]:
    """One DDP run; every all_reduce call as (dtype, async_op)."""
    calls: list[tuple[str, bool]] = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((str(tensor.dtype), bool(kwargs.get("async_op", False))))
        return original(tensor, *args, **kwargs)

    torch.manual_seed(0)
    model = TokenLM()
    cfg = _config(out, progress, batch_sizes=SIZES, oom_resplit=False)
    trainer = Trainer(model, Lines(LENGTHS, seed=0), cfg, count_fn=tokens, **kw)
    dist.all_reduce = recording  # type: ignore[assignment]
    try:
        trainer.fit()
    finally:
        dist.all_reduce = original
    return calls


class _StepsLogged:
    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    found = {
        "on": _fit_recording(Path(out) / "on", progress=True, rank=rank),
        "off": _fit_recording(Path(out) / "off", progress=False, rank=rank),
        # Each row's count of real targets is its length: the global count needs no comm.
        "counts": _fit_recording(Path(out) / "counts", progress=True, rank=rank, counts=LENGTHS),
    }
    # A logger on rank 0 alone: the ranks agree at the start that the loss is read on the
    # logged steps, so rank 1 joins every read (without it: rank 0 waits there forever).
    logged: list[int] = []
    hooks = [_StepsLogged(logged)] if rank == 0 else None
    found["rank0_logs"] = _fit_recording(
        Path(out) / "rank0_logs", progress=False, rank=rank, callbacks=hooks
    )
    found["logged"] = logged
    torch.save(found, Path(out) / f"rank{rank}.pt")
    # The trainers' DDP wrappers hold the group (reference cycles keep them until a collection):
    # finish_distributed frees them while the group is alive (no late teardown in gloo).
    finish_distributed()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("step_count")
    return out, run_ranks(_worker, 2, out, 150, "step-cost workers")


@pytest.mark.multiprocess
def test_progress_reads_the_loss_only_on_display_steps(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    shown = [s for s in range(1, STEPS + 1) if display_due(s, 0, STEPS, LOG_EVERY)]
    assert len(shown) < STEPS
    for r in results:
        # With the bar off, the losses are summed once (the report); with it on, once per
        # display step. Before: once per step, 11 more collectives than with the bar off.
        extra = len(r["on"]) - len(r["off"])
        assert extra == len(shown) - 1


@pytest.mark.multiprocess
def test_callbacks_on_one_rank_read_the_loss_on_every_rank(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    shown = [s for s in range(1, STEPS + 1) if display_due(s, 0, STEPS, LOG_EVERY)]
    assert results[0]["logged"] == shown and results[1]["logged"] == []
    assert len(results[0]["rank0_logs"]) == len(results[1]["rank0_logs"])
    assert len(results[0]["rank0_logs"]) == len(results[0]["on"])


@pytest.mark.multiprocess
def test_the_token_count_all_reduce_is_overlapped(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    for r in results:
        started = [dtype for dtype, overlapped in r["on"] if overlapped]
        assert started == ["torch.float64"] * STEPS  # each step's count, started async


@pytest.mark.multiprocess
def test_report_json_holds_every_steps_exact_loss(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, _ = ranks
    torch.manual_seed(0)
    model = TokenLM()
    one = Trainer(
        model,
        Lines(LENGTHS, seed=0),
        _config(None, False, batch_size=sum(SIZES)),
        device_ids=["cpu"],
        count_fn=tokens,
    ).fit()
    for run in ("on", "off", "counts"):
        losses = json.loads((out / run / "report.json").read_text())["losses"]
        assert len(losses) == STEPS
        for ours, ref in zip(losses, one.losses, strict=True):
            assert abs(ours - ref) <= 1e-5 * abs(ref)


@pytest.mark.multiprocess
def test_per_sample_counts_take_the_count_all_reduce_away(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    for r in results:
        assert not any(overlapped for _, overlapped in r["counts"])
        assert len(r["counts"]) == len(r["on"]) - STEPS  # one collective fewer per step


def test_counts_need_count_fn_and_one_count_per_sample() -> None:
    data = Lines(LENGTHS, seed=0)
    cfg = _config(None, False, batch_size=8)
    with pytest.raises(ValueError, match="count_fn=None"):
        Trainer(TokenLM(), data, cfg, device_ids=["cpu"], counts=LENGTHS)
    with pytest.raises(ValueError, match="one count >= 0 per sample"):
        Trainer(TokenLM(), data, cfg, device_ids=["cpu"], count_fn=tokens, counts=[1, 2])


def test_step_weight_without_a_process_group_is_the_synchronous_weight() -> None:
    weight = StepWeight.ready(2, torch.tensor(6.0, dtype=torch.float64))
    assert weight.wait().dtype == torch.float32
    assert float(weight.wait()) == pytest.approx(2 / 6)


def test_log_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_every"):
        TrainConfig(log_every=0)
