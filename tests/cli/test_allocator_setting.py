"""evendp's commands choose the CUDA allocator's setting where a GPU is, never over the user's."""

from __future__ import annotations

import os

import pytest

import evendp.cli as cli

PLAN = ["plan", "--model", "lm-head", "--vocab", "100", "--seq-len", "8", "--memory", "4GiB"]


def test_a_gpu_machine_gets_expandable_segments_said_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(cli, "has_gpu", lambda: True)  # stands in for NVML's GPU
    assert cli.main(PLAN) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    err = capsys.readouterr().err
    assert err.count("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by evendp") == 1
    assert cli.main(PLAN) == 0  # the variable is set now: not said again
    assert "PYTORCH_CUDA_ALLOC_CONF" not in capsys.readouterr().err


def test_the_users_setting_and_a_machine_without_gpu_are_left_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(cli, "has_gpu", lambda: True)
    assert cli.main(PLAN) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(cli, "has_gpu", lambda: False)
    assert cli.main(PLAN) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "PYTORCH_CUDA_ALLOC_CONF" not in capsys.readouterr().err
