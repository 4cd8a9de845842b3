"""Every ``evendp train`` option reaches the ranks of ``--mode ddp|fsdp2`` or is refused.

The walk introspects the argparse parser, so a new option is covered (or the test asks for a
sample value for it) without editing a list of flags here.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from evendp._training._strategies import STRATEGIES, rank_strategy_names
from evendp.cli import build_parser, main
from evendp.cli._train_args import (
    MACHINE_OPTIONS,
    OPTIONS_ENV,
    options_from_env,
    run_options,
    validate_args,
)
from evendp.cli._train_ddp import plan_ranks

SMALL = ["--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--max-chars", "600000"]
BASE = ["--devices", "cpu,cpu", "--batch", "16", *SMALL]

# A value other than the default for each option that takes free text or a number; flags
# (store_true) and choices are derived from the parser itself.
SAMPLES = {
    "--steps": "7",
    "--batch": "24",
    "--devices": "cpu,cpu,cpu",
    "--memory": "48MiB,24MiB",
    "--weights": "3,1",
    "--accum": "2",
    "--out": "runs/walked",
    "--max-restarts": "2",
    "--comm-timeout": "90",
    "--checkpoint-every": "3",
    "--lr": "0.01",
    "--warmup-steps": "4",
    "--model": "tests.training._rehearse_model:make",
    "--seed": "5",
    "--n-layer": "2",
    "--n-embd": "48",
    "--block-size": "40",
    "--max-chars": "700000",
    "--strategy-config": "pyproject.toml",
    "--nnodes": "2",
    "--node-rank": "1",
    "--master-addr": "10.0.0.1",
    "--master-port": "29501",
}

# Refused under a mode, with the words its one line must carry.
REFUSED = {
    ("fsdp2", "--memory"): "FSDP2",
    ("fsdp2", "--model"): "use --mode dp",
    ("ddp", "--model"): "use --mode dp",
    ("ddp", "--strategy-config"): "reads no --strategy-config",
    ("fsdp2", "--strategy-config"): "reads no --strategy-config",
    # Alone, a node option is half of several machines' (the whole: the test further down).
    **{(mode, "--nnodes"): "needs --node-rank" for mode in ("ddp", "fsdp2")},
    **{
        (mode, flag): "but --nnodes is 1"
        for mode in ("ddp", "fsdp2")
        for flag in ("--node-rank", "--master-addr", "--master-port")
    },
}
try:  # --log-to tensorboard is refused only where the package is missing
    import torch.utils.tensorboard  # noqa: F401
except ImportError:
    REFUSED[("fsdp2", "--log-to=tensorboard")] = REFUSED[("ddp", "--log-to=tensorboard")] = (
        "tensorboard"
    )


def _train_actions() -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["train"]
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _variants(action: argparse.Action) -> list[tuple[str, list[str]]]:
    """(label, argv) per non-default value of ``action``."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        return [(flag, [flag])]
    if action.choices is not None:
        return [(f"{flag}={c}", [flag, str(c)]) for c in action.choices if c != action.default]
    assert flag in SAMPLES, f"add a sample value for the new option {flag} to SAMPLES"
    return [(flag, [flag, SAMPLES[flag]])]


def _cases() -> list[tuple[str, str, list[str], str]]:
    return [
        (mode, label, argv, action.dest)
        for mode in ("ddp", "fsdp2")
        for action in _train_actions()
        if action.dest != "mode"
        for label, argv in _variants(action)
    ]


def _rank_options(plan: object, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """What a rank's ``evendp train`` runs with, from the environment torchrun gives it."""
    env = plan.env  # type: ignore[attr-defined]
    monkeypatch.setenv(OPTIONS_ENV, env[OPTIONS_ENV])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # The rank's own argv names only its run; everything else comes from the launcher.
    own = build_parser().parse_args(["train", "--mode", "ddp", "--out", "elsewhere"])
    return options_from_env(own)


@pytest.mark.parametrize(("mode", "label", "argv", "dest"), _cases())
def test_every_option_reaches_the_ranks_or_is_refused(
    mode: str,
    label: str,
    argv: list[str],
    dest: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    full = ["train", "--mode", mode, *BASE, *argv]
    if dest == "weights":  # three devices would need three weights
        full = ["train", "--mode", mode, *BASE, "--devices", "cpu,cpu", *argv]
    if (mode, label) in REFUSED:
        assert main(full) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and REFUSED[(mode, label)] in err, err
        return
    args = build_parser().parse_args(full)
    validate_args(args)
    plan, _ = plan_ranks(args)
    rank = _rank_options(plan, monkeypatch)
    default = build_parser().parse_args(["train"])
    assert getattr(args, dest) != getattr(default, dest), "the walk must try a non-default"
    assert getattr(rank, dest) == getattr(args, dest)
    assert vars(rank) == vars(args)


def test_memory_under_ddp_plans_each_rank_for_its_budget() -> None:
    args = build_parser().parse_args(
        ["train", "--mode", "ddp", *BASE, "--batch", "64", "--memory", "8MiB,4MiB"]
    )
    plan, _ = plan_ranks(args)
    # An even 32 does not fit the 4 MiB rank: the planner gives it less, the other more.
    assert sum(plan.batch_sizes) == 64 and plan.batch_sizes[0] > 32 > plan.batch_sizes[1]
    assert plan.batch_caps[1] < 32


def test_memory_entries_must_match_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh --out: the default (runs/demo) holds the demo's run after `make demo`.
    argv = ["train", "--mode", "ddp", *BASE, "--memory", "8MiB,8MiB,4MiB"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--memory" in err and "--devices 'cpu,cpu'" in err and "--nproc" not in err


def test_memory_too_small_for_one_sample_is_said_in_readable_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51: 1 KiB budgets were "0.00 GiB"; every figure takes the unit that shows it."""
    argv = ["train", *BASE, "--memory", "1KiB,1KiB", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not even one sample fits" in err
    assert "GiB" not in err and "may use 972 B" in err  # 1 KiB less the planner's 5% margin
    assert " MiB for one sample" in err or " KiB for one sample" in err


def test_memory_and_weights_together_are_refused_under_ddp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--mode", "ddp", *BASE, "--memory", "8MiB,4MiB", "--weights", "3,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "give one" in err


@pytest.mark.multiprocess
def test_ddp_writes_metrics_and_runs_the_planned_split_with_budgets(tmp_path: Path) -> None:
    code = main(
        ["train", "--mode", "ddp", *BASE, "--batch", "64", "--memory", "8MiB,4MiB",
         "--log-to", "csv", "--steps", "2", "--no-progress", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,") and [r.split(",")[0] for r in rows[1:]] == ["1", "2"]
    devices = json.loads((tmp_path / "report.json").read_text())["devices"]
    shares = [d["samples_per_step"] for d in devices]
    assert sum(shares) == 64 and shares[0] > shares[1]
    assert [d["budget_bytes"] for d in devices] == [8 * 2**20, 4 * 2**20]


def test_a_rank_takes_its_batch_plan_from_the_one_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    from evendp import EvendpError
    from evendp.cli._train_ddp import _rank_plan

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    assert _rank_plan(argparse.Namespace(batch=10), 2).sizes == (5, 5)  # no launcher: even
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "3,5;caps=6,9")
    plan = _rank_plan(argparse.Namespace(batch=32), 2)  # --batch's default: the sizes rule
    assert (plan.sizes, plan.caps, plan.source) == ((3, 5), (6, 9), "env")
    assert _rank_plan(argparse.Namespace(batch=8), 2).sizes == (3, 5)  # --batch agrees
    with pytest.raises(EvendpError, match=r"--batch 64 .* contradicts EVENDP_BATCH_SIZES=3,5 "):
        _rank_plan(argparse.Namespace(batch=64), 2)
    monkeypatch.setenv(OPTIONS_ENV, "{}")  # planned by evendp train for its --batch: held to it
    with pytest.raises(EvendpError, match=r"--batch 32 .* contradicts EVENDP_BATCH_SIZES=3,5 "):
        _rank_plan(argparse.Namespace(batch=32), 2)


@pytest.mark.parametrize("mode", [n for n, e in STRATEGIES.items() if not e.plans_memory])
def test_memory_is_refused_for_a_mode_the_planner_cannot_model(
    mode: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "settings.json"
    config.write_text("{}")
    extra = ["--strategy-config", str(config)] if STRATEGIES[mode].takes_config else []
    argv = ["train", "--mode", mode, *BASE, "--memory", "48MiB,24MiB", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no memory model of sharded ranks" in err, err


def test_the_config_builder_copies_every_option_named_like_a_field() -> None:
    """issue 33: a new TrainConfig option is its field and its flag. The builder copies an
    option named like a field (grad_clip has no flag yet: set here as a new flag would), for
    one process and for the ranks alike; ranks' fields stay out of one process."""
    from evendp.cli._train_args import train_config

    argv = ["train", *BASE, "--mode", "ddp", "--seed", "5", "--comm-timeout", "90"]
    args = build_parser().parse_args([*argv, "--warmup-steps", "4"])
    args.grad_clip = 0.5
    one = train_config(args, every_step=True)
    ranks = train_config(args, every_step=False, batch_sizes=[12, 4])
    assert one.warmup_steps == ranks.warmup_steps == 4  # a field and its flag, nothing else
    assert (one.seed, one.grad_clip, one.batch_size, one.log_every) == (5, 0.5, 16, 1)
    assert one.comm_timeout != 90 and one.batch_sizes is None  # rank-only: not in one process
    assert (ranks.seed, ranks.grad_clip, ranks.batch_sizes, ranks.log_every) == (
        5,
        0.5,
        [12, 4],
        10,
    )
    assert ranks.comm_timeout == 90 and ranks.strategy == args.mode == "ddp"


def test_the_nodes_options_reach_torchrun_and_size_every_nodes_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 35: evendp train on several machines; --weights name every rank of the run."""
    from evendp._planning._launch import torchrun_command
    from evendp.cli._train_ddp import _restarts

    nodes = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    argv = [
        "train",
        "--mode",
        "ddp",
        *BASE,
        "--weights",
        "1,1,2,4",
        *nodes,
        "--master-port",
        "29511",
    ]
    args = build_parser().parse_args(argv)
    validate_args(args)
    plan, script_argv = plan_ranks(args)
    assert plan.nproc_per_node == 2 and plan.batch_sizes == [2, 2, 4, 8]  # node-major
    command = torchrun_command(plan, "train.py", script_argv, _restarts(args)["passthrough"])
    for flag, value in zip(nodes[::2], nodes[1::2], strict=True):
        assert command[command.index(flag) + 1] == value
    assert command[command.index("--master-port") + 1] == "29511"
    assert vars(_rank_options(plan, monkeypatch)) == vars(args)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "is not one of the 2"),
        (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--memory", "8MiB,8MiB"],
         "--memory plans this machine's ranks only"),
        (["--mode", "dp", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"],
         f"use --mode {', '.join(rank_strategy_names()[:-1])} or {rank_strategy_names()[-1]} "
         "(--mode dp is one process)"),
    ],
    ids=["node-rank", "memory", "dp"],
)  # fmt: skip
def test_the_nodes_options_are_checked_in_one_line(
    extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mode = [] if "--mode" in extra else ["--mode", "ddp"]
    assert main(["train", *mode, *BASE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err


def _train_help() -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices["train"].format_help().split())  # argparse's wrapping undone


def test_help_names_the_modes_that_run_ranks_as_the_registry_lists_them() -> None:
    """Issue 51: --max-restarts and --comm-timeout said "ddp/fsdp2" while zero1 and deepspeed
    run ranks too. Every list of two or more modes in evendp train's help (options, groups,
    description) that names only modes with ranks names all of them, in the registry's order,
    and the options only ranks take say so first."""
    ranks = list(rank_strategy_names())
    assert len(ranks) >= 3 and "dp" not in ranks
    names = "|".join(sorted(STRATEGIES, key=len, reverse=True))
    lists = re.finditer(rf"\b(?:{names})(?:(?:\s*[,/|]\s*|\s+or\s+)(?:{names})\b)+", _train_help())
    found = [re.findall(rf"\b(?:{names})\b", m.group(0)) for m in lists]
    only_ranks = [f for f in found if not set(f) - set(ranks)]
    assert only_ranks and all(f == ranks for f in only_ranks), only_ranks
    helps = {a.dest: a.help or "" for a in _train_actions()}
    for dest in ("max_restarts", "comm_timeout", "balance"):
        assert helps[dest].startswith(f"--mode {', '.join(ranks)}:"), helps[dest]


def test_help_says_what_the_machines_of_a_run_must_share() -> None:
    """Issue 51: the help said --devices must be the same on every machine; the plans'
    agreement leaves it each machine's own (MACHINE_OPTIONS) and compares --weights."""
    text = _train_help()
    assert "devices" in MACHINE_OPTIONS and "its own --devices" in text
    assert "weights" in run_options(argparse.Namespace(weights="3,1", devices="cpu"))
    assert "--weights (one weight per rank of the whole run, node 0's first) and every " \
        "other option the same everywhere" in text  # fmt: skip
