"""Output paths checked before any work: a run must not train for minutes and then find it
cannot write (a probe file really created: permission bits miss read-only file systems), nor
delete or replace what is not evendp's.

A run folder carries a marker, ``.evendp-run.json``. ``--out`` is accepted when it is missing,
empty, marked, or holds only files evendp writes; ``--overwrite`` deletes only evendp's own
checkpoints of a marked folder, by their exact names, never following a link.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from .._core._errors import EvendpError
from .._core._files import mkdir_private
from .._core._trusted import describe_owner, trusted_run_folder
from .._core._validate import shown, validate_path

__all__ = [
    "MARKER",
    "check_out_dir",
    "check_out_file",
    "claim_out_dir",
    "unclaim_out_dir",
]

MARKER = ".evendp-run.json"

# Checkpoint files and folders evendp writes (a crashed save's temporary ones included).
_CHECKPOINT = re.compile(
    r"ckpt(\.prev)?(\.rng\d+)?\.pt|ckpt(\.prev)?\.dcp|ckpt\.ds|\.ckpt\..+\.tmp"
)
# Everything else a run writes in --out (and a report's temporary file, left by a kill).
_OUTPUTS = {"report.json", "report.txt", "report.png", "metrics.csv", "tensorboard", MARKER}
_OUTPUT_TMP = re.compile(r"\.report\.(json|txt|png)\..+\.tmp")
# What a DCP folder of evendp's holds.
_DCP_ENTRY = re.compile(r"\.metadata|__\d+_\d+\.distcp|state\.pt|rng\d+\.pt|\..+\.tmp")
# What a DeepSpeed folder (ckpt.ds) holds: evendp's position files, and a folder per kept step
# of DeepSpeed's partition files and the recovery scripts DeepSpeed copies beside them.
_DS_ENTRY = re.compile(r"state(\.prev)?(\.rng\d+)?\.pt|\..+\.tmp")
_DS_STEP = re.compile(r"step\d+")
_DS_STEP_ENTRY = re.compile(r"\w+_states\.pt|zero_to_(fp32|torch)\.py|\..+\.tmp")


def _is_ours(entry: Path) -> bool:
    name = entry.name
    return name in _OUTPUTS or any(p.fullmatch(name) for p in (_CHECKPOINT, _OUTPUT_TMP))


def foreign_entries(out: Path) -> list[str]:
    """The names in ``out`` that no evendp run writes (none when ``out`` carries the marker)."""
    if not out.is_dir() or _is_marker(out / MARKER):
        return []
    return sorted(p.name for p in out.iterdir() if not _is_ours(p))


def _checkpoints(out: Path) -> tuple[list[Path], list[Path]]:
    """evendp's own checkpoint files and folders in ``out`` (any mode's, previous included:
    exact names, no links, a folder only when all it holds is what a run writes there), and
    what sits at a checkpoint's name that is neither a file nor a folder (a link, a FIFO, a
    device node): a resume refuses it, ``--overwrite`` unlinks it.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); os.mkfifo(d / "ckpt.prev.pt")
    >>> (d / "ckpt.pt").symlink_to("/dev/zero"); [p.name for p in _checkpoints(d)[1]]
    ['ckpt.prev.pt', 'ckpt.pt']
    """
    if not out.is_dir():
        return [], []
    named = [entry for entry in sorted(out.iterdir()) if _CHECKPOINT.fullmatch(entry.name)]
    ours = [
        p for p in named if _regular(p, _CHECKPOINT) or (_is_folder(p) and _written_by_a_run(p))
    ]
    odd = [p for p in named if not stat.S_ISDIR(m := p.lstat().st_mode) and not stat.S_ISREG(m)]
    return ours, odd


def _written_by_a_run(folder: Path) -> bool:
    """Whether all ``folder`` (a ``ckpt.dcp`` or ``ckpt.ds``) holds is what a run writes there:
    regular files of the format's names, and for DeepSpeed its step folders."""
    if folder.suffix == ".ds":
        return all(
            _regular(p, _DS_ENTRY)
            or (_DS_STEP.fullmatch(p.name) is not None and _is_folder(p) and all(
                _regular(q, _DS_STEP_ENTRY) for q in p.iterdir()
            ))
            for p in folder.iterdir()
        )  # fmt: skip
    return all(_regular(p, _DCP_ENTRY) for p in folder.iterdir())


def _regular(path: Path, names: re.Pattern[str]) -> bool:
    return names.fullmatch(path.name) is not None and path.is_file() and not path.is_symlink()


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def claim_out_dir(out: str, *, overwrite: bool) -> list[Path]:
    """Before a fresh run's work: refuse an ``out`` another user controls, a dangling link, or
    one holding files not a run's or (without ``overwrite``) checkpoints; else delete those
    (returned, by their real paths) and mark ``out`` as a run folder."""
    folder = trusted_run_folder(out)  # every deletion below is in this real folder
    given = Path(out)
    if given.is_symlink() and not given.exists():
        raise EvendpError(
            f"--out {shown(out)} is a link to {shown(os.readlink(given))}, which does not "
            "exist; create its target, or give another --out"
        )
    foreign = foreign_entries(folder)
    if foreign:
        listed = ", ".join(shown(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise EvendpError(
            f"--out {_named(out, folder)} holds files that are not an evendp run's ({listed}); "
            "its report and checkpoint files would replace same-named ones; give an empty or "
            "new folder, e.g. --out runs/x"
        )
    marked = _is_marker(folder / MARKER)
    found, odd = _checkpoints(folder)
    _refuse_lookalikes(folder, found + odd if overwrite and marked else found, marked, odd)
    found = sorted(found + odd)
    if found and overwrite and not marked:
        raise EvendpError(
            f"--overwrite deletes the checkpoints of a run folder, but {_named(out, folder)} has "
            f"no {MARKER} (every evendp train run writes one), so its {found[0].name} may be "
            "another program's; delete it yourself if it is a run's, or give another --out"
        )
    if found and not overwrite:
        raise EvendpError(
            f"--out {_named(out, folder)} holds another run's checkpoint ({found[0].name}); "
            "continue it with --resume (or --resume-or-start), train into a fresh --out, or "
            "pass --overwrite to delete it and start over"
        )
    for path in found:
        if path.is_dir() and path not in odd:
            shutil.rmtree(path)
        else:  # a file, or the link or the FIFO itself: never opened, never followed
            path.unlink()
    _mark(folder)
    return found


def _named(out: str, folder: Path) -> str:
    """``out`` as given, and the real folder when it differs (a link of the user's own)."""
    if os.path.abspath(out) == str(folder):
        return shown(out)
    return f"{shown(out)} (the folder {shown(str(folder))})"


def unclaim_out_dir(out: str, *, created: bool) -> None:
    """A run refused before it wrote anything leaves nothing behind: the marker, alone in the
    folder, goes, and the folder too when the claim ``created`` it."""
    folder = Path(out)
    if not _is_folder(folder) or [e.name for e in folder.iterdir()] != [MARKER]:
        return
    if _is_marker(folder / MARKER):
        (folder / MARKER).unlink()
        if created:
            folder.rmdir()


def _refuse_lookalikes(folder: Path, found: list[Path], marked: bool, odd: list[Path]) -> None:
    """Refuse a checkpoint name that is not a run's file (a link, a FIFO, a folder of other
    files); in a run folder (``marked``) an ``odd`` one may go with ``--overwrite``."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if _CHECKPOINT.fullmatch(entry.name) and entry not in found:
            what = "a link" if entry.is_symlink() else "not a file an evendp run writes"
            if not entry.is_symlink() and entry.is_dir():
                what = "a folder holding files an evendp run does not write"
            also = ", or pass --overwrite to delete it" if marked and entry in odd else ""
            raise EvendpError(
                f"--out {shown(str(folder))}: {entry.name} there is {what}; a run would write "
                f"its checkpoint there: move it away{also}, or pass another --out"
            )


def _is_marker(path: Path) -> bool:
    """evendp's marker: a regular file of this user's (a planted link, or another user's
    file, would let foreign files through the check)."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _mark(folder: Path) -> None:
    try:
        mkdir_private(folder)  # 0700 when it is new
    except OSError as exc:
        raise EvendpError(
            f"--out {shown(str(folder))}: could not create the folder: "
            f"{exc.strerror or type(exc).__name__}; fix the permissions or pass another --out"
        ) from None
    marker = folder / MARKER
    if _is_marker(marker):
        return
    if os.path.lexists(marker):
        kind = "a folder" if marker.is_dir() else "not a regular file"
        if stat.S_ISREG(marker.lstat().st_mode):
            kind = f"a file of {describe_owner(marker.lstat().st_uid)}"
        what = "a symbolic link" if marker.is_symlink() else kind
        raise EvendpError(
            f"--out {shown(str(folder))}: {MARKER} there is {what}, not the marker evendp "
            "writes; remove it if the folder is yours, or pass another --out"
        )
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": "evendp-run", "written_by": "evendp train"}, f)


def check_out_dir(flag: str, path: str) -> None:
    """``path`` is a folder, or can be made one, no other local user controls it
    (:func:`~evendp._core._trusted.trusted_run_folder`), and files can be written in it.

    >>> check_out_dir("--out", "/proc/evendp-run")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: --out '/proc/evendp-run': cannot write in '/proc' ...
    """
    validate_path(flag, path)
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise EvendpError(
            f"{flag} {shown(path)} is a file, not a folder; give a folder (created if missing), "
            f"e.g. {flag} runs/x"
        )
    trusted_run_folder(path, flag)
    _check_writable(flag, path, _nearest_existing(target))


def check_out_file(flag: str, path: str) -> None:
    """``path`` can be written as a file: its folder exists and is writable, it is no folder.

    >>> check_out_file("--plot", "/missing/dir/p.png")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: --plot '/missing/dir/p.png': the folder '/missing/dir' does ...
    """
    validate_path(flag, path)
    target = Path(path)
    if target.is_dir():
        raise EvendpError(
            f"{flag} {shown(path)} is a folder; give a file name, e.g. {flag} {target / 'plan.png'}"
        )
    parent = target.parent
    if not parent.is_dir():
        what = "is a file, not a folder" if parent.exists() else "does not exist"
        raise EvendpError(
            f"{flag} {shown(path)}: the folder {shown(str(parent))} {what}; create it first or "
            f"give a path in an existing folder, e.g. {flag} {target.name}"
        )
    _check_writable(flag, path, parent)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (the folder ``mkdir -p`` starts from)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(flag: str, path: str, folder: Path) -> None:
    if not folder.is_dir():
        raise EvendpError(
            f"{flag} {shown(path)}: {shown(str(folder))} is a file, so the folder cannot be "
            "created there; choose another path"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".evendp-probe-", dir=folder)
    except OSError as exc:
        raise EvendpError(
            f"{flag} {shown(path)}: cannot write in {shown(str(folder))} ({exc.strerror or exc}); "
            "choose a folder you can write to"
        ) from None
    os.close(fd)
    os.unlink(probe)
