"""Training state survives faults, in the library (gloo): per-rank RNG through the previous
checkpoint, stop flags agreed over ranks, FSDP2 through torch.distributed.checkpoint.

One pair of processes runs every two-rank scenario; one trio resumes the pair's FSDP2
checkpoint on three ranks with other per-rank batch sizes (the same global batch).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from evendp._distributed._group import finish_distributed
from evendp._training._checkpoint import load_checkpoint, previous_path
from evendp._training._trainer import TrainConfig, Trainer
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.stdlib_text import CharWindows
from tests._helpers import fill_disk, run_ranks

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
    results["ddp_data"] = _own_data(rank, ddp)
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
    results.update(_fault_scenarios(rank, root, fsdp, ddp))
    torch.save(results, root / f"rank{rank}.pt")
    finish_distributed()


def _own_data(rank: int, where: Path) -> tuple[Any, Any, list[str]]:
    """This rank's data position as its own file holds it, and as a resume restored it."""
    saved = torch.load(where / f"ckpt.rng{rank}.pt", weights_only=True).get("data")
    cfg = TrainConfig(lr=1e-2, progress=False, batch_sizes=[5, 3], steps=9, out_dir=where)
    trainer = Trainer(_gpt(0.2), _data(), cfg, loss_fn=_loss)
    trainer.resume()
    return saved, trainer._checkpointed()["data"].state_dict(), trainer.state.notes


def _outcome(action: Any) -> tuple[str, str]:
    """What ``action()`` ended with: ("ok", notes) or (the exception's class, its message)."""
    try:
        trainer = action()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", " | ".join(trainer.state.notes)


def _resume(model: nn.Module, where: Path, steps: int, strategy: str, **config: Any) -> Any:
    cfg = TrainConfig(
        lr=1e-2, progress=False, batch_sizes=[5, 3], steps=steps, out_dir=where, resume=True,
        strategy=strategy, **config,  # type: ignore[arg-type]
    )  # fmt: skip
    trainer = Trainer(model, _data(), cfg, loss_fn=_loss)
    trainer.fit()
    return trainer


def _break(folder: Path, fault: str) -> None:
    shards = sorted(folder.glob("*.distcp"))
    if fault == "missing-shard":
        shards[-1].unlink()
    elif fault == "truncated-shard":
        data = shards[0].read_bytes()
        shards[0].write_bytes(data[: len(data) // 3])
    elif fault == "missing-metadata":
        (folder / ".metadata").unlink()
    elif fault in ("fifo-metadata", "fifo-shard"):  # no writer ever comes: a read would hang
        where = folder / ".metadata" if fault == "fifo-metadata" else shards[0]
        where.unlink()
        os.mkfifo(where)
    elif fault == "hostile-metadata":  # a pickle that would run code on every rank (issue 28)
        with (folder / ".metadata").open("wb") as f:
            pickle.dump(_Touch(folder.parent / "marker"), f)


class _Touch:
    """Unpickles into ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


#: Each breaks the latest FSDP2 checkpoint; the resume falls back to the previous one.
_SHARD_FAULTS = ("missing-shard", "truncated-shard", "missing-metadata", "hostile-metadata",
                 "fifo-metadata", "fifo-shard")  # fmt: skip


def _fault_scenarios(rank: int, root: Path, fsdp: Path, ddp: Path) -> dict[str, Any]:
    """Every fault one line, the same on both ranks, the previous checkpoint used or intact."""
    results: dict[str, Any] = {}
    for fault in (*_SHARD_FAULTS, "both-bad"):
        where = root / f"fault-{fault}"
        if rank == 0:
            shutil.copytree(fsdp, where)
            _break(where / "ckpt.dcp", "missing-metadata" if fault == "both-bad" else fault)
            if fault == "both-bad":
                _break(where / "ckpt.prev.dcp", "missing-metadata")
        dist.barrier()
        results[f"fsdp_{fault}"] = _outcome(partial(_resume, _gpt(0.0), where, 14, "fsdp2"))
        results[f"fsdp_{fault}_marker"] = (where / "marker").exists()
    where = root / "fault-wider"
    if rank == 0:
        shutil.copytree(fsdp, where)
    dist.barrier()
    wider = GPT(GPTConfig(V, BLOCK, n_layer=2, n_head=2, n_embd=24))
    results["fsdp_wider"] = _outcome(partial(_resume, wider, where, 14, "fsdp2"))
    # DDP: a garbled ckpt.rng1.pt stops both ranks with one message (no hang, no reseed).
    where = root / "fault-rng"
    if rank == 0:
        shutil.copytree(ddp, where)
        (where / "ckpt.rng1.pt").write_bytes(b"garbled")
        (where / "ckpt.prev.rng1.pt").unlink(missing_ok=True)
    dist.barrier()
    results["ddp_rng"] = _outcome(partial(_resume, _gpt(0.2), where, 12, "ddp"))
    disk = root / "disk"
    if (disk / "mounted").exists():
        for mode in ("ddp", "fsdp2"):
            where = disk / mode
            _resume(_gpt(0.0), where, 2, mode, checkpoint_every=1)  # two good checkpoints
            dist.barrier()
            if rank == 0:
                fill_disk(disk / "filler")  # the disk is full from now on
            dist.barrier()
            run = partial(_resume, _gpt(0.0), where, 4, mode, checkpoint_every=1)
            results[f"disk_{mode}"] = _outcome(run)
            dist.barrier()
            if rank == 0:
                results[f"disk_{mode}_files"] = sorted(p.name for p in where.iterdir())
                (disk / "filler").unlink()
                shutil.rmtree(where, ignore_errors=True)
            dist.barrier()
    return results


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
    finish_distributed()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import subprocess

    out = tmp_path_factory.mktemp("faults") / "pair"
    disk = out / "disk"
    disk.mkdir(parents=True)
    # A real full disk: a small tmpfs, filled up by the workers between two saves.
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0
    if mounted:
        (disk / "mounted").touch()
    yield out, run_ranks(_pair_worker, 2, out, 240, "fault scenarios (2 ranks)")
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


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


def test_each_rank_resumes_its_own_data_position(pair: tuple[Path, list[Any]]) -> None:
    _, ranks = pair
    for rank, results in enumerate(ranks):
        saved, restored, notes = results["ddp_data"]
        assert saved == {"rank": rank, "epoch": 0, "batch_in_epoch": 9, "batch_sizes": [5, 3]}
        assert restored == saved and notes[-1].endswith("at step 9"), notes


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


def test_fsdp2_shard_faults_fall_back_to_the_previous_checkpoint_in_one_line(
    pair: tuple[Path, list[Any]],
) -> None:
    _, (r0, r1) = pair
    for fault in _SHARD_FAULTS:
        kind, notes = r0[f"fsdp_{fault}"]
        assert kind == "ok", (fault, notes)
        assert "ckpt.dcp" in notes and "fell back" in notes and "ckpt.prev.dcp at step 6" in notes
        assert r1[f"fsdp_{fault}"][0] == "ok"
        assert not r0[f"fsdp_{fault}_marker"] and not r1[f"fsdp_{fault}_marker"]  # ran nothing
    assert "refused: .metadata: it names 'posix.system'" in r0["fsdp_hostile-metadata"][1]
    for fault in ("fifo-metadata", "fifo-shard"):  # issue 34: these hung the run
        assert "a FIFO, not a regular file" in r0[f"fsdp_{fault}"][1], r0[f"fsdp_{fault}"]
    kind, message = r0["fsdp_both-bad"]
    assert kind == "CorruptCheckpoint" and r1["fsdp_both-bad"] == r0["fsdp_both-bad"]
    assert "ckpt.dcp" in message and "ckpt.prev.dcp" in message and "\n" not in message
    assert "prev.prev" not in message
    kind, message = r0["fsdp_wider"]  # another model size: bad input, no fallback
    assert kind == "CheckpointError" and r1["fsdp_wider"] == r0["fsdp_wider"]
    assert "does not match the model" in message and "shape mismatches" in message


def test_a_garbled_rank_rng_file_stops_every_rank_with_one_message(
    pair: tuple[Path, list[Any]],
) -> None:
    _, (r0, r1) = pair
    assert r0["ddp_rng"] == r1["ddp_rng"]  # both ranks: no hang, the same one line
    kind, message = r0["ddp_rng"]
    assert kind == "CorruptCheckpoint" and "ckpt.rng1.pt" in message and "delete it" in message


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_full_disk_under_ddp_and_fsdp2_is_one_line_on_every_rank(
    pair: tuple[Path, list[Any]], mode: str
) -> None:
    _, (r0, r1) = pair
    if f"disk_{mode}" not in r0:
        pytest.skip("no tmpfs could be mounted here (needs root)")
    assert r0[f"disk_{mode}"] == r1[f"disk_{mode}"]
    kind, message = r0[f"disk_{mode}"]
    assert kind == "TrainingError" and "No space left on device" in message, message
    files = r0[f"disk_{mode}_files"]
    assert not [f for f in files if f.endswith(".tmp")], files  # no temporary file left
    assert ("ckpt.dcp" if mode == "fsdp2" else "ckpt.pt") in files  # the previous one stays
