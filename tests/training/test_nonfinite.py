"""Training state you can trust, in one process: NaN/inf steps skipped then stopped, a garbled
checkpoint caught and the previous good one resumed, a resume with another global batch refused.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from evendp._core._errors import CheckpointError, TrainingError
from evendp._training._checkpoint import previous_path
from evendp._training._trainer import TrainConfig, Trainer
from evendp.examples.stdlib_text import CharWindows

V = 7


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.emb(x).view(-1, V), y.view(-1))


def _data() -> CharWindows:
    g = torch.Generator().manual_seed(1)
    return CharWindows(torch.randint(0, V, (400,), generator=g), block_size=4)


def _trainer(out: Path | None = None, loss_fn: Any = None, **cfg: Any) -> Trainer:
    cfg.setdefault("batch_size", 6)
    config = TrainConfig(lr=0.1, progress=False, out_dir=out, **cfg)
    kwargs = {} if loss_fn is None else {"loss_fn": loss_fn}
    return Trainer(Bigram(), _data(), config, device_ids=["cpu", "cpu"], weights=[2, 1], **kwargs)


def _nan_from(first: int, last: int = 10**9) -> Any:
    """A loss that is NaN in the steps ``first..last`` (1-based, one forward per device)."""
    calls = {"n": 0}

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        value = model(*batch)
        step = (calls["n"] + 1) // 2  # two devices: two forwards per step
        return value * float("nan") if first <= step <= last else value

    return loss


def _finite(path: Path) -> bool:
    payload = torch.load(path, weights_only=True)
    return all(bool(torch.isfinite(v).all()) for v in payload["model"].values())


def test_a_transient_nan_step_is_skipped_and_training_goes_on() -> None:
    trainer = _trainer(loss_fn=_nan_from(3, 3), steps=6)
    report = trainer.fit()
    assert report.steps == 6 and report.skipped_steps == 1
    assert all(math.isfinite(v) for v in report.losses) and len(report.losses) == 5
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_nan_steps_in_a_row_stop_the_run_and_keep_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    trainer = _trainer(tmp_path, loss_fn=_nan_from(5), steps=12, checkpoint_every=2)
    with pytest.raises(TrainingError, match=r"3 steps in a row \(steps 5-7\).*resume"):
        trainer.fit()
    # Step 6 was saved after two skipped steps: the weights of step 4, finite, as is step 4's.
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 6
    assert _finite(tmp_path / "ckpt.pt") and _finite(previous_path(tmp_path / "ckpt.pt"))
    with pytest.raises(Exception, match="max_nonfinite_steps"):
        TrainConfig(max_nonfinite_steps=-1)  # 0 turns the check off


def _garble(path: Path) -> None:
    """The issue's reproduction: 4 KiB of noise at 60 % of the file."""
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        f.seek(int(size * 0.6))
        f.write(random.Random(1).randbytes(4096))


def test_a_garbled_checkpoint_falls_back_to_the_previous_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight = _trainer(steps=9).fit().losses
    _trainer(tmp_path, steps=6, checkpoint_every=3).fit()
    ckpt = tmp_path / "ckpt.pt"
    _garble(ckpt)
    resumed = _trainer(tmp_path, steps=9, checkpoint_every=3, resume=True)
    report = resumed.fit()
    err = capsys.readouterr().err
    assert "is corrupt" in err or "unreadable" in err
    assert f"resumed from {previous_path(ckpt)} at step 3" in err
    assert report.losses == pytest.approx(straight, rel=1e-5)  # the run continued exactly
    # The corrupt file was replaced, never rotated over the good previous one.
    assert torch.load(ckpt, weights_only=True)["step"] == 9 and _finite(ckpt)
    assert torch.load(previous_path(ckpt), weights_only=True)["step"] == 6


def test_a_resume_with_another_global_batch_is_refused(tmp_path: Path) -> None:
    _trainer(tmp_path, steps=2).fit()
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(CheckpointError, match=r"global batch of 6, this run has 4.*--batch 6"):
        _trainer(tmp_path, steps=4, resume=True, batch_size=4).fit()
    assert (tmp_path / "ckpt.pt").read_bytes() == before
