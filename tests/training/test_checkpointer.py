"""The checkpointer: the run's named parts in the file layout every evendp wrote, the speed
balancer's split among them, and a part's hostile saved state treated as a corrupt file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from evendp._core._digest import content_digest
from evendp._planning._speed import SpeedBalancer
from evendp._training._checkpoint import CorruptCheckpoint, previous_path
from evendp._training._checkpointer import Checkpointer, DcpShards, WholeFile
from evendp._training._oom import OomResplit
from evendp._training._recorder import TrainState
from evendp._training._stateful import OomCaps, PerRank, RngState
from evendp._training._strategies._ddp import OomSafeDDP
from evendp._training._strategies._fsdp2 import FSDP2
from evendp._training._trainer import TrainConfig, Trainer
from tests._other_user import needs_root
from tests.training.test_trainer import TinyLM, _data

# What ckpt.pt has held since checkpoints had a digest: a stable surface (files in --out).
PAYLOAD_KEYS = [
    "extra", "format", "model", "optimizer", "rng", "scaler", "scheduler", "sha256", "step",
    "version",
]  # fmt: skip
# The keys older evendp wrote, and "nonfinite" (the gate's counters, a part since issue 26).
EXTRA_KEYS = [
    "batch_in_epoch", "epoch", "global_batch", "losses", "micro_batch_sizes", "mode",
    "nonfinite", "resplits", "samples", "skipped",
]  # fmt: skip


def _balancer(sizes: list[int] | None = None, timings: Any = None) -> SpeedBalancer:
    """A rank-0 balancer of 2 ranks; ``timings``: every rank's fixed (seconds, samples)."""
    gather = None if timings is None else (lambda mine: timings)
    return SpeedBalancer(sizes or [4, 4], warmup=2, gather=gather)


def _parts(net: torch.nn.Module, balancer: SpeedBalancer, steps: int = 0) -> dict[str, Any]:
    guard = OomResplit(catch=True, devices=1)
    return {
        "model": net,
        "train": TrainState(devices=1, step=steps),
        "rng": RngState(),
        "guard": OomCaps(guard),
        "balancer": balancer,
        "scheduler": None,  # absent: not saved, not loaded
    }


def test_a_trainer_checkpoint_keeps_every_key_older_evendp_wrote(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=2, batch_size=8, out_dir=tmp_path, progress=False)
    Trainer(TinyLM(), _data(), cfg, device_ids=["cpu", "cpu"]).fit()
    payload = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert sorted(payload) == PAYLOAD_KEYS
    assert sorted(payload["extra"]) == EXTRA_KEYS  # no balance: no balancer part
    assert payload["step"] == 2 and payload["extra"]["samples"] == [8, 8]


def test_the_strategy_supplies_the_format() -> None:
    assert isinstance(OomSafeDDP.checkpoint_format, WholeFile)
    assert isinstance(FSDP2.checkpoint_format, DcpShards)
    assert (WholeFile.name, DcpShards.name) == ("ckpt.pt", "ckpt.dcp")


def test_the_speed_split_round_trips_and_a_resumed_balancer_does_not_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt.pt"
    balancer = _balancer(timings=[(0.4, 4), (1.2, 4)])  # rank 1 three times slower
    for _ in range(3):
        balancer.step()
    assert balancer.batch_sizes == [6, 2]
    Checkpointer(WholeFile()).save(path, _parts(torch.nn.Linear(2, 1), balancer, steps=3))
    assert torch.load(path, weights_only=True)["extra"]["balancer"]["batch_sizes"] == [6, 2]

    # Resumed, rank 1 is 0.1 s a sample, rank 0 0.07: fresh times would re-split at once.
    fresh = _balancer(timings=[(0.4, 6), (0.2, 2)])
    parts = _parts(torch.nn.Linear(2, 1), fresh)
    notes = Checkpointer(WholeFile()).resume(path, parts)
    assert notes == [f"resumed from {path} at step 3"]
    assert fresh.batch_sizes == [6, 2] and parts["train"].step == 3
    assert (fresh.steps, fresh.history) == (3, balancer.history)
    assert fresh.seconds_per_sample == balancer.seconds_per_sample
    # Its first step in this process is not measured, then it goes on from its saved times:
    # no warm-up from the even split again.
    assert [fresh.step(), fresh.step()] == [False, False]  # median of 3 still says slow
    assert fresh.sizes_at(4) == [6, 2]


def test_a_split_for_other_ranks_is_not_applied_and_said(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    three = SpeedBalancer([3, 3, 2])
    Checkpointer(WholeFile()).save(path, _parts(torch.nn.Linear(2, 1), three))
    two = _balancer()
    notes = Checkpointer(WholeFile()).resume(path, _parts(torch.nn.Linear(2, 1), two))
    assert notes is not None and "is for 3 ranks" in notes[-1] and "not applied" in notes[-1]
    assert two.batch_sizes == [4, 4] and two.steps == 0


def _tamper(path: Path, **balancer: Any) -> None:
    payload = torch.load(path, weights_only=True)
    payload["extra"]["balancer"].update(balancer)
    del payload["sha256"]
    payload["sha256"] = content_digest(payload)  # whoever wrote it recomputed the digest
    torch.save(payload, path)


def test_a_hostile_balancer_state_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    path, net = tmp_path / "ckpt.pt", torch.nn.Linear(2, 1)
    checkpointer = Checkpointer(WholeFile())
    checkpointer.save(path, _parts(net, _balancer([5, 3]), steps=1))
    checkpointer.save(path, _parts(net, _balancer([6, 2]), steps=2))
    _tamper(path, batch_sizes="__import__('os')")
    fresh = _balancer()
    notes = Checkpointer(WholeFile()).resume(path, _parts(net, fresh))
    assert notes is not None and "field balancer: batch_sizes" in notes[0]
    assert "fell back" in notes[0] and f"resumed from {previous_path(path)} at step 1" in notes
    assert fresh.batch_sizes == [5, 3]
    _tamper(previous_path(path), recent=[[float("nan")], [1.0]])
    with pytest.raises(CorruptCheckpoint, match="field balancer: recent") as caught:
        Checkpointer(WholeFile()).resume(path, _parts(net, _balancer()))
    assert "\n" not in str(caught.value) and "ckpt.prev.pt" in str(caught.value)


class _Count:
    """A rank's own counter, a per-rank part: what it saved and what it was given back."""

    def __init__(self, value: int) -> None:
        self.value, self.loaded = value, None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict["value"]


def _ranked(rank: int, count: _Count, steps: int = 0) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(2, 1), "train": TrainState(devices=2, step=steps),
            "rng": PerRank(RngState(reseed=rank)), "count": PerRank(count)}  # fmt: skip


def test_each_rank_saves_its_per_rank_parts_in_its_own_file_and_restores_its_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt.pt"
    for rank in (0, 1):
        Checkpointer(WholeFile(), rank=rank).save(path, _ranked(rank, _Count(10 + rank), 3))
    mine = [torch.load(tmp_path / f"ckpt.rng{r}.pt", weights_only=True) for r in (0, 1)]
    assert [m["count"] for m in mine] == [{"value": 10}, {"value": 11}]
    assert "rng" not in mine[0] and "rng" in mine[1]  # rank 0's generators: ckpt.pt's field
    assert sorted(torch.load(path, weights_only=True)) == PAYLOAD_KEYS  # ckpt.pt as before
    for rank in (0, 1):
        count = _Count(0)
        notes = Checkpointer(WholeFile(), rank=rank).resume(path, _ranked(rank, count))
        assert count.loaded == 10 + rank and notes == [f"resumed from {path} at step 3"]


FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_768fa7a"


def test_a_checkpoint_written_at_768fa7a_resumes_on_each_rank(tmp_path: Path) -> None:
    """On-disk compatibility: rank 0's generators in ckpt.pt, rank 1's in ckpt.rng1.pt (the
    fixture's seeds 7 and 8); a per-rank part the old files lack keeps its fresh state."""
    import random
    import shutil

    path = tmp_path / "ckpt.pt"
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    for rank in (0, 1):
        torch.manual_seed(7 + rank)
        random.seed(7 + rank)
        expected = (torch.rand(3), random.random())
        torch.manual_seed(99)
        net, count = torch.nn.Linear(2, 1), _Count(5)
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
        train = TrainState(devices=2)
        parts = {"model": net, "optimizer": optimizer, "train": train,
                 "rng": PerRank(RngState(reseed=rank)), "count": PerRank(count)}  # fmt: skip
        config = {"global_batch": 8, "mode": "ddp"}
        notes = Checkpointer(WholeFile(), rank=rank, run_config=config).resume(path, parts)
        assert notes == [f"resumed from {path} at step 3"]
        drawn = torch.rand(3), random.random()
        assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1], rank
        saved = torch.load(path, weights_only=True)["model"]
        assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())
        assert (train.step, train.epoch, train.batch_in_epoch) == (3, 1, 2)
        assert train.losses == [2.5, 2.0, 1.5] and train.samples == [5, 3]
        assert optimizer.state_dict()["state"][0]["step"] == 1
        assert count.loaded is None and count.value == 5  # fresh: no such part then


def _odd(kind: str, path: Path) -> str:
    """Put an odd file of ``kind`` at ``path`` (a good checkpoint there before); what the
    fallback line must say about it."""
    import os
    import shutil

    good = path.read_bytes()
    path.unlink()
    if kind == "fifo":  # issue 53: resumed from the previous checkpoint without a word
        os.mkfifo(path)
        return "it is a FIFO, not a regular file"
    if kind == "link_to_a_device":
        path.symlink_to("/dev/zero")
        return "it is a link to '/dev/zero', a character device"
    if kind == "dangling_link":
        path.symlink_to(path.with_name("gone.pt"))
        return "which does not exist"
    if kind == "folder":
        path.mkdir()
        return "it is a folder, not a regular file"
    if kind == "empty":
        path.write_bytes(b"")
        return "not a torch.save zip archive"
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
        return "is unreadable"
    assert kind == "another_users"  # left there while the folder was open to them
    from tests._other_user import OTHER_UID

    path.write_bytes(good)
    shutil.chown(path, OTHER_UID, OTHER_UID)
    return f"it belongs to uid {OTHER_UID}, not to you"


_ODD_KINDS = [
    "fifo", "link_to_a_device", "dangling_link", "folder", "empty", "truncated",
    pytest.param("another_users", marks=needs_root),
]  # fmt: skip


@pytest.mark.parametrize("kind", _ODD_KINDS)
def test_every_fallback_from_an_odd_checkpoint_is_said_in_one_line(
    tmp_path: Path, kind: str
) -> None:
    """Issue 53, item 3: whatever sits at ``ckpt.pt``, the resume takes ``ckpt.prev.pt`` and
    says which file it skipped, why, and what it used instead."""
    path = tmp_path / "ckpt.pt"
    net = torch.nn.Linear(2, 1)
    for step in (1, 2):
        Checkpointer(WholeFile()).save(
            path, {"model": net, "train": TrainState(devices=1, step=step)}
        )
    why = _odd(kind, path)
    state = TrainState(devices=1)
    notes = Checkpointer(WholeFile()).resume(path, {"model": net, "train": state})
    assert notes is not None and state.step == 1
    fell = [n for n in notes if "fell back" in n]
    assert len(fell) == 1 and "\n" not in fell[0], notes
    assert fell[0].startswith(f"checkpoint {str(path)!r}") or str(path) in fell[0], fell
    assert why in fell[0], fell
    assert fell[0].endswith(f"fell back to the previous checkpoint {str(previous_path(path))!r}")
