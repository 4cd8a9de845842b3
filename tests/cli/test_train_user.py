"""evendp train --model module:factory: a user's model rehearsed on budgeted CPU devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evendp.cli import main

MODEL = "tests.training._rehearse_model:make"


def test_train_a_user_model_on_24mib_12mib(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(
        ["train", "--model", MODEL, "--memory", "24MiB,12MiB", "--batch", "48", "--steps", "2",
         "--out", str(tmp_path), "--log-to", "csv", "--no-progress"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "the even split [24, 24] (what nn.DataParallel runs) fails" in out
    devices = json.loads((tmp_path / "report.json").read_text())["devices"]
    assert [d["even_oom"] for d in devices] == [False, True]
    shares = [d["samples_per_step"] for d in devices]
    assert sum(shares) == 48 and shares[0] > shares[1]
    assert all(d["peak_bytes"] <= d["budget_bytes"] for d in devices)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,memory/cpu:0,memory/cpu:1" and len(rows) == 3


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", MODEL], "give one per device, e.g. --memory 24MiB,12MiB"),
        (["--model", MODEL, "--memory", "1MiB", "--mode", "ddp"], "use --mode dp"),
        (["--model", "no_such_module:make", "--memory", "1MiB"], "cannot load --model"),
        (["--model", "tests.training._rehearse_model:loss_fn", "--memory", "1MiB"], "failed"),
        (["--model", "tests.training._rehearse_model:SEQ", "--memory", "1MiB"], "no function"),
        (["--model", "mymodel", "--memory", "1MiB"], "is not 'package.module:factory'"),
        (["--model", MODEL, "--memory", "1MiB,1MiB", "--devices", "cpu"], "one budget per"),
    ],
)
def test_user_model_mistakes_get_one_line(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code = main(["train", *argv, "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and err.count("\n") == 0, err
