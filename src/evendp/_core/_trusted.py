"""The folder a run is written into: refused when another local user controls it.

Checked the way OpenSSH's ``StrictModes`` checks the files a daemon trusts, and the way the
kernel's ``fs.protected_symlinks`` refuses links planted in a shared folder; evendp checks
owners and mode bits itself (``lstat``), so the refusals hold for root too, whom the
operating system lets through everywhere. For a run folder ``F`` (``--out``,
``TrainConfig(out_dir=...)``, the launcher's ``run_dir``):

- every symbolic link on the way to ``F`` is owned by this user or by root (another user's
  link can point the run at any folder of this user's: another run, whose checkpoints
  ``--overwrite`` would delete);
- every existing folder above ``F`` (after the links) is owned by this user or by root, and is
  not writable by group (unless the group is the owner's private one, of one member: umask
  002 systems) or others unless it is sticky (``/tmp``: others may add names there,
  but not rename or delete this user's): whoever can rename ``F`` away can put another folder
  in its place between two runs;
- ``F`` itself, when it exists, is owned by this user and not writable by group (its private
  group aside) or others (sticky or not: anyone who can write there can plant a checkpoint).

:func:`trusted_run_folder` returns ``F``'s real path: what a run deletes it deletes there, and
says it by that name. A refusal is one line (:class:`UntrustedFolder`, exit 2) naming the path,
its owner or mode, and the fix.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path

from ._errors import InputError
from ._validate import shown

__all__ = ["UntrustedFolder", "describe_owner", "trusted_run_folder"]

_MAX_LINKS = 40  # as the kernel's ELOOP: a loop of links is refused, never followed forever


class UntrustedFolder(InputError):
    """A run folder another local user controls (exit 2): its owner, its mode, or a link."""


def describe_owner(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` when it has no name here.

    >>> describe_owner(0)
    'root (uid 0)'
    """
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _trusted_owner(info: os.stat_result) -> bool:
    """Whether ``info`` (an ``lstat``) belongs to this user or to root, as OpenSSH trusts."""
    return info.st_uid in (os.geteuid(), 0)


def trusted_run_folder(path: str | Path, flag: str = "--out") -> Path:
    """``path``'s real path, once no other local user controls it (see the module's text);
    :class:`UntrustedFolder` otherwise. ``path`` need not exist: its missing folders are
    made by the run, 0700.

    >>> d = getfixture("tmp_path")  # pytest's temporary folder
    >>> trusted_run_folder(d / "run") == d.resolve() / "run"
    True
    >>> os.chmod(d, 0o777); trusted_run_folder(d / "run")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp._core._trusted.UntrustedFolder: --out '...': the folder '...' above it is writable ...
    """
    real, missing = _resolve(str(path), flag)
    existing = real
    for _ in range(missing):
        existing = existing.parent
    for folder in reversed([existing, *existing.parents]):
        if folder == real:
            _check_itself(path, real, flag)
        else:
            _check_above(path, folder, flag)
    return real


def _resolve(path: str, flag: str) -> tuple[Path, int]:
    """``path`` resolved like ``realpath``, each link's owner checked before it is followed;
    and how many of its last parts do not exist (joined as written: nothing to follow)."""
    parts = deque(Path(path).absolute().parts[1:])
    here, hops, missing = Path("/"), 0, 0
    while parts:
        part = parts.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            here = here.parent
            missing = max(0, missing - 1)
            continue
        step = here / part
        if missing:  # below a missing folder: nothing there to be a link
            here, missing = step, missing + 1
            continue
        try:
            info = os.lstat(step)
        except FileNotFoundError:
            here, missing = step, 1
            continue
        except OSError as exc:  # not a folder on the way, no permission: the writer says it
            raise UntrustedFolder(
                f"{_set(flag, path)}: cannot look at {shown(str(step))} "
                f"({exc.strerror or type(exc).__name__}); give a {flag} in a folder of yours"
            ) from None
        if not stat.S_ISLNK(info.st_mode):
            here = step
            continue
        if not _trusted_owner(info):
            raise UntrustedFolder(
                f"{_set(flag, path)}: {shown(str(step))} is a symbolic link owned by "
                f"{describe_owner(info.st_uid)}, neither you nor root: its owner can point it "
                "at any folder, one of your other runs among them; give the real path of a "
                f"folder of yours, e.g. {_set(flag, os.path.expanduser('~/runs/' + step.name))}"
            )
        hops += 1
        if hops > _MAX_LINKS:
            raise UntrustedFolder(
                f"{_set(flag, path)}: more than {_MAX_LINKS} symbolic links on the way "
                f"(a loop at {shown(str(step))}); give the folder's real path"
            )
        target = Path(os.readlink(step))
        if target.is_absolute():
            here = Path("/")
        parts.extendleft(reversed(target.parts[1:] if target.is_absolute() else target.parts))
    return here, missing


def _open_to_others(info: os.stat_result) -> bool:
    """Whether someone other than the owner can write there: others can, or its group can and
    is not the owner's private group (the user's own group of one member, made with the
    account where the umask is 002: writable by the owner alone, as Debian's OpenSSH accepts).
    """
    if info.st_mode & 0o002:
        return True
    return bool(info.st_mode & 0o020) and not _private_group(info.st_gid, info.st_uid)


def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` has exactly one member, user ``uid`` (its primary group or its
    only listed member); an unknown group is not private.

    >>> _private_group(-1, 0)
    False
    """
    try:
        import grp
        import pwd

        group = grp.getgrgid(gid)
        account = pwd.getpwuid(uid)
        owner = account.pw_name
        primary = [p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid]
        if account.pw_gid == gid and uid not in primary:  # not enumerated (sssd, LDAP)
            primary.append(uid)
    except (ImportError, KeyError, OverflowError):
        return False
    if any(member != uid for member in primary) or any(m != owner for m in group.gr_mem):
        return False
    return bool(primary) or group.gr_mem == [owner]


def _set(flag: str, value: str) -> str:
    """``--out 'x'`` for a command's flag, ``out_dir='x'`` for a field."""
    return f"{flag} {shown(value)}" if flag.startswith("-") else f"{flag}={shown(value)}"


def _check_above(path: str | Path, folder: Path, flag: str) -> None:
    """A folder above the run folder: nobody but this user and root can rename what is in it."""
    info = os.lstat(folder)
    why = None
    if not _trusted_owner(info):
        why = f"belongs to {describe_owner(info.st_uid)}, not to you or root"
    elif _open_to_others(info) and not info.st_mode & stat.S_ISVTX:
        why = (
            f"is writable by group or others (mode {oct(info.st_mode & 0o7777)}) and not "
            "sticky (chmod +t, as /tmp)"
        )
    if why is not None:
        raise UntrustedFolder(
            f"{_set(flag, str(path))}: the folder {shown(str(folder))} above it {why}: "
            "another user could rename the run folder away and put another in its place; "
            f"give a {flag} in a folder only you (or root) can change"
        )


def _check_itself(path: str | Path, real: Path, flag: str) -> None:
    """The run folder, when it exists: this user's, closed to group and others for writing."""
    info = os.lstat(real)
    if not stat.S_ISDIR(info.st_mode):
        return  # a file: the writer's own check says so
    named = _set(flag, str(path)) + (
        "" if str(real) == str(path) else f" (the folder {shown(str(real))})"
    )
    if info.st_uid != os.geteuid():
        raise UntrustedFolder(
            f"{named} belongs to {describe_owner(info.st_uid)}, not to you, "
            f"{describe_owner(os.geteuid())}: its owner could replace the run's checkpoints "
            f"between runs; give a new {flag} (evendp creates it 0700, yours alone)"
        )
    if _open_to_others(info):
        # A sticky folder (/tmp) is shared on purpose: the fix is a folder of one's own in it.
        fix = (
            f"give a new {flag} inside it, e.g. {str(Path(real) / 'run')!r} (evendp creates it "
            "0700, yours alone)"
            if info.st_mode & stat.S_ISVTX
            else f"run `chmod go-w {real!s}` (or 700), or give a new {flag}"
        )
        raise UntrustedFolder(
            f"{named} is writable by group or others (mode "
            f"{oct(info.st_mode & 0o7777)}): anyone who can write there could plant or replace "
            f"the run's checkpoints; {fix}"
        )
