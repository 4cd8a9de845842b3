"""One writer per run directory: a live holder is named, a dead one's lock is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evendp._distributed._run_lock import ENV_RUN_LOCK, RunDirBusy, hold_run_dir
from tests.distributed._lock_holder import run_dir_holder

_HOLD = """
import sys, time
from evendp._distributed._run_lock import hold_run_dir
with hold_run_dir(sys.argv[1], "evendp train --out somewhere"):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(out: Path, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_live_run_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    try:
        holder = run_dir_holder(tmp_path)
        assert holder is not None and holder["pid"] == proc.pid
        busy = rf"in use by a live run: pid {proc.pid} .*--out"
        with pytest.raises(RunDirBusy, match=busy), hold_run_dir(tmp_path):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)  # dies holding it: the OS releases the lock
        proc.wait()
    with hold_run_dir(tmp_path, "the next run"):
        assert run_dir_holder(tmp_path)["command"] == "the next run"  # type: ignore[index]
    assert run_dir_holder(tmp_path) is None
    assert not list(tmp_path.iterdir())  # the lock lives outside the run's folder


def test_the_processes_a_run_starts_join_its_lock_and_a_resume_waits_for_them(
    tmp_path: Path,
) -> None:
    from evendp._distributed._run_lock import _lock_path, child_env

    with hold_run_dir(tmp_path, "the launcher") as lock:
        assert child_env(lock) == {ENV_RUN_LOCK: str(_lock_path(tmp_path))}
        rank = _holder(tmp_path, **child_env(lock))  # a rank joins: no refusal
    # The launcher is gone, its rank still trains: a resume into the folder refuses.
    try:
        time.sleep(0.1)
        with pytest.raises(RunDirBusy, match="the launcher"), hold_run_dir(tmp_path):
            pass
    finally:
        rank.kill()
        rank.wait()


def test_the_trainer_refuses_a_folder_another_run_writes_to(tmp_path: Path) -> None:
    from tests.training.test_nonfinite import _trainer

    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=str(proc.pid)):
            _trainer(tmp_path, steps=1).fit()
        assert not list(tmp_path.iterdir())
    finally:
        proc.kill()
        proc.wait()
