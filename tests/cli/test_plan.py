"""``evendp plan`` on the command line: JSON, table, plot, and exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evendp.cli import main


def test_json_lm_head(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "lm-head", "--devices", "3x80GiB", "--batch", "32", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert sum(data["split"]) == 32
    assert data["devices"][0]["breakdown"]["gathered_outputs"] == 1_280_000_000


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    args = [
        "plan",
        "--model",
        "lm-head",
        "--vocab",
        "1000",
        "--seq-len",
        "32",
        "--devices",
        "2GiB,1GiB",
        "--mode",
        "ddp",
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "dev1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def bad_factory() -> object:
    raise RuntimeError("broken on purpose")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--devices", "24 furlongs"], "cannot read device entry"),
        (["--model", "lm-head", "--devices", "1GiB"], "not even one sample"),
        (["--model", "tests.cli.test_plan:bad_factory", "--devices", "8GiB"], "broken on purpose"),
        (["--model", "no_such_pkg.mod:f", "--devices", "8GiB"], "cannot load"),
        (["--model", "nonsense", "--devices", "8GiB"], "package.module:factory"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
