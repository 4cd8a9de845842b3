"""Nothing lost: a fresh run never replaces another run's checkpoint unasked, output targets are
checked before any work, and contradictory options are refused (exit 2, one line)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from evendp.cli import main
from tests._other_user import OTHER_UID, as_other, needs_root, shared_folder

TINY = ["--devices", "cpu", "--batch", "4", "--steps", "1", "--no-progress", "--no-plan",
        "--n-layer", "1", "--n-embd", "16", "--block-size", "16",
        "--max-chars", "10000"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_a_second_fresh_run_into_the_same_out_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY, "--out", str(tmp_path)]) == 0
    saved = (tmp_path / "ckpt.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path)]) == 2
    err = _one_line(capsys)
    for words in ("--resume", "--resume-or-start", "fresh --out", "--overwrite", "ckpt.pt"):
        assert words in err
    assert (tmp_path / "ckpt.pt").read_bytes() == saved  # untouched


def test_overwrite_starts_over_and_deletes_the_old_checkpoint(tmp_path: Path) -> None:
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path)]) == 0
    assert main(["train", *TINY, "--overwrite", "--out", str(tmp_path)]) == 0
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1  # a fresh run's
    assert not (tmp_path / "ckpt.prev.pt").exists()  # the old run's step 2 is gone


def test_make_demo_runs_twice(tmp_path: Path) -> None:
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None
    words = shlex.split(recipe.group(1))
    args = words[words.index("train") :]  # `$(VENV)/bin/evendp train ...`
    for _ in range(2):
        assert main([*args, *TINY, "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize(
    ("target", "words"),
    [("afile", "is a file, not a folder"), ("/proc/evendp-run", "cannot write in '/proc'")],
)
def test_out_is_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, words: str
) -> None:
    if target == "afile":
        target = str(tmp_path / "afile")
        Path(target).write_text("")
    assert main(["train", *TINY, "--out", target]) == 2
    assert words in _one_line(capsys)


@pytest.mark.parametrize(
    ("plot", "words"),
    [("missing/dir/p.png", "does not exist"), (".", "is a folder")],
)
def test_plan_plot_is_checked_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plot: str, words: str
) -> None:
    code = main(["plan", "--model", "gpt", "--memory", "1GiB", "--plot", str(tmp_path / plot)])
    assert code == 2
    err = _one_line(capsys)
    assert "--plot" in err and words in err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--resume", "--resume-or-start"], "contradict"),
        (["--overwrite", "--resume"], "contradict"),
        (["--accum", "100", "--batch", "32"], "--accum 100"),
    ],
)
def test_contradictory_options_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    assert main(["train", *TINY, *extra, "--out", str(tmp_path)]) == 2
    assert words in _one_line(capsys)


def test_overwrite_deletes_only_evendps_own_checkpoint_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path)]) == 0
    (tmp_path / "ckpt.backups").mkdir()
    (tmp_path / "ckpt.backups" / "best.pt").write_bytes(b"the user's best weights")
    (tmp_path / "ckpt.notes.txt").write_text("the user's notes")
    capsys.readouterr()
    assert main(["train", *TINY, "--overwrite", "--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "deleted 1 checkpoint file(s)" in said and "ckpt.pt" in said
    assert (tmp_path / "ckpt.backups" / "best.pt").read_bytes() == b"the user's best weights"
    assert (tmp_path / "ckpt.notes.txt").read_text() == "the user's notes"
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1


def test_an_out_holding_files_that_are_not_a_runs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "report.json").write_text('{"mine": true}')
    (tmp_path / "thesis.tex").write_text("chapter 1")
    assert main(["train", *TINY, "--out", str(tmp_path)]) == 2
    err = _one_line(capsys)
    assert "not an evendp run's ('thesis.tex')" in err and "empty or new folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "thesis.tex"]
    assert (tmp_path / "report.json").read_text() == '{"mine": true}'


def test_an_out_at_a_dangling_link_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    assert main(["train", *TINY, "--out", str(link)]) == 2
    assert "does not exist" in _one_line(capsys)
    assert not (tmp_path / "gone").exists()


def test_a_run_replaces_report_links_planted_in_its_out(tmp_path: Path) -> None:
    """Issue 34's reproduction: an --out with evendp's marker and links in place of the
    reports (to another user's files): the run ends normally, those files are untouched."""
    from evendp.cli._run_folder import MARKER
    from tests.training.test_report import _plant_links

    out, theirs = tmp_path / "R", tmp_path / "theirs"
    out.mkdir(), theirs.mkdir()
    (out / MARKER).write_text("{}")
    targets = _plant_links(out, theirs)
    assert main(["train", *TINY, "--steps", "3", "--log-to", "csv", "--out", str(out)]) == 0
    assert [t.read_text() for t in targets] == ["theirs"] * 4
    assert (out / "metrics.csv").read_text().count("\n") == 4  # a header and 3 steps
    for name in ("report.json", "report.txt", "report.png", "metrics.csv"):
        assert not (out / name).is_symlink() and (out / name).stat().st_nlink == 1, name


@pytest.mark.parametrize("foreign", [True, False], ids=["foreign_files", "alone"])
@pytest.mark.parametrize("planted", ["symlink", "folder"])
def test_a_marker_that_is_a_link_or_a_folder_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str, foreign: bool
) -> None:
    """Issue 34: a symbolic link as the marker let another user's files through the check; a
    link or a folder there ended in a FileExistsError traceback."""
    from evendp.cli._run_folder import MARKER

    out, theirs = tmp_path / "R", tmp_path / "theirs.json"
    out.mkdir()
    theirs.write_text("{}")
    if foreign:
        (out / "notes.txt").write_text("mine")  # a foreign file the marker would let through
    if planted == "symlink":
        (out / MARKER).symlink_to(theirs)
    else:
        (out / MARKER).mkdir()
    assert main(["train", *TINY, "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert str(out) in err and "--out" in err, err
    assert sorted(p.name for p in out.iterdir()) == [MARKER] + ["notes.txt"] * foreign
    assert ("notes.txt" if foreign else "not the marker evendp writes") in err, err
    assert theirs.read_text() == "{}"


def _deepspeed_run_folder(out: Path) -> Path:
    """What a --mode deepspeed run leaves in --out (the names DeepSpeed 0.19 and evendp write)."""
    ckpt = out / "ckpt.ds"
    for step in ("step2", "step4"):
        (ckpt / step).mkdir(parents=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_to_fp32.py", "zero_to_torch.py"):  # fmt: skip
            (ckpt / step / name).write_bytes(b"theirs")
    for name in ("state.pt", "state.prev.pt", "state.rng1.pt", "state.prev.rng1.pt"):
        (ckpt / name).write_bytes(b"theirs")
    (out / ".evendp-run.json").write_text("{}")
    return ckpt


def test_another_runs_deepspeed_checkpoint_is_refused_and_overwrite_removes_only_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34: a fresh --mode deepspeed run into an --out holding another run's ckpt.ds
    deleted its step folders; it is refused as the other modes' checkpoints are, before any
    launch, and --overwrite deletes that folder and nothing else."""
    from evendp.cli._run_folder import claim_out_dir

    ckpt = _deepspeed_run_folder(tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    args = ["train", *TINY, "--mode", "deepspeed", "--devices", "cpu,cpu", "--out", str(tmp_path)]
    assert main(args) == 2
    err = _one_line(capsys)
    assert "another run's checkpoint (ckpt.ds)" in err and "--overwrite" in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    (tmp_path / "ckpt.notes.txt").write_text("mine")
    assert claim_out_dir(str(tmp_path), overwrite=True) == [ckpt]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".evendp-run.json", "ckpt.notes.txt"]
    assert (tmp_path / "ckpt.notes.txt").read_text() == "mine"


@pytest.mark.parametrize("planted", ["link", "foreign_folder", "foreign_step_file"])
def test_a_checkpoint_name_that_is_not_a_runs_file_is_refused_even_with_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    """A link at ckpt.pt, or a ckpt.ds holding another program's files: a run would write
    through or into it, and --overwrite may delete only what a run wrote."""
    out, theirs = tmp_path / "R", tmp_path / "theirs"
    out.mkdir(), theirs.mkdir()
    (theirs / "f").write_text("theirs")
    if planted == "link":
        (out / "ckpt.pt").symlink_to(theirs / "f")
    elif planted == "foreign_folder":
        (out / "ckpt.ds").mkdir()
        (out / "ckpt.ds" / "thesis.tex").write_text("chapter 1")
    else:
        _deepspeed_run_folder(out)
        (out / "ckpt.ds" / "step4" / "notes.txt").write_text("mine")
    snapshot = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert main(["train", *TINY, "--overwrite", "--out", str(out)]) == 2
    err = _one_line(capsys)
    name = "ckpt.pt" if planted == "link" else "ckpt.ds"
    assert f"{name} there is" in err and "move it away" in err, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == snapshot
    assert (theirs / "f").read_text() == "theirs"


def test_a_tensorboard_link_in_out_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34: ``--log-to tensorboard`` wrote its event files through a ``tensorboard`` link
    planted in ``--out`` (into another user's folder)."""
    pytest.importorskip("torch.utils.tensorboard")
    from evendp.cli._run_folder import MARKER

    out, theirs = tmp_path / "R", tmp_path / "theirs"
    out.mkdir(), theirs.mkdir()
    (out / MARKER).write_text("{}")
    (out / "tensorboard").symlink_to(theirs)
    assert main(["train", *TINY, "--log-to", "tensorboard", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert "tensorboard' is a link" in err and "another --out" in err, err
    assert list(theirs.iterdir()) == []


def test_overwrite_refuses_a_folder_without_the_marker_and_leaves_it_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: --overwrite deleted a ``ckpt.pt`` in a folder no evendp run had marked (another
    program's file of that name); it now deletes only what a marked run folder holds."""
    (tmp_path / "ckpt.pt").write_bytes(b"another program's weights")
    assert main(["train", *TINY, "--overwrite", "--out", str(tmp_path)]) == 2
    err = _one_line(capsys)
    assert "has no .evendp-run.json" in err and "ckpt.pt" in err and "another --out" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # nothing written
    assert (tmp_path / "ckpt.pt").read_bytes() == b"another program's weights"


@pytest.mark.parametrize("mode", ["dp", "ddp"])
def test_a_refused_run_leaves_nothing_behind(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], mode: str
) -> None:
    """issue 36: a run refused after its --out was claimed (a batch larger than the data) left
    a folder holding only .evendp-run.json; a folder that was there stays, empty. Under ddp
    the ranks refuse it (the launcher has not read the data) and the launcher cleans up."""
    too_big = ["--batch", "100000", "--mode", mode, "--devices", "cpu,cpu"]
    new, kept = tmp_path / "new", tmp_path / "kept"
    kept.mkdir()
    for out in (new, kept) if mode == "dp" else (new,):  # ddp: one launch is enough
        assert main(["train", *TINY, *too_big, "--out", str(out)]) == 2
        assert "--batch 100000 is more than the" in capfd.readouterr().err  # a rank's, too
    assert not new.exists()
    assert kept.is_dir() and list(kept.iterdir()) == []  # there before: kept, and empty


# -- issue 53: a second user on the same machine -----------------------------------------------


def _a_run(folder: Path) -> dict[str, bytes]:
    """A run folder as a run leaves it (its marker and two checkpoints); its bytes by name."""
    from evendp.cli._run_folder import MARKER

    folder.mkdir(parents=True, mode=0o700)
    (folder / MARKER).write_text("{}")
    (folder / "ckpt.pt").write_bytes(b"the baseline's step 4")
    (folder / "ckpt.prev.pt").write_bytes(b"the baseline's step 2")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@needs_root
def test_an_out_another_user_made_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's first case: ``--out`` made by the other user, 0777, trained in with no word."""
    shared = shared_folder(tmp_path)

    def plant() -> None:
        os.mkdir("a1")
        os.chmod("a1", 0o777)

    as_other(shared, plant)
    for resume in ([], ["--resume"]):
        assert main(["train", *TINY, *resume, "--out", str(shared / "a1")]) == 2
        err = _one_line(capsys)
        assert f"--out {str(shared / 'a1')!r} belongs to uid {OTHER_UID}" in err, err
        assert "give a new --out" in err and "Traceback" not in err, err
    assert list((shared / "a1").iterdir()) == []


@needs_root
def test_overwrite_through_another_users_link_leaves_the_other_run_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's second case: the other user's link to the victim's baseline run, and the
    victim's ``--out LINK --overwrite`` deleted the baseline's checkpoints."""
    shared = shared_folder(tmp_path)
    baseline = tmp_path / "runs" / "baseline"
    before = _a_run(baseline)
    as_other(shared, lambda: os.symlink(baseline, "a4"))
    for extra in (["--overwrite"], ["--resume"], []):
        assert main(["train", *TINY, *extra, "--out", str(shared / "a4")]) == 2
        err = _one_line(capsys)
        assert f"is a symbolic link owned by uid {OTHER_UID}" in err, err
        assert "give the real path of a folder of yours" in err, err
    assert {p.name: p.read_bytes() for p in baseline.iterdir()} == before  # byte for byte


def test_overwrite_through_ones_own_link_says_the_real_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link of the user's own is followed, and what --overwrite deleted is said by the
    folder it deleted in, not by the link."""
    import argparse

    from evendp.cli._train_args import fresh_start_check

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    baseline = tmp_path / "runs" / "baseline"
    _a_run(baseline)
    (tmp_path / "latest").symlink_to(baseline)
    args = argparse.Namespace(
        out=str(tmp_path / "latest"), overwrite=True, resume=False, resume_or_start=False
    )
    fresh_start_check(args)
    said = capsys.readouterr().out
    assert f"deleted 2 checkpoint file(s) in {str(baseline)!r}: ckpt.prev.pt, ckpt.pt" in said
    assert sorted(p.name for p in baseline.iterdir()) == [".evendp-run.json"]


def test_neither_checkpoint_readable_ends_the_way_the_message_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckpt.pt`` a link to /dev/zero, ``ckpt.prev.pt`` a FIFO: the resume says "neither can
    be resumed ... or --overwrite to delete them", and --overwrite then does (it refused
    the FIFO); /dev/zero is never opened for writing, the link is removed, not followed."""
    from evendp.cli._run_folder import MARKER

    out = tmp_path / "R"
    out.mkdir(mode=0o700)
    (out / MARKER).write_text("{}")
    (out / "ckpt.pt").symlink_to("/dev/zero")
    os.mkfifo(out / "ckpt.prev.pt")
    assert main(["train", *TINY, "--resume", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert "a link to '/dev/zero', a character device" in err and "a FIFO" in err, err
    assert "neither can be resumed" in err and "--overwrite to delete them" in err, err
    assert main(["train", *TINY, "--out", str(out)]) == 2  # a fresh run: told --overwrite
    assert "or pass --overwrite to delete it" in _one_line(capsys)
    assert main(["train", *TINY, "--overwrite", "--out", str(out)]) == 0
    assert "deleted 2 checkpoint file(s)" in capsys.readouterr().out
    assert not (out / "ckpt.pt").is_symlink() and not (out / "ckpt.prev.pt").exists()
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 1


@needs_root
def test_a_marker_another_user_left_is_not_evendps(tmp_path: Path) -> None:
    """Left while the folder was open to them (then ``chmod go-w`` as the refusal says): their
    marker does not make the folder a run's, and is never taken for evendp's own."""
    import shutil

    from evendp._core._errors import EvendpError
    from evendp.cli._run_folder import MARKER, claim_out_dir

    out = tmp_path / "R"
    out.mkdir(mode=0o700)
    (out / MARKER).write_text("{}")
    shutil.chown(out / MARKER, OTHER_UID, OTHER_UID)
    with pytest.raises(EvendpError) as info:
        claim_out_dir(str(out), overwrite=False)
    said = str(info.value)
    assert f"{MARKER} there is a file of uid {OTHER_UID}, not the marker evendp writes" in said
    assert "remove it if the folder is yours" in said and "\n" not in said
