"""Output targets checked before any work: a run must not train for minutes and then find that
it cannot write its folder or its picture.

A target is writable when a file can really be created where it goes (a probe file, removed
at once): permission bits alone miss read-only file systems and say nothing for root.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .._core._errors import EvendpError
from .._core._trusted import trusted_run_folder
from .._core._validate import shown, validate_path

__all__ = ["check_out_dir", "check_out_file"]


def check_out_dir(flag: str, path: str) -> None:
    """``path`` is a folder, or can be made one, no other local user controls it
    (:func:`~evendp._core._trusted.trusted_run_folder`), and files can be written in it.

    >>> check_out_dir("--out", tempfile.mkdtemp())
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
            "give a "
            f"path in an existing folder, e.g. {flag} {target.name}"
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
            "created "
            "there; choose another path"
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
