"""One default per option (issues 36, 51): ``TrainConfig``, ``evendp train`` and ``evendp
launch`` read ``evendp._core._defaults``, print the same values in their help, and none of them
warns about a later version."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from pathlib import Path

import pytest

from evendp import EvendpError, TrainConfig
from evendp._core import _defaults as defaults
from evendp.cli import build_parser
from evendp.cli._train_args import train_config


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def _options(name: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _subparser(name)._actions}


def test_the_config_and_the_command_lines_read_one_table() -> None:
    config = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    train = _options("train")
    # field: (evendp train's option, the value both must hold)
    shared = {
        "steps": ("steps", defaults.STEPS),
        "seed": ("seed", defaults.SEED),
        "batch_size": ("batch", defaults.BATCH),
        "lr": ("lr", defaults.LR),
        "checkpoint_every": ("checkpoint_every", defaults.CHECKPOINT_EVERY),
        "comm_timeout": ("comm_timeout", defaults.COMM_TIMEOUT_S),
    }
    for field, (dest, value) in shared.items():
        assert config[field] == train[dest].default == value, field
    # The help prints the same values (what a user reads before running anything).
    assert f"default {defaults.rate_text(defaults.LR)}" in (train["lr"].help or "")
    assert f"default {defaults.CHECKPOINT_EVERY}" in (train["checkpoint_every"].help or "")
    assert f"default {defaults.STEPS}" in (train["steps"].help or "")
    # evendp launch's global batch when nothing sizes the ranks is the same 32.
    assert f"default {defaults.BATCH} " in (_options("launch")["batch"].help or "")


def test_evendp_train_builds_the_config_a_script_gets_by_default() -> None:
    """The options left alone give TrainConfig's own defaults (lr 1e-3, a checkpoint every
    50 steps), not values of their own."""
    args = _subparser("train").parse_args(["--out", "runs/x"])
    built = train_config(args, every_step=False)
    plain = TrainConfig(out_dir="runs/x")
    for name in ("lr", "checkpoint_every", "steps", "seed", "batch_size", "warmup_steps"):
        assert getattr(built, name) == getattr(plain, name), name


def test_no_default_warns_and_checkpoint_every_needs_a_folder_only_when_given(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning about a later version, nothing
        assert TrainConfig(out_dir=tmp_path).checkpoint_every == defaults.CHECKPOINT_EVERY
        assert TrainConfig().checkpoint_every == defaults.CHECKPOINT_EVERY  # saves nothing
        TrainConfig(out_dir=tmp_path, checkpoint_every=0)  # only at the end, as asked
    with pytest.raises(EvendpError, match="checkpoint_every need out_dir"):
        TrainConfig(checkpoint_every=10)
