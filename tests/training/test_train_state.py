"""Train state in one process: resume on another device count, CUDA RNG on fewer GPUs, signals."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from evendp._training._checkpoint import RngState, load_checkpoint
from evendp._training._trainer import TrainConfig, Trainer
from tests.training.test_trainer import TinyLM, _data


def _trainer(out: Path, devices: int, steps: int, **kw: Any) -> Trainer:
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps, batch_size=8, out_dir=out, progress=False, **kw)
    return Trainer(TinyLM(), _data(), cfg, device_ids=["cpu"] * devices)


def test_cuda_generators_restore_on_fewer_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    restored: list[int] = []

    def set_rng_state(state: torch.Tensor, device: int) -> None:
        if device >= 1:  # what CUDA says for a device that is not there
            raise RuntimeError("CUDA error: invalid device ordinal")
        restored.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    state = {
        "torch": torch.get_rng_state(),
        "python": __import__("random").getstate(),
        "cuda": [torch.zeros(8, dtype=torch.uint8)] * 3,  # saved on a 3-GPU machine
    }
    with pytest.warns(UserWarning, match="for 3 device.*1 are visible here: restored the first 1"):
        RngState().load_state_dict(state)
    assert restored == [0]


def test_resume_on_fewer_devices_restores_what_applies_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _trainer(tmp_path, devices=3, steps=2).fit()
    report = _trainer(tmp_path, devices=2, steps=4, resume=True).fit()
    err = capsys.readouterr().err
    assert "resumed from" in err and "at step 2" in err
    assert "counted samples for 3 device(s), this run has 2" in err
    assert report.steps == 4 and len(report.losses) == 4


def test_a_signal_stops_after_the_step_saves_it_and_restores_the_handler(
    tmp_path: Path,
) -> None:
    calls = {"n": 0}

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # inside step 3's forward
        return model(*batch)

    def previous(signum: int, frame: Any) -> None:
        raise AssertionError("the Trainer's handler should have caught it")

    old = signal.signal(signal.SIGTERM, previous)
    try:
        torch.manual_seed(0)
        cfg = TrainConfig(steps=10, batch_size=8, out_dir=tmp_path, progress=False)
        report = Trainer(TinyLM(), _data(), cfg, device_ids=["cpu"], loss_fn=loss_fn).fit()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)
    assert (report.steps, report.interrupted, report.signal) == (3, True, signal.SIGTERM)
    assert load_checkpoint(tmp_path / "ckpt.pt", model=TinyLM())["step"] == 3


def test_a_finished_run_resumed_saves_nothing(tmp_path: Path) -> None:
    _trainer(tmp_path, devices=1, steps=4, checkpoint_every=2).fit()
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert load_checkpoint(tmp_path / "ckpt.prev.pt", model=TinyLM())["step"] == 2
    report = _trainer(tmp_path, devices=1, steps=4, resume=True).fit()
    assert report.steps == 4
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
