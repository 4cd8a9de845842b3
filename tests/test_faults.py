"""Training state survives faults, in the library (gloo): per-rank RNG through the previous
checkpoint, stop flags agreed over ranks, FSDP2 through torch.distributed.checkpoint.

One pair of processes runs every two-rank scenario; one trio resumes the pair's FSDP2
checkpoint on three ranks with other per-rank batch sizes (the same global batch).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from evendp._checkpoint import load_checkpoint, previous_path
from evendp._trainer import TrainConfig, Trainer
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.stdlib_text import CharWindows
from tests._helpers import run_ranks

V, BLOCK = 11, 8


def _data() -> CharWindows:
    g = torch.Generator().manual_seed(3)
    return CharWindows(torch.randint(0, V, (600,), generator=g), block_size=BLOCK)


def _gpt(dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(V, BLOCK, n_layer=2, n_head=2, n_embd=16, dropout=dropout))


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _fit(model: nn.Module, loss_fn: Any = None, **config: Any) -> Any:
    config.setdefault("batch_sizes", [5, 3])
    cfg = TrainConfig(lr=1e-2, progress=False, **config)
    return Trainer(model, _data(), cfg, loss_fn=loss_fn or _loss).fit()


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1]


def _signal_at(call: int, rank: int, signum: int) -> Any:
    """A loss that sends ``signum`` to its own process on rank ``rank``'s ``call``-th forward."""
    calls = {"n": 0}

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == call and dist.get_rank() == rank:
            os.kill(os.getpid(), signum)  # lands inside the step, mid-forward
        return _loss(model, batch)

    return loss


def _pair_worker(rank: int, port: int, out: str) -> None:
    _init(rank, 2, port)
    root, results = Path(out), {}
    # 1. DDP with dropout: steps = 3 * checkpoint_every; then resume from ckpt.prev.pt.
    ddp = root / "ddp"
    results["ddp_straight"] = _fit(_gpt(0.2), steps=9).losses
    results["ddp_first"] = _fit(_gpt(0.2), steps=6, out_dir=ddp, checkpoint_every=2).losses
    dist.barrier()
    if rank == 0:
        results["prev_step"] = load_checkpoint(previous_path(ddp / "ckpt.pt"), model=_gpt(0.2))[
            "step"
        ]
        (ddp / "ckpt.pt").unlink()  # as if the latest were lost: resume from the previous one
    dist.barrier()
    results["ddp_resumed"] = _fit(_gpt(0.2), steps=9, out_dir=ddp, resume=True).losses
    # 2. A signal on one rank: every rank stops after the same step and saves (both DDPs).
    for safe, signum in ((True, signal.SIGINT), (False, signal.SIGTERM)):
        where = root / f"stop-{safe}"
        report = _fit(
            _gpt(0.0), steps=20, out_dir=where, oom_resplit=safe,
            loss_fn=_signal_at(4, rank=1, signum=signum),
        )  # fmt: skip
        results[f"stop_{safe}"] = (report.steps, report.interrupted, report.signal)
        results[f"stop_{safe}_saved"] = _saved_step(where, rank)
    results["handlers"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # 3. FSDP2: 12 steps straight; 6 steps then resume to 12 on the same two ranks.
    fsdp = root / "fsdp"
    results["fsdp_straight"] = _fit(_gpt(0.0), steps=12, strategy="fsdp2").losses
    first = _fit(_gpt(0.0), steps=6, strategy="fsdp2", out_dir=fsdp, checkpoint_every=4)
    results["fsdp_first"] = first.losses
    dist.barrier()
    if rank == 0:
        results["fsdp_files"] = sorted(p.name for p in fsdp.iterdir())
        shutil.copytree(fsdp, root / "fsdp-for-three")
    dist.barrier()
    resumed = _fit(_gpt(0.0), steps=12, strategy="fsdp2", out_dir=fsdp, resume=True)
    results["fsdp_resumed"] = resumed.losses
    torch.save(results, root / f"rank{rank}.pt")
    dist.destroy_process_group()


def _saved_step(where: Path, rank: int) -> int:
    dist.barrier()
    if rank == 0:
        return int(torch.load(where / "ckpt.pt", weights_only=True)["step"])
    return int(torch.load(where / f"ckpt.rng{rank}.pt", weights_only=True)["step"])


def _trio_worker(rank: int, port: int, out: str) -> None:
    _init(rank, 3, port)
    where = Path(out).parent / "pair" / "fsdp-for-three"
    with pytest.warns(UserWarning, match="no RNG state for this rank") if rank == 2 else _nothing():
        report = _fit(
            _gpt(0.0), steps=12, strategy="fsdp2", out_dir=where, resume=True,
            batch_sizes=[3, 3, 2],
        )  # fmt: skip
    torch.save({"fsdp_resumed": report.losses}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("faults") / "pair"
    out.mkdir()
    return out, run_ranks(_pair_worker, 2, out, 240, "fault scenarios (2 ranks)")


def _close(a: list[float], b: list[float], rtol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rtol * abs(y), (a, b)


def test_a_last_step_that_also_checkpoints_is_saved_once(pair: tuple[Path, list[Any]]) -> None:
    _, (r0, _) = pair
    assert r0["prev_step"] == 4  # 6 steps, every 2: the previous is step 4, not a copy of 6


def test_resume_from_the_previous_checkpoint_restores_each_ranks_dropout(
    pair: tuple[Path, list[Any]],
) -> None:
    _, (r0, r1) = pair
    assert r0["ddp_resumed"] == r1["ddp_resumed"]
    assert r0["ddp_resumed"][:4] == r0["ddp_first"][:4]
    _close(r0["ddp_resumed"], r0["ddp_straight"], 1e-5)


@pytest.mark.parametrize("safe", [True, False], ids=["oom-safe-ddp", "ddp"])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(
    pair: tuple[Path, list[Any]], safe: bool
) -> None:
    _, (r0, r1) = pair
    signum = int(signal.SIGINT if safe else signal.SIGTERM)
    # Rank 1 is signalled inside step 4's forward: step 4 completes everywhere, then all stop.
    assert r0[f"stop_{safe}"] == r1[f"stop_{safe}"] == (4, True, signum)
    assert r0[f"stop_{safe}_saved"] == r1[f"stop_{safe}_saved"] == 4
    assert r0["handlers"] and r1["handlers"]  # the previous SIGINT handler is back


def test_fsdp2_resumes_the_same_curve_on_the_same_world_size(
    pair: tuple[Path, list[Any]],
) -> None:
    _, (r0, r1) = pair
    assert "ckpt.dcp" in r0["fsdp_files"] and "ckpt.prev.dcp" in r0["fsdp_files"]
    assert not [f for f in r0["fsdp_files"] if f.endswith(".tmp")]
    assert r0["fsdp_first"] == r0["fsdp_straight"][:6]
    assert r0["fsdp_resumed"] == r1["fsdp_resumed"]
    _close(r0["fsdp_resumed"], r0["fsdp_straight"], 1e-5)


def test_fsdp2_resumes_on_three_ranks_with_other_batch_sizes(
    pair: tuple[Path, list[Any]],
) -> None:
    out, (r0, _) = pair
    trio = out.parent / "trio"
    trio.mkdir()
    results = run_ranks(_trio_worker, 3, trio, 240, "FSDP2 resume on 3 ranks")
    losses = results[0]["fsdp_resumed"]
    assert losses[:6] == r0["fsdp_first"]
    # Same global batch, same samples per step: the curve continues up to reduction order.
    _close(losses, r0["fsdp_straight"], 1e-4)
