"""The strategy registry is the one list of names: TrainConfig, the command line and the docs
read it, and a run in one process is always ``dp``."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from evendp import TrainConfig, Trainer
from evendp._core._errors import EvendpError
from evendp._training._checkpointer import CheckpointFormat
from evendp._training._launched import join_launch
from evendp._training._strategies import (
    STRATEGIES,
    StrategyEntry,
    pick_strategy,
    rank_strategy_names,
    strategy_names,
)
from evendp._training._strategies._balanced_dp import BalancedDP
from evendp._training._strategies._base import Strategy
from evendp.cli import build_parser

DOCS = Path(__file__).parents[2] / "docs" / "training.md"


def test_trainconfig_takes_exactly_the_registrys_names() -> None:
    """Issue 51: the docs' table names ``dp``, which ``TrainConfig(strategy="dp")`` refused."""
    assert strategy_names() == tuple(STRATEGIES)
    for name in strategy_names():
        assert TrainConfig(strategy=name).strategy == name
    with pytest.raises(EvendpError) as refused:
        TrainConfig(strategy="zero3")
    for name in strategy_names():
        assert repr(name) in str(refused.value)
    assert "dp" not in rank_strategy_names() and not STRATEGIES["dp"].ranks


_LAUNCHED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "1"}  # fmt: skip


def test_a_one_process_strategy_among_launched_ranks_is_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank would train alone: said in one line, before a process group is started."""
    for name, value in _LAUNCHED.items():
        monkeypatch.setenv(name, value)
    cfg = TrainConfig(strategy="dp", progress=False)
    with pytest.raises(EvendpError) as refused:
        Trainer(nn.Linear(2, 1), [(torch.ones(2), torch.ones(1))] * 4, cfg)
    assert str(refused.value).startswith(
        "strategy='dp' runs one process over device_ids, but a launcher started this script as "
        "rank 1 of 2; pass a strategy for ranks ('ddp', 'fsdp2', "
    )
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one launched rank: one process, as asked
    monkeypatch.setenv("RANK", "0")
    join_launch("dp")
    assert not torch.distributed.is_initialized()


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


def _format_name(entry: StrategyEntry) -> str:
    """The checkpoint name the strategy an entry builds writes, read from its module's classes
    (no process group needed): its class's format, or the module's own format class where the
    format is built per instance (DeepSpeed's)."""
    module = importlib.import_module(entry.module, "evendp._training._strategies")
    classes = [c for c in vars(module).values() if isinstance(c, type)]
    strategy = next(
        c for c in classes
        if issubclass(c, Strategy) and c.__module__ == module.__name__ and c.name == entry.name
    )  # fmt: skip
    found = strategy.checkpoint_format
    if isinstance(found, property):
        found = next(
            c
            for c in classes
            if issubclass(c, CheckpointFormat) and c.__module__ == module.__name__
        )
    return str(found.name)


def test_each_entrys_checkpoint_name_is_its_strategys_format() -> None:
    """The command line checks ``OUT/<checkpoint_name>`` before any strategy is built: the
    registry's name must be the one the strategy's format writes (every entry, none listed
    here by hand)."""
    for name, entry in STRATEGIES.items():
        assert entry.checkpoint_name == _format_name(entry), name
