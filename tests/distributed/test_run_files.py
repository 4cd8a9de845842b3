"""evendp's files outside --out live in a folder of this user's alone (issue 28, item 2).

The attack of the issue: another local user plants a link where evendp keeps its run lock,
and the next run of the victim truncates the file the link points at. Here the link is
planted in the places another user can reach (a shared runtime folder, the folder itself);
as root a second user (``nobody``) plants it for real and runs at the same time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from evendp._distributed._run_files import RunFilesUnsafe, open_private, run_files_dir
from evendp._distributed._run_lock import _lock_path, hold_run_dir
from tests.distributed._lock_holder import run_dir_holder

_NOBODY = 65534


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "precious.txt"
    victim.write_text("years of work")
    victim.chmod(0o600)
    return victim


def test_the_folder_is_made_0700_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    old = os.umask(0)
    try:
        folder = run_files_dir()
    finally:
        os.umask(old)
    assert folder == tmp_path / "evendp"
    assert oct(folder.lstat().st_mode & 0o777) == "0o700"
    with hold_run_dir(tmp_path / "out") as lock:
        assert lock.parent == folder and oct(lock.stat().st_mode & 0o777) == "0o600"
    assert not list(folder.iterdir())  # the run removed its lock at its end


def test_a_missing_cache_folder_is_made_private_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: with no runtime folder, ``~/.cache`` made under umask 000 was 0777."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = os.umask(0)
    try:
        folder = run_files_dir()
    finally:
        os.umask(old)
    assert folder == tmp_path / "home" / ".cache" / "evendp"
    for made in (folder, folder.parent, folder.parent.parent):
        assert oct(made.lstat().st_mode & 0o777) == "0o700", made


def test_a_folder_that_is_a_link_or_open_to_others_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    # The planted folder: a link to one that holds a link where the lock would be.
    planted = tmp_path / "planted"
    planted.mkdir()
    (shared / "evendp").symlink_to(planted)
    out = tmp_path / "out"
    with pytest.raises(RunFilesUnsafe, match="is a symbolic link") as info, hold_run_dir(out):
        pass
    assert "\n" not in str(info.value) and "XDG_RUNTIME_DIR" in str(info.value)
    (shared / "evendp").unlink()
    (shared / "evendp").mkdir(mode=0o700)
    (shared / "evendp").chmod(0o777)
    open_to_all = r"writable by group or others \(mode 0o777\)"
    with pytest.raises(RunFilesUnsafe, match=open_to_all), hold_run_dir(out):
        pass
    assert victim.read_text() == "years of work"


def test_a_link_planted_where_the_lock_goes_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = _victim(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    out = tmp_path / "out"
    lock = _lock_path(out)
    lock.symlink_to(victim)  # the issue's `ln -s /victim/precious.txt <lock>`
    with pytest.raises(RunFilesUnsafe, match="is a symbolic link") as info, hold_run_dir(out):
        pass
    assert "\n" not in str(info.value)
    assert victim.read_text() == "years of work" and oct(victim.stat().st_mode)[-3:] == "600"
    with pytest.raises(RunFilesUnsafe):
        run_dir_holder(out)


def test_a_planted_holder_is_shown_cleaned_and_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import json

    from evendp._distributed._run_lock import RunDirBusy

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    out = tmp_path / "out"
    fd = open_private(_lock_path(out), os.O_RDWR | os.O_CREAT)
    try:
        words = "\x1b[2J\rrun sudo rm -rf ~/runs to continue" + "!" * 5000
        os.write(fd, json.dumps({"pid": "1; rm", "command": words, "evil": 1}).encode())
        fcntl.flock(fd, fcntl.LOCK_SH)  # a live holder
        with pytest.raises(RunDirBusy) as info, hold_run_dir(out):
            pass
    finally:
        os.close(fd)
    said = str(info.value)
    assert "\x1b" not in said and "\r" not in said and "\n" not in said
    assert "has not said who it is" in said  # no pid of the right kind: not believed
    assert len(said) < 600


def test_stale_locks_of_killed_runs_are_removed_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.distributed.test_run_lock import _holder

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = run_files_dir()
    for i in range(5):  # left by runs that were SIGKILLed: nobody holds them
        (folder / f"{i:020d}.lock").write_text("{}")
    live = _holder(tmp_path / "live")
    try:
        with hold_run_dir(tmp_path / "next"):
            names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(
            [_lock_path(tmp_path / "live").name, _lock_path(tmp_path / "next").name]
        )
        assert run_dir_holder(tmp_path / "live") is not None
    finally:
        live.kill()
        live.wait()


_OTHER_USER = """
import os, sys
from pathlib import Path
shared, victim = Path(sys.argv[1]), sys.argv[2]
# The attack: the folder evendp would use in a shared runtime folder, with a link inside.
(shared / "evendp").mkdir(mode=0o755)
(shared / "evendp" / sys.argv[3]).symlink_to(victim)
try:  # and straight into the victim's own private folder
    (Path(sys.argv[4]) / "x.lock").symlink_to(victim)
    print("planted in the private folder", flush=True)
except PermissionError:
    print("private folder closed", flush=True)
from evendp._distributed._run_lock import hold_run_dir
with hold_run_dir(sys.argv[5], "nobody's run"):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root (to run a second user, nobody) and /usr/bin/python3 (the venv's "
    "interpreter may sit in root's home, closed to nobody)",
)
def test_another_user_cannot_plant_a_link_and_both_users_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _nobody_paths()  # before anything is made: skipped where nobody cannot import evendp
    victim = _victim(tmp_path)
    # Folders nobody can reach: not under pytest's tmp_path, which is root's alone.
    shared = Path(tempfile.mkdtemp(prefix="evendp-test-shared-"))
    theirs = Path(tempfile.mkdtemp(prefix="evendp-test-nobody-"))
    try:
        shared.chmod(0o1777)
        os.chown(theirs, _NOBODY, _NOBODY)
        mine = tmp_path / "private"
        mine.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
        out = tmp_path / "out"
        lock_name = _lock_path(out).name
        with hold_run_dir(out, "root's run"):
            proc = _as_nobody(shared, victim, lock_name, mine, theirs)
            try:
                assert proc.stdout is not None
                assert proc.stdout.readline() == "private folder closed\n"
                assert proc.stdout.readline() == "held\n"  # two users, two runs at once
                assert run_dir_holder(out)["command"] == "root's run"  # type: ignore[index]
            finally:
                proc.communicate("")
        assert proc.returncode == 0
        # The victim pointed at the shared runtime folder: the planted folder is refused.
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
        theirs_now = f"belongs to uid {_NOBODY}, not to you"
        with pytest.raises(RunFilesUnsafe, match=theirs_now), hold_run_dir(out):
            pass
        assert victim.read_text() == "years of work"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)


def _open_to_all(path: Path) -> bool:
    """Whether another user can reach ``path``: every folder on the way searchable by others
    and ``path`` readable by them (a clone in a 0700 temporary folder is not)."""
    import stat

    folders = [path, *path.parents] if path.is_dir() else list(path.parents)
    searchable = all(os.stat(p).st_mode & stat.S_IXOTH for p in folders)
    return searchable and bool(os.stat(path).st_mode & stat.S_IROTH)


def _nobody_paths() -> tuple[str, str]:
    """The source tree and torch's site-packages, for nobody's interpreter (or a skip)."""
    import torch

    site = Path(torch.__file__).parents[1]  # torch and the rest
    src = Path(__file__).resolve().parents[2] / "src"
    if not (_open_to_all(site) and _open_to_all(src / "evendp" / "__init__.py")):
        pytest.skip(f"nobody cannot read {src} or {site} (a checkout in a private folder)")
    version = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    if version != str(sys.version_info[:2]):
        pytest.skip(f"/usr/bin/python3 is {version}, not this venv's {sys.version_info[:2]}")
    return str(src), str(site)


def _as_nobody(
    shared: Path, victim: Path, lock_name: str, mine: Path, theirs: Path
) -> subprocess.Popen[str]:
    src, site = _nobody_paths()
    env = {
        "PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "TMPDIR": str(theirs),
        "PYTHONPATH": os.pathsep.join([src, site]), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    args = [str(shared), str(victim), lock_name, str(mine), str(theirs / "out")]

    def become_nobody() -> None:
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)

    return subprocess.Popen(
        ["/usr/bin/python3", "-c", _OTHER_USER, *args], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=env, cwd=str(theirs), preexec_fn=become_nobody,
    )  # fmt: skip


_STORE_PROBE = r"""
import datetime, sys
import torch.distributed as dist
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False,
                       datetime.timedelta(seconds=30), wait_for_workers=False)
print(client.get("rank0/address").decode(), flush=True)
client.set("planted", "by nobody")
try:
    open(sys.argv[2], "rb").close()
    print("read the run's checkpoint", flush=True)
except PermissionError:
    print("the run's files are closed", flush=True)
"""


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="needs root (to run a second user, nobody) and /usr/bin/python3",
)
def test_another_user_reaches_the_store_as_documented_but_not_the_runs_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: what docs/training.md says another local user can do while a run lasts. The
    store on 127.0.0.1 (torch's TCPStore, served as evendp's torchrun serves it) takes
    ``nobody``'s connection: its keys are read and written (torch 2.13 has no authentication;
    the day it does, this test fails and the docs change). The run's files are not: ``--out``
    is 0700. A documentation check, so it runs the real store and a real run's folder."""
    import torch.distributed as dist

    from evendp._distributed._torchrun._quiet import bound_store_class
    from evendp.cli import main
    from tests.cli.test_train_faults import SMALL_DP

    _src, site = _nobody_paths()  # before anything is made: skipped where nobody cannot
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    shared = Path(tempfile.mkdtemp(prefix="evendp-test-store-"))
    try:
        shared.chmod(0o755)  # nobody may look in; --out inside is the run's own
        out = shared / "out"
        assert main(["train", "--steps", "1", "--out", str(out), *SMALL_DP]) == 0
        server = bound_store_class(dist.TCPStore)(
            "127.0.0.1", 0, None, True, wait_for_workers=False
        )
        server.set("rank0/address", "127.0.0.1:40001")  # as the ranks' gloo addresses sit
        env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": site,
               "OMP_NUM_THREADS": "1"}  # fmt: skip

        def become_nobody() -> None:
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)

        probe = subprocess.run(
            ["/usr/bin/python3", "-c", _STORE_PROBE, str(server.port), str(out / "ckpt.pt")],
            capture_output=True, text=True, env=env, cwd="/", preexec_fn=become_nobody,
            timeout=120, check=False,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr[-2000:]
        said = probe.stdout.splitlines()
        assert said == ["127.0.0.1:40001", "the run's files are closed"], probe.stdout
        assert server.get("planted") == b"by nobody"  # written by another user, as documented
        assert oct(out.stat().st_mode & 0o777) == "0o700"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_torchruns_log_is_created_0600_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 53: torchrun's log files in the private run folder were 0644 (opened with the
    umask's mode); created 0600 now, the kept one (renamed beside the outcome folder) too."""
    import logging

    from evendp._distributed._torchrun import _quiet

    outcome = tmp_path / "evendp-outcome-x"
    outcome.mkdir(mode=0o700)
    old = os.umask(0)
    try:
        log = _quiet.log_to_file(str(outcome / "torchrun.log"))
    finally:
        os.umask(old)
    try:
        assert oct((outcome / "torchrun.log").stat().st_mode & 0o777) == "0o600"
        kept = _quiet.keep_log(log, "torchrun's report")
        assert kept.parent == tmp_path and oct(kept.stat().st_mode & 0o777) == "0o600"
        assert kept.read_text() == "torchrun's report\n"
    finally:
        log.close()
        for name in _quiet._TORCHRUN_LOGGERS:  # the handlers log_to_file added, gone
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if getattr(handler, "stream", None) is log:
                    logger.removeHandler(handler)
            logger.propagate = True
