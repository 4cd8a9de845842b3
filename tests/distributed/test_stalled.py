"""A rank that stops answering ends the run; a signal the ranks ignore is escalated (issue 28).

The end-to-end case (``kill -STOP`` of a rank under ``evendp train``) is in
tests/cli/test_train_faults.py; here the launcher's side runs on stand-in processes (``sleep``
and ``bash``), which start in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import evendp._distributed._stalled as stalled
from evendp import EvendpError, TrainConfig
from evendp._distributed._interrupt import run_forwarding_signals

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the workers' RANK from /proc"
)


def _sleeper(rank: int | None = None) -> subprocess.Popen[bytes]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if rank is not None:
        env["RANK"] = str(rank)
    return subprocess.Popen(["sleep", "60"], env=env)


def _state(proc: subprocess.Popen[bytes]) -> str:
    return Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0]


def _until_state(proc: subprocess.Popen[bytes], state: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _state(proc) != state:
        assert time.monotonic() < deadline, f"pid {proc.pid} never reached state {state}"
        time.sleep(0.01)


@linux_only
def test_the_watch_names_the_silent_rank_and_ends_it_even_when_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stalled, "_REPORT_GRACE_S", 0.0)
    monkeypatch.setattr(stalled, "_KILL_GRACE_S", 0.0)
    torchrun, answering, silent = _sleeper(), _sleeper(0), _sleeper(1)
    procs = [torchrun, answering, silent]
    try:
        os.kill(silent.pid, signal.SIGSTOP)  # the issue's `kill -STOP`: SIGTERM waits
        # Stopped only once the kernel delivered it: a SIGTERM sent before (a loaded machine)
        # would be delivered first, as the lower signal number, and end it.
        _until_state(silent, "T")
        watch = stalled.StallWatch(tmp_path)
        workers = [answering.pid, silent.pid]
        watch.poll(torchrun.pid, workers)
        assert not watch.fired  # no report: nothing happens
        assert stalled.report_stalled(str(tmp_path / "outcome.json"), 0)
        watch.poll(torchrun.pid, workers)  # the first report: the others get their grace
        assert watch.fired and torchrun.poll() is None
        watch.poll(torchrun.pid, workers)  # SIGTERM to torchrun and to the silent rank
        assert torchrun.wait(timeout=10) == -signal.SIGTERM
        assert silent.poll() is None and _state(silent) == "T"  # stopped: SIGTERM pending
        watch.poll(torchrun.pid, workers)  # then SIGKILL
        assert silent.wait(timeout=10) == -signal.SIGKILL
        line = watch.line(20)
        assert line.startswith("rank 1 stopped answering: rank 0 waited for 20 s")
        assert "\n" not in line
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


_TORCHRUN = """
bash -c 'trap : TERM; while :; do sleep 0.1; done' &  # a rank that ignores SIGTERM
worker=$!
trap 'kill -9 $worker; exit 143' TERM  # what torchrun does: SIGTERM, later SIGKILL
wait
"""


@linux_only
def test_a_signal_the_ranks_ignore_goes_to_torchrun_after_the_grace(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    done = threading.Event()

    def send_once_caught() -> None:  # after the launcher's handler is in, never before
        while not done.is_set() and signal.getsignal(signal.SIGTERM) is before:
            done.wait(0.01)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    fired = threading.Thread(target=send_once_caught)
    fired.start()
    process: list[int] = []

    gave_up: list[bool] = []

    def give_up() -> None:  # never hang the suite: end the stand-in torchrun after a while
        gave_up.append(True)
        for pid in process:
            os.kill(pid, signal.SIGKILL)

    guard = threading.Timer(30.0, give_up)
    guard.start()
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        process.append(proc.pid)
        return proc

    try:
        subprocess.Popen = popen  # type: ignore[misc]
        code = run_forwarding_signals(["bash", "-c", _TORCHRUN], dict(os.environ), escalate_s=2)
    finally:
        subprocess.Popen = real_popen  # type: ignore[misc]
        done.set()
        fired.join()
        guard.cancel()
    assert code == 128 + signal.SIGTERM
    assert not gave_up  # torchrun got the signal and ended its rank: nothing hung


def test_the_timeout_is_checked_and_spelled_alike_everywhere() -> None:
    import runpy

    from evendp._distributed._torchrun import QUIET_TORCHRUN
    from evendp.cli import _train_args
    from evendp.cli._args import CleanParser

    assert TrainConfig().comm_timeout == stalled.DEFAULT_COMM_TIMEOUT_S == 600
    # The command line's option, as parsed (it reads the same table, evendp._core._defaults).
    parser = CleanParser(prog="evendp train")
    _train_args.add_options(parser)
    (option,) = [a for a in parser._actions if a.dest == "comm_timeout"]
    assert option.default == stalled.DEFAULT_COMM_TIMEOUT_S
    assert option.type(str(stalled.MIN_COMM_TIMEOUT_S)) == stalled.MIN_COMM_TIMEOUT_S
    with pytest.raises(argparse.ArgumentTypeError):  # below the least the CLI takes
        option.type(str(stalled.MIN_COMM_TIMEOUT_S / 2))
    spelled = runpy.run_path(str(QUIET_TORCHRUN / "_quiet.py"), run_name="probe")
    assert spelled["STALLED_PREFIX"] == stalled.REPORT_PREFIX
    assert TrainConfig(comm_timeout=None).comm_timeout is None
    for bad in (0, -1, float("nan"), "600"):
        with pytest.raises(EvendpError, match="comm_timeout must be a finite number > 0"):
            TrainConfig(comm_timeout=bad)  # type: ignore[arg-type]


def test_the_command_line_takes_seconds_from_the_minimum(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from evendp.cli import main

    assert main(["train", "--comm-timeout", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--comm-timeout must be a number in [5, 86400], got '1'" in err


def test_stopped_and_saved_is_said_only_after_a_save(capsys: pytest.CaptureFixture[str]) -> None:
    from evendp.cli._train_ddp import say_how_to_resume

    assert say_how_to_resume(143, ["train", "--out", "x"], saved=False) == 143
    err = capsys.readouterr().err
    assert "stopped before saving" in err and "stopped and saved" not in err
    assert "evendp train --out x --resume" in err
    say_how_to_resume(130, ["train"], saved=True)
    assert "stopped and saved" in capsys.readouterr().err


def test_a_silent_rank_on_another_node_is_named_by_its_node(tmp_path: Path) -> None:
    """Issue 35: node 0's launcher sees only its own ranks' reports (each node's folder is
    its own); the world's other ranks are on another node, named by the node they run on."""
    watch = stalled.StallWatch(tmp_path, world=4, per_node=2)
    watch.reported = {0, 1}
    line = watch.line(10)
    assert line.startswith("a rank on node 1 stopped answering: rank 0, 1 waited for 10 s")
    assert stalled.StallWatch(tmp_path).line().startswith("a rank on another node")
