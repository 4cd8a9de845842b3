"""The strategy registry is the one list of names: TrainConfig, the command line and the docs
read it, and a run in one process is always ``dp``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from evendp import TrainConfig
from evendp._core._errors import EvendpError
from evendp._training._strategies import STRATEGIES, pick_strategy, rank_strategy_names
from evendp._training._strategies._balanced_dp import BalancedDP
from evendp.cli import build_parser

DOCS = Path(__file__).parents[2] / "docs" / "training.md"


def test_trainconfig_takes_exactly_the_registrys_rank_strategies() -> None:
    for name in rank_strategy_names():
        assert TrainConfig(strategy=name).strategy == name
    with pytest.raises(EvendpError) as refused:
        TrainConfig(strategy="zero3")
    for name in rank_strategy_names():
        assert repr(name) in str(refused.value)
    assert "dp" not in rank_strategy_names() and not STRATEGIES["dp"].ranks


def test_the_command_lines_modes_are_the_registrys_names() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    mode = next(a for a in sub.choices["train"]._actions if a.dest == "mode")
    assert tuple(mode.choices) == tuple(STRATEGIES)
    for entry in STRATEGIES.values():
        assert entry.summary in (mode.help or "")


def test_the_docs_table_names_every_strategy() -> None:
    section = DOCS.read_text().split("## Strategies: how a step runs")[1].split("\n## ")[0]
    named = set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M))
    assert named == set(STRATEGIES)


def test_one_process_is_dp_whatever_the_config_names() -> None:
    model = nn.Linear(2, 1)
    strategy = pick_strategy(model, TrainConfig(strategy="fsdp2"), ["cpu"], None)
    assert isinstance(strategy, BalancedDP) and strategy.name == "dp"
    assert next(model.parameters()).device == torch.device("cpu")


def test_each_entrys_checkpoint_name_is_its_strategys_format() -> None:
    """The command line checks ``OUT/<checkpoint_name>`` before any strategy is built: the
    registry's name must be the one the strategy's format writes."""
    from evendp._training._strategies._ddp import DDP
    from evendp._training._strategies._deepspeed import DeepSpeedFiles
    from evendp._training._strategies._fsdp2 import FSDP2

    formats = {
        "dp": BalancedDP.checkpoint_format.name,
        "ddp": DDP.checkpoint_format.name,
        "fsdp2": FSDP2.checkpoint_format.name,
        "deepspeed": DeepSpeedFiles.name,
    }
    assert {n: e.checkpoint_name for n, e in STRATEGIES.items()} == formats
