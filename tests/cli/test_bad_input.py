"""Every CLI answer to bad input is clean: exit 2, one error line naming the value and the
fix, never a traceback. In-process through ``evendp.cli.main`` (fast: nothing trains)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evendp.cli import main

NO_GPU = not torch.cuda.is_available()

# (argv, what the one error line must contain)
KNOWN = [
    # the reports of issue 12
    pytest.param(
        ["train", "--devices", "0"],
        "names a GPU",
        marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here"),
    ),
    pytest.param(
        ["train", "--devices", "cuda:0"],
        "--devices cpu,cpu,cpu",
        marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here"),
    ),
    (["train", "--lr", "-1"], "--lr must be a number in (0, 10], got '-1'; e.g. --lr 3e-3"),
    (["launch", "--nproc", "2", "missing.py"], "script 'missing.py' does not exist"),
    pytest.param(
        ["plan"],
        "--memory 24GiB,24GiB,12GiB",
        marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here"),
    ),
    # more values with a meaning of their own
    (["train", "--devices", "tpu,cpu"], "'tpu' is not a device"),
    (["train", "--devices", "cpu,,cpu"], "has an empty entry"),
    (["train", "--n-embd", "66"], "--n-embd must be a multiple of 4"),
    (["train", "--devices", "cpu,cpu", "--weights", "1,2,3"], "3 numbers for 2 devices"),
    (["train", "--devices", "cpu,cpu", "--weights", "0,0"], "not all 0"),
    (["train", "--devices", "cpu,cpu", "--weights=-1,2"], "must be numbers >= 0"),
    (["train", "--weights", "a,b,c"], "not a list of numbers"),
    (["train", "--devices", "cpu,cpu", "--memory", "48MiB"], "1 entries for 2 devices"),
    (["train", "--memory", "lots"], "--memory 'lots'"),
    (["train", "--mode", "tpu"], "invalid choice: 'tpu'"),
    (["train", "--log-to", "wandb"], "invalid choice: 'wandb'"),
    (["train", "--batch", "100000", "--devices", "cpu"], "more than the"),
    (["train", "--batch", "2000"], "--batch 2000 on --memory 48MiB,48MiB,24MiB"),
    (["plan", "--memory", "lots"], "lots"),
    (["plan", "--model", "nowhere:factory", "--memory", "1GiB"], "nowhere"),
    (["launch", "--batch-sizes", "a,b", "--dry-run", "t.py"], "a,b"),
    (["launch", "--gpus", "a", "t.py"], "--gpus 'a'"),
    (["bogus"], "invalid choice: 'bogus'"),
]

if NO_GPU:
    try:
        import torch.utils.tensorboard
    except ImportError:
        KNOWN.append((["train", "--log-to", "tensorboard"], "pip install tensorboard"))

# Every option that takes a number, per subcommand, and its malformed values.
INT_OPTIONS = {
    "train": ["--steps", "--batch", "--accum", "--checkpoint-every", "--seed", "--n-layer",
              "--n-embd", "--block-size", "--max-chars"],
    "plan": ["--batch", "--vocab", "--seq-len"],
    "launch": ["--batch", "--vocab", "--seq-len"],
}  # fmt: skip
FLOAT_OPTIONS = {"train": ["--lr"], "plan": ["--margin"], "launch": ["--margin"]}
BAD_INTS = ["-1", "x", "", "1.5", "99999999999999999999"]
BAD_FLOATS = ["-1", "x", "", "nan", "inf", "1e300"]
TEXT_OPTIONS = {  # free-text options and values that cannot be right
    "plan": [("--memory", ""), ("--memory", "-1GiB"), ("--context", "x"), ("--mode", "x"),
             ("--optimizer", "x"), ("--amp", "x")],
    "launch": [("--nproc", "-1"), ("--nproc", "0"), ("--nproc", "x"), ("--nproc", ""),
               ("--batch-sizes", "-1,2"), ("--batch-sizes", ""), ("--min-free", "x"),
               ("--memory", "x"), ("--context", "x"), ("--optimizer", "x"), ("--amp", "x")],
    "train": [("--devices", ""), ("--memory", ""), ("--memory", "0,0,0"), ("--weights", ""),
              ("--amp", "x"), ("--mode", "")],
}  # fmt: skip


def _sweep() -> list[tuple[list[str], str]]:
    cases = []
    for cmd, flags in INT_OPTIONS.items():
        for flag in flags:
            for value in BAD_INTS:
                if value == "99999999999999999999" and flag in ("--seed",):
                    continue
                cases.append(([cmd, f"{flag}={value}"], value))
            if flag not in ("--checkpoint-every", "--seed"):
                cases.append(([cmd, f"{flag}=0"], "0"))
    for cmd, flags in FLOAT_OPTIONS.items():
        for flag in flags:
            cases += [([cmd, f"{flag}={value}"], value) for value in BAD_FLOATS]
    for cmd, pairs in TEXT_OPTIONS.items():
        cases += [([cmd, f"{flag}={value}"], value) for flag, value in pairs]
    return cases


def _tail(argv: list[str]) -> list[str]:
    """What keeps a case from doing anything but fail: no training, no launch."""
    if argv[0] == "launch" and not any(a.endswith(".py") for a in argv):
        return ["--dry-run", "t.py"]
    if argv[0] == "plan" and not any(a.startswith("--memory") for a in argv):
        return ["--memory", "1GiB"]
    return []


def _check(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (argv, captured.out, err)
    assert "Traceback" not in err + captured.out
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err  # one message
    assert needle in errors[0], (needle, errors[0])


@pytest.mark.parametrize(("argv", "needle"), KNOWN)
def test_known_bad_inputs(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)  # launch's missing.py really is missing; nothing is written
    _check(argv, needle, capsys)


@pytest.mark.parametrize(("argv", "value"), _sweep(), ids=lambda v: repr(v))
def test_malformed_values_of_every_option(
    argv: list[str], value: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    flag = argv[1].split("=")[0]
    full = [*argv, *_tail(argv)]
    code = main(full)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (full, captured.out, err)
    assert "Traceback" not in err + captured.out
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err
    assert flag.lstrip("-") in errors[0], errors[0]  # names the option...
    if value:
        assert value in errors[0], errors[0]  # ...and the value


def test_help_pages_have_no_markup_and_every_option_has_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from evendp.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, page in sub.choices.items():  # type: ignore[union-attr]
        for action in page._actions:
            assert action.help, f"evendp {name} {action.option_strings} has no help"
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "``" not in text and ":class:" not in text and ":func:" not in text, name


def test_version_reads_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"evendp {version('evendp')}"
