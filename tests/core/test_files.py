"""evendp._core._files: a name in --out is replaced, never written through; appends go only
to a regular file of one name (issue 34)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evendp._core._files import open_append, replace_file
from tests._other_user import OTHER_UID, as_other, needs_root, shared_folder


def test_replace_removes_a_killed_writers_temporary_file_and_leaves_none_of_its_own(
    tmp_path: Path,
) -> None:
    stale = tmp_path / ".report.json.abc123.tmp"
    stale.write_text("half a report")
    replace_file(tmp_path / "report.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o600


def test_a_failed_replace_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.mkdir()  # the rename cannot replace a folder
    (target / "kept").write_text("x")
    with pytest.raises(OSError):
        replace_file(target, b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert (target / "kept").read_text() == "x"


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "folder"])
def test_append_only_to_a_regular_file_of_one_name(tmp_path: Path, planted: str) -> None:
    theirs, path = tmp_path / "theirs.csv", tmp_path / "metrics.csv"
    theirs.write_text("theirs\n")
    if planted == "symlink":
        path.symlink_to(theirs)
    elif planted == "hardlink":
        os.link(theirs, path)
    else:
        path.mkdir()
    assert open_append(path) is None
    assert theirs.read_text() == "theirs\n"


def test_append_to_a_regular_file_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step\n")
    fd = open_append(path)
    assert fd is not None
    with os.fdopen(fd, "w") as f:
        f.write("1\n")
    assert path.read_text() == "step\n1\n"


@needs_root
def test_a_folder_another_user_makes_first_is_not_written_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 53: a run checks its missing ``--out`` at its start and makes it at its first
    save; another user who makes it in between (in a shared sticky folder) is refused, not
    joined."""
    from evendp._core._files import mkdir_private

    shared = shared_folder(tmp_path)
    made = Path.mkdir

    def raced(self: Path, *args: object, **kwargs: object) -> None:
        if self.name == "run":  # the other user is quicker, between the look and the mkdir
            as_other(shared, lambda: os.mkdir("run", 0o777))
        made(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", raced)
    with pytest.raises(PermissionError, match=f"made meanwhile by uid {OTHER_UID}"):
        mkdir_private(shared / "run" / "deeper")
    assert list((shared / "run").iterdir()) == []
