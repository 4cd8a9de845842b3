"""The shared parser's answers to mistakes (issue 27): a mistyped option, choice or
subcommand gets the closest valid one; a memory spec without units is refused naming them.
One error line, exit 2, never a traceback; in-process through ``evendp.cli.main``."""

from __future__ import annotations

import pytest

from evendp.cli import main


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (argv, captured.out, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["train", "--batch-size", "16"],
            "evendp train: error: unknown option --batch-size (did you mean --batch?); "
            "see 'evendp train --help'",
        ),
        (
            ["launch", "--nprocs", "2", "--dry-run", "t.py"],
            "evendp launch: error: unknown option --nprocs (did you mean --nproc?)",
        ),
        (
            ["plan", "--batch-size=3", "--jsn"],
            "unknown options --batch-size (did you mean --batch?), --jsn (did you mean --json?)",
        ),
        (["tarin"], "invalid choice: 'tarin' (did you mean 'train'? choose from"),
        (["plan", "--mode", "dpp"], "invalid choice: 'dpp' (did you mean 'dp'?"),
        (["--verson"], "evendp: error: unknown option --verson (did you mean --version?)"),
    ],
)
def test_a_mistyped_word_gets_the_closest_valid_one(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert line in _error(argv, capsys)


def test_nothing_close_is_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["plan", "--zzzzzz", "--memory", "1GiB"], capsys)
    assert "unknown option --zzzzzz;" in line and "did you mean" not in line
    # A stray value is not an option: argparse's own words.
    assert "unrecognized arguments: extra" in _error(["plan", "extra"], capsys)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["plan", "--memory", "24,12"], "--memory 24GiB,12GiB"),
        (["plan", "--memory", "2x24-10,12GiB"], "--memory 2x24GiB-10GiB,12GiB"),
        (["train", "--memory", "48,48,24"], "--memory 48GiB,48GiB,24GiB"),
        (["train", "--memory", "48MiB,48,24MiB"], "--memory 48MiB,48MiB,24MiB"),
        (["launch", "--memory", "24,12", "--dry-run", "t.py"], "--memory 24GiB,12GiB"),
    ],
)
def test_memory_without_units_is_refused_naming_units(
    argv: list[str], fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(argv, capsys)
    spec = argv[argv.index("--memory") + 1]
    assert f"--memory {spec!r}: a memory spec needs units, e.g. {fix} (KiB, MiB, GiB" in line
