"""One home for the defaults of ``TrainConfig`` and ``evendp train`` (issue 36): both read
``evendp._core._defaults``, and the two that differed say so where the change matters."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from evendp import TrainConfig
from evendp._core import _defaults as defaults
from evendp.cli import main
from evendp.cli._args import CleanParser
from evendp.cli._train_args import add_options


def _cli_defaults() -> dict[str, object]:
    parser = CleanParser(prog="evendp train")
    add_options(parser)
    return {a.dest: a.default for a in parser._actions}


def test_the_config_and_the_command_line_read_one_table() -> None:
    config = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    cli = _cli_defaults()
    shared = {"steps": defaults.STEPS, "seed": defaults.SEED}
    for name, value in shared.items():
        assert config[name] == cli[name] == value, name
    assert config["batch_size"] == cli["batch"] == defaults.BATCH
    assert config["comm_timeout"] == cli["comm_timeout"] == defaults.COMM_TIMEOUT_S
    # The two that differed: each surface's value until 0.3.0, the common one after it.
    assert config["lr"] == defaults.LR and cli["lr"] is None  # None: said, then 3e-3
    assert cli["checkpoint_every"] == defaults.CHECKPOINT_EVERY
    assert config["checkpoint_every"] == defaults.CONFIG_CHECKPOINT_EVERY_UNTIL_REMOVAL


def test_a_config_with_a_folder_and_no_checkpoint_every_warns_of_the_change(
    tmp_path: Path,
) -> None:
    with pytest.warns(FutureWarning, match="from evendp 0.3.0 it saves every 50 steps"):
        assert TrainConfig(out_dir=tmp_path).checkpoint_every == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither warns: the value is given, or unused
        TrainConfig(out_dir=tmp_path, checkpoint_every=0)
        TrainConfig()


def test_evendp_train_without_lr_says_its_default_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--steps", "1", "--batch", "2", "--devices", "cpu", "--no-progress"]
    argv += ["--n-layer", "1", "--n-embd", "8", "--block-size", "16", "--max-chars", "10000"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert f"evendp train: note: {defaults.lr_note()}" in err
    assert main([*argv, "--out", str(tmp_path / "b"), "--lr", "3e-3"]) == 0
    assert "--lr not given" not in capsys.readouterr().err
