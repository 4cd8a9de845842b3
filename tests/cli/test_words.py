"""Every message names what the user typed, says how it read a size, and ends in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evendp import EvendpError, select_devices
from evendp._core._errors import NvmlUnavailableError
from evendp._planning._devices import list_devices
from evendp.cli import main

TINY = ["--batch", "4", "--steps", "1", "--no-progress", "--no-plan", "--n-layer", "1",
        "--n-embd", "16", "--block-size", "16", "--max-chars", "10000"]  # fmt: skip


def _driver() -> bool:
    try:
        list_devices()
    except NvmlUnavailableError:
        return False
    return True


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.skipif(_driver(), reason="needs a machine with no NVIDIA driver")
def test_ddp_gpu_devices_without_a_driver_name_devices_not_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh --out: the default (runs/demo) holds the demo's run after `make demo`.
    argv = ["train", "--mode", "ddp", "--devices", "0,1", *TINY]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = _one_line(capsys)
    assert "--devices '0,1'" in err and "--gpus" not in err


def test_a_weights_split_is_labelled_as_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--devices", "cpu,cpu", "--weights", "3,1", "--memory", "64MiB,64MiB"]
    assert main([*argv, *TINY, "--out", str(tmp_path)]) == 0
    start = capsys.readouterr().out.splitlines()[0]
    assert "(--weights 3,1, on budgets of 64.0MiB,64.0MiB)" in start and "planner" not in start


@pytest.mark.parametrize(("text", "read"), [("1G", "1G = 953.7 MiB"), ("1gb", "1gb = 953.7 MiB")])
def test_decimal_memory_units_are_said_as_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, read: str
) -> None:
    argv = ["train", "--devices", "cpu", "--memory", text, *TINY, "--out", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"--memory '{text}': decimal units, read as {read}" in err and "GiB" in err


def test_binary_memory_units_need_no_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--devices", "cpu", "--memory", "1GiB", *TINY, "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "decimal units" not in capsys.readouterr().err


@pytest.mark.skipif(_driver(), reason="needs a machine with no NVIDIA driver")
def test_select_devices_without_a_driver_says_so_and_suggests_gpu_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.warns(UserWarning, match=r"gpu_ids=\[2, 3\]\): no NVIDIA driver"):
        assert select_devices(gpu_ids=[2, 3]) == {2: 0, 3: 1}
    with pytest.raises(EvendpError, match=r"pass gpu_ids=\[\.\.\.\]"):
        select_devices(count=1)


def test_launch_refuses_a_script_that_is_not_python(capsys: pytest.CaptureFixture[str]) -> None:
    readme = str(Path(__file__).resolve().parents[2] / "README.md")
    assert main(["launch", "--nproc", "2", "--batch", "4", readme]) == 2
    err = _one_line(capsys)
    assert "is not a Python file" in err and "README.md" in err and "line" in err


@pytest.mark.skipif(_driver(), reason="needs a machine with no NVIDIA driver")
def test_launch_refuses_min_free_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--nproc", "2", "--batch", "4", "--min-free", "8GB", "--dry-run", "t.py"]
    assert main(argv) == 2
    assert "--min-free 8GB" in _one_line(capsys)


def _factory_module(tmp_path: Path, body: str) -> None:
    (tmp_path / "my_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n" + body
    )


def test_model_factory_imports_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _factory_module(
        tmp_path,
        "    return nn.Sequential(nn.Linear(8, 4)), lambda n: torch.randn(n, 8)\n",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    assert main(["plan", "--model", "my_models:make", "--memory", "1GiB", "--json"]) == 0
    assert '"split"' in capsys.readouterr().out


def test_a_model_batch_mismatch_says_what_was_called_with_what(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _factory_module(  # (x, y) from batch_fn but no criterion: Sequential gets two arguments
        tmp_path,
        "    return nn.Sequential(nn.Linear(8, 4)), lambda n: (torch.randn(n, 8), torch.ones(n))\n",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    assert main(["plan", "--model", "my_models:make", "--memory", "1GiB"]) == 2
    err = _one_line(capsys)
    assert "Sequential was called as model(*batch) with a tuple of 2 tensors [1, 8], [1]" in err
    assert "(model, batch_fn, criterion)" in err
