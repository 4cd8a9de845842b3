"""A run folder another local user controls is refused (issue 53, item 1), as OpenSSH's
StrictModes refuses what another user can write and ``fs.protected_symlinks`` refuses their
links: the folder itself, the folders above it, the links on the way. As root, a second uid
plants them for real (:mod:`tests._other_user`); the mode checks run as any user."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evendp._core._trusted import UntrustedFolder, trusted_run_folder
from evendp._distributed._run_lock import hold_run_dir, trainer_lock
from tests._other_user import OTHER_UID, as_other, needs_root, shared_folder


def _refused(path: Path | str, *words: str) -> str:
    with pytest.raises(UntrustedFolder) as info:
        trusted_run_folder(path)
    said = str(info.value)
    assert "\n" not in said and said.startswith("--out "), said
    for word in words:
        assert word in said, said
    return said


def test_a_folder_of_ones_own_new_or_private_is_taken_by_its_real_path(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "runs")  # a link of one's own: followed
    assert trusted_run_folder(tmp_path / "link") == tmp_path.resolve() / "runs"
    assert trusted_run_folder(str(tmp_path / "link" / "new" / "x")) == (
        tmp_path.resolve() / "runs" / "new" / "x"
    )  # not there yet: made by the run, 0700
    assert trusted_run_folder(tmp_path / "runs" / ".." / "runs") == tmp_path.resolve() / "runs"


def test_a_sticky_folder_open_to_all_above_the_run_is_fine(tmp_path: Path) -> None:
    shared = shared_folder(tmp_path)  # as /tmp: others cannot rename what is one's own
    (shared / "mine").mkdir(mode=0o700)
    assert trusted_run_folder(shared / "mine") == shared.resolve() / "mine"
    assert trusted_run_folder(shared / "new") == shared.resolve() / "new"


@pytest.mark.parametrize("mode", [0o777, 0o702, 0o1777])
def test_a_run_folder_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(mode)
    # A sticky folder (as /tmp) is open on purpose: the fix is a folder of one's own inside it.
    fix = (
        f"give a new --out inside it, e.g. '{out.resolve() / 'run'}'"
        if mode & 0o1000
        else "chmod go-w"
    )
    said = _refused(out, f"(mode {oct(mode)})", "writable by group or others", fix)
    assert str(out) in said


@needs_root
def test_a_run_folder_writable_by_a_shared_group_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, -1, OTHER_UID)  # a group of others (here: no such group, so not private)
    out.chmod(0o770)
    _refused(out, "(mode 0o770)", "writable by group or others")


def test_a_private_group_of_an_account_nss_does_not_list_is_private(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sssd and LDAP do not enumerate accounts (``getpwall`` lists /etc/passwd's alone): a
    user's own group of one is still theirs alone (found in review: a umask-002 user's
    ``~/runs`` was refused as writable by group)."""
    import grp
    import pwd

    from evendp._core._trusted import _private_group

    account = pwd.getpwuid(os.geteuid())
    if grp.getgrgid(account.pw_gid).gr_mem not in ([], [account.pw_name]):
        pytest.skip("this user's primary group lists other members")
    if any(p.pw_gid == account.pw_gid and p.pw_uid != account.pw_uid for p in pwd.getpwall()):
        pytest.skip("this user's primary group is another account's primary group too")
    monkeypatch.setattr(pwd, "getpwall", lambda: [])
    assert _private_group(account.pw_gid, account.pw_uid)


def test_a_group_of_ones_own_alone_may_write(tmp_path: Path) -> None:
    """Where the umask is 002 (user private groups: Debian, Ubuntu), ``mkdir`` makes folders
    0775 of the user's own group of one member: writable by the user alone, so accepted (as
    Debian's OpenSSH accepts them)."""
    from evendp._core._trusted import _private_group

    if not _private_group(os.getegid(), os.geteuid()):
        pytest.skip(f"this user's group (gid {os.getegid()}) has other members")
    above = tmp_path / "runs"
    above.mkdir()
    above.chmod(0o775)
    (above / "x").mkdir()
    (above / "x").chmod(0o775)
    assert trusted_run_folder(above / "x") == above.resolve() / "x"


def test_a_folder_above_the_run_open_to_others_and_not_sticky_is_refused(tmp_path: Path) -> None:
    above = tmp_path / "team"
    above.mkdir()
    above.chmod(0o777)  # anyone may rename the run folder away and put theirs in its place
    _refused(above / "run", f"the folder {str(above)!r} above it", "not sticky", "(mode 0o777)")
    _refused(above / "run" / "deeper", f"the folder {str(above)!r} above it")


def test_a_loop_of_links_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    _refused(tmp_path / "a" / "run", "symbolic links on the way")


@needs_root
def test_another_users_folder_is_refused_for_every_writer(tmp_path: Path) -> None:
    """The issue's first case: ``--out`` made by the other user (0777, theirs), and the same
    made 0700: theirs either way, so theirs to replace between runs. The Trainer's lock and
    ``evendp launch``'s take the same check."""
    shared = shared_folder(tmp_path)

    def plant() -> None:
        os.mkdir("a1", 0o777)
        os.chmod("a1", 0o777)
        os.mkdir("a2", 0o700)

    as_other(shared, plant)
    _refused(shared / "a1", f"belongs to uid {OTHER_UID}", "not to you", "new --out")
    _refused(shared / "a2", f"belongs to uid {OTHER_UID}")
    for writer in (
        lambda: hold_run_dir(shared / "a1").__enter__(),
        lambda: trainer_lock(shared / "a1", distributed=False).__enter__(),
        lambda: trainer_lock(shared / "a1", distributed=True),  # plain torchrun: no lock
    ):
        with pytest.raises(UntrustedFolder, match="belongs to uid"):
            writer()
    assert list((shared / "a1").iterdir()) == []  # nothing written there


@needs_root
def test_another_users_link_on_the_way_is_refused_and_ones_own_is_followed(
    tmp_path: Path,
) -> None:
    """The issue's second case: the other user's link to one of the victim's runs, as the
    run folder itself or as a folder on the way; the victim's own link to the same run is
    followed (``fs.protected_symlinks`` alike)."""
    shared = shared_folder(tmp_path)
    baseline = tmp_path / "runs" / "baseline"
    baseline.mkdir(parents=True, mode=0o700)

    def plant() -> None:
        os.symlink(baseline, "a4")
        os.symlink(tmp_path / "runs", "runs")

    as_other(shared, plant)
    _refused(shared / "a4", f"{str(shared / 'a4')!r} is a symbolic link owned by uid {OTHER_UID}")
    _refused(shared / "runs" / "baseline", "is a symbolic link owned by uid")
    (shared / "mine").symlink_to(baseline)
    assert trusted_run_folder(shared / "mine") == baseline.resolve()


@needs_root
def test_a_folder_above_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    shared = shared_folder(tmp_path)
    as_other(shared, lambda: os.mkdir("theirs", 0o755))
    _refused(shared / "theirs" / "run", "above it belongs to uid", "only you (or root)")
