"""The ``evendp`` command starts without torch: ``--version``, ``--help``, an argument error and
a launcher import none (the ranks do); a program that imports evendp gets the whole face."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evendp.cli import _HELP, build_parser


def _imports(cmd: list[str], code: int = 0) -> tuple[str, set[str]]:
    """stdout of ``cmd`` and the top-level packages it imported (``-X importtime``'s list)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    names = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return proc.stdout, names


def _console_script() -> str:
    script = Path(sys.executable).with_name("evendp")
    found = str(script) if script.exists() else shutil.which("evendp")
    if found is None:
        pytest.skip("no evendp console script installed next to this python")
    return found


@pytest.mark.parametrize("flag", ["--version", "--help"])
@pytest.mark.parametrize("entry", ["-m", "console script"])
def test_version_and_help_import_no_torch(flag: str, entry: str) -> None:
    cmd = [sys.executable, "-m", "evendp"] if entry == "-m" else [_console_script()]
    out, imported = _imports([*cmd, flag])
    assert "torch" not in imported and "evendp" in imported
    if flag == "--version":
        assert out.startswith("evendp ")
    else:
        assert all(name in out for name in _HELP)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["train", "--help"], 0),
        (["plan", "--help"], 0),
        (["launch", "--help"], 0),
        (["train", "--batchsize", "3"], 2),  # a typo: one line, at once
        (["plan", "--bogus"], 2),
        (["launch", "--dry-run", "--nproc", "2", "--batch-sizes", "1,3", "s.py"], 0),
    ],
    ids=["train-help", "plan-help", "launch-help", "typo", "plan-typo", "launch"],
)
def test_the_command_answers_without_torch(argv: list[str], code: int) -> None:
    """The launcher's own start-up: issue 37 measured 8-12 s for a help or a typo on a busy
    machine, and every launch of ranks paid ~2.5 s of CPU for a torch it never used."""
    _, imported = _imports([sys.executable, "-m", "evendp", *argv], code)
    assert "torch" not in imported and "evendp" in imported


def test_a_program_that_imports_evendp_gets_the_whole_face() -> None:
    # Its own argv says --version, but it is not the evendp command: the face loads as ever.
    code = "import evendp, sys; print(evendp.Trainer.__module__, 'torch' in sys.modules)"
    out, _ = _imports([sys.executable, "-c", code, "--version"])
    assert out.split() == ["evendp", "True"]


def test_the_light_help_matches_the_subcommands() -> None:
    def helps(parser: argparse.ArgumentParser) -> dict[str, str | None]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {c.dest: c.help for c in sub._choices_actions}

    assert helps(build_parser(light=True)) == helps(build_parser()) == _HELP


def test_a_signal_while_torch_loads_is_kept_for_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`evendp train`: SIGINT during the package's imports is caught (no KeyboardInterrupt
    traceback) and handed to the command line's stop flag, which stops the run at once."""
    import signal

    from evendp._distributed._interrupt import StopFlag
    from evendp.cli import _fast

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "argv", ["evendp", "train", "--steps", "3"])
    try:
        _fast.answer_without_torch()  # what the face's first line does for this command
        early = signal.getsignal(signal.SIGINT)
        assert isinstance(getattr(early, "__self__", None), _fast.EarlyStop)
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without it
        with StopFlag() as flag:
            assert flag.signum == signal.SIGINT and flag.is_set
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_program_importing_evendp_keeps_its_own_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from evendp.cli import _fast

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["my_script.py", "train"])
    _fast.answer_without_torch()
    assert signal.getsignal(signal.SIGINT) is before
