"""Checkpoints that survive crashes: atomic writes, the previous good one kept, strict loads.

A save goes through a temporary file and a rename (:func:`~evendp._core._files.replace_file`),
the current checkpoint first moved to ``<name>.prev<suffix>``: a complete checkpoint exists at
every instant. A load checks everything (format, fields, keys, shapes, and ``sha256``, the
digest of the contents that catches garbled tensor data ``torch.load`` reads without complaint)
before it touches the model or optimizer: a bad file is a :class:`CheckpointError` and changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .._core._digest import content_digest, first_non_finite
from .._core._errors import CheckpointError, EvendpError, TrainingError
from .._core._files import NotReadable, fsync_dir, mkdir_private, open_regular, replace_file
from .._core._validate import (
    is_int,
    shown,
    validate_bool,
    validate_instance,
    validate_int,
    validate_path,
)
from ._safe_read import Refused, check_archive, check_kind, read_dcp_metadata, safe_dcp

__all__ = [
    "CorruptCheckpoint",
    "disk_error",
    "FIELDS",
    "first_good",
    "fix_for",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "make_private_dir",
    "previous_path",
    "rank_rng_path",
    "read_rank_file",
    "read_state_file",
    "read_whole",
    "resumable_checkpoint",
    "RngState",
    "save_checkpoint",
    "save_rank_file",
    "save_sharded_checkpoint",
    "STATE_FIELDS",
    "write_whole",
]

T = TypeVar("T")

_FORMAT = "evendp-checkpoint"
_VERSION = 1
#: The most a file of generator states or a run's position can be (bytes on disk): a few KiB
#: of generators and the loss history, a float per step.
_SMALL_FILE = 256 << 20
#: A whole file past the bytes its tensors unpack to: the zip's headers and alignment.
_ARCHIVE_SLACK = 16 << 20


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that cannot be read back whole (truncated, garbled, foreign): a resume
    falls back to the previous good one. A mismatch with the run is a plain
    :class:`CheckpointError`: the previous one would not fit either."""


def _other_copy(path: Path) -> Path:
    """The checkpoint ``path`` is the previous copy of, else ``path``'s previous copy."""
    if path.stem.endswith(".prev"):
        return path.with_name(path.stem.removesuffix(".prev") + path.suffix)
    return previous_path(path)


def fix_for(path: Path) -> str:
    """What to do about an unusable checkpoint file: never point at ``ckpt.prev.prev.pt``."""
    if path.stem.endswith(".prev"):
        return (
            f"it was the last fallback; delete {str(path)!r} and resume from "
            f"{str(_other_copy(path))!r}, or start fresh with another --out"
        )
    return (
        f"resume from the previous good checkpoint {str(previous_path(path))!r} if it exists, "
        "or delete the file to start fresh"
    )


def _refused(what: str, path: Path, why: Any) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{what} {str(path)!r} is refused: {why}; {fix_for(path)}")


def previous_path(path: str | Path) -> Path:
    """Where the previous good checkpoint of ``path`` (a file or a DCP folder) is kept.

    >>> previous_path("runs/demo/ckpt.pt").name, previous_path("runs/demo/ckpt.dcp").name
    ('ckpt.prev.pt', 'ckpt.prev.dcp')
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.prev{p.suffix}")


def resumable_checkpoint(path: str | Path) -> tuple[Path, int, dict[str, Any]] | None:
    """The checkpoint a resume will use, its step and its ``extra`` (the run's configuration
    among it): ``path`` when its position reads back, else its previous copy (``None``:
    neither exists; a DeepSpeed folder ``ckpt.ds`` keeps both inside, ``state.pt`` and
    ``state.prev.pt``). The error of the last one when none reads. No tensor data is read:
    the resume itself checks it, and falls back.

    >>> resumable_checkpoint("/nonexistent/ckpt.pt") is None
    True
    """
    p = Path(path) / _STATE_FILE if Path(path).suffix == ".ds" else Path(path)
    candidates = [c for c in (p, previous_path(p)) if os.path.lexists(c)]
    if not candidates:
        return None

    def position(candidate: Path) -> dict[str, Any]:
        if candidate.is_dir():
            return read_state_file(candidate)
        return _read(candidate, position_only=True)

    found, payload, _ = first_good(candidates, position)
    return found, int(payload["step"]), dict(payload.get("extra") or {})


def first_good(candidates: list[Path], read: Callable[[Path], T]) -> tuple[Path, T, list[str]]:
    """The first of ``candidates`` (latest first) that ``read`` takes, what it returned, and
    why each one before it was skipped (the first clause of its :class:`CorruptCheckpoint`).
    When none reads: the last one's error alone, or one line naming each."""
    skipped: list[str] = []
    for candidate in candidates:
        try:
            return candidate, read(candidate), skipped
        except CorruptCheckpoint as exc:
            last = str(exc).split(";")[0]
            if candidate != candidates[-1]:
                skipped.append(last)
                continue
            earlier = [x for x in skipped if not last.startswith(x)]  # each fault once
            if not earlier:  # one fault: its own line, with its own fix
                raise
            raise CorruptCheckpoint(
                f"{' and '.join([*earlier, last])}; neither can be resumed: start fresh with "
                "another --out, or --overwrite to delete them"
            ) from None
    raise CorruptCheckpoint("no checkpoint to resume from")  # no candidates: callers check


def _set_cuda_rng_states(saved: list[torch.Tensor]) -> None:
    """One CUDA generator per device saved and visible (``set_rng_state_all`` fails on fewer
    GPUs than saved; on more, the extra devices keep their seeded generators)."""
    visible = torch.cuda.device_count()
    restored = min(len(saved), visible)
    for index in range(restored):
        torch.cuda.set_rng_state(saved[index], index)
    if len(saved) != visible:
        warnings.warn(
            f"the checkpoint holds CUDA generator states for {len(saved)} device(s), "
            f"{visible} are visible here: restored the first {restored}"
            + (", the others keep their seeded state" if visible > restored else ""),
            stacklevel=3,
        )


class RngState:
    """This process's random generators (torch, CUDA when used, ``random``, numpy when imported)
    as a checkpoint part. ``reseed``: what a rank with no saved generators of its own seeds
    torch and ``random`` with (with a warning).

    >>> rng = RngState(reseed=7)
    >>> saved = rng.state_dict(); a = torch.rand(1)
    >>> rng.load_state_dict(saved); torch.equal(a, torch.rand(1))
    True
    """

    #: What a message calls this part.
    what = "RNG state"

    def __init__(self, reseed: int | None = None) -> None:
        self.reseed = reseed

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        np = sys.modules.get("numpy")  # only when the program uses numpy; never import it here
        if np is not None:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            # Plain lists so the file loads with weights_only=True (no numpy arrays pickled).
            state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        kind, internal, gauss = state_dict["python"]
        random.setstate((kind, tuple(internal), gauss))
        if "cuda" in state_dict and torch.cuda.is_available():
            _set_cuda_rng_states(list(state_dict["cuda"]))
        np = sys.modules.get("numpy")
        if "numpy" in state_dict and np is not None:
            kind, keys, pos, has_gauss, gauss = state_dict["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))

    def without_saved(self, why: str, rank: int) -> None:
        """No generators saved for this rank (``why``): warn, and reseed with ``reseed``."""
        seed = self.reseed
        what = "kept the state seeded at start" if seed is None else f"reseeded with {seed}"
        warnings.warn(
            f"rank {rank}: {why}; {what}: dropout and other random draws on this rank will "
            "differ from an uninterrupted run's",
            stacklevel=3,
        )
        if seed is not None:
            torch.manual_seed(seed)
            random.seed(seed)


def _present_parts(path: Any, parts: Mapping[str, Any]) -> dict[str, Any]:
    """``save_checkpoint``'s / ``load_checkpoint``'s path and parts checked before any file is
    touched; the parts given."""
    validate_path("path", path)
    validate_instance("model", parts["model"], nn.Module, "an nn.Module")
    for name in ("optimizer", "scaler", "scheduler"):
        value = parts[name]
        if value is not None and not callable(getattr(value, "state_dict", None)):
            raise EvendpError(
                f"{name} must have state_dict() and load_state_dict() (or be None), got {value!r}"
            )
    return {name: part for name, part in parts.items() if part is not None}


def save_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the parts' states, this process's generators, ``step`` and ``extra`` (plain data)
    atomically to ``path``, the file there becoming :func:`previous_path`. Nothing is written
    (:class:`TrainingError`) when the model or optimizer state holds NaN or inf, or when the
    disk refuses the write.

    >>> d = getfixture("tmp_path")
    >>> model = torch.nn.Linear(2, 1)
    >>> save_checkpoint(f"{d}/ckpt.pt", model=model, step=3).name
    'ckpt.pt'
    >>> load_checkpoint(f"{d}/ckpt.pt", model=model)["step"]
    3
    """
    parts = {"model": model, "optimizer": optimizer, "scaler": scaler, "scheduler": scheduler}
    present = _present_parts(path, parts)
    validate_int("step", step, minimum=0, example="step=100")
    validate_instance("extra", extra, Mapping, "a dict of extra entries", allow_none=True)
    return write_whole(path, present, step=step, extra=extra or {}, keep_previous=True)


#: ``ckpt.pt``'s own fields, each the state of the part of that name (``rng``: the writer's
#: generators); any other state is plain data in its ``extra``.
FIELDS = ("model", "optimizer", "scaler", "scheduler", "rng")


def write_whole(
    path: str | Path,
    parts: Mapping[str, Any],
    *,
    step: int,
    extra: Mapping[str, Any],
    keep_previous: bool,
) -> Path:
    """:func:`save_checkpoint` of the parts named by :data:`FIELDS` (others are not looked
    at): an absent model is saved as an empty one, absent generators as this process's."""
    target = Path(path)
    make_private_dir(target.parent)
    states = {name: parts[name].state_dict() if name in parts else None for name in FIELDS}
    states["model"] = states["model"] or {}
    states["rng"] = states["rng"] or RngState().state_dict()
    _refuse_non_finite(target, step, states["model"], states["optimizer"])
    payload = _signed(step, states, extra)
    return _atomic_save(payload, target, previous=previous_path(target) if keep_previous else None)


def _signed(
    step: int, states: Mapping[str, Any], extra: Mapping[str, Any], **more: Any
) -> dict[str, Any]:
    """A checkpoint's or a DCP ``state.pt``'s contents, with the digest that proves them whole."""
    payload = {"format": _FORMAT, "version": _VERSION, "step": int(step), **more, **states}
    payload["extra"] = dict(extra)
    payload["sha256"] = content_digest(payload)
    return payload


def _refuse_non_finite(target: Path, step: int, model_state: Any, optimizer_state: Any) -> None:
    bad = first_non_finite(model_state, "model")
    if bad is None and isinstance(optimizer_state, Mapping):
        bad = first_non_finite(optimizer_state.get("state", optimizer_state), "optimizer")
    if bad is not None:
        raise TrainingError(
            f"not writing the checkpoint {str(target)!r} at step {step}: {bad} holds NaN or "
            f"inf; the checkpoints already there are kept ({_kept(target)}); lower the "
            "learning rate or check the data, then resume from them"
        )


def _kept(target: Path) -> str:
    here = [p.name for p in (target, previous_path(target)) if p.exists()]
    return ", ".join(here) if here else "none yet"


def make_private_dir(folder: Path) -> None:
    """:func:`~evendp._core._files.mkdir_private`, a refusal worded as a disk error."""
    try:
        mkdir_private(folder)
    except OSError as exc:
        raise disk_error(folder, exc, "create the folder") from None


def _private(folder: Path) -> None:
    """Every file DCP wrote in ``folder`` 0600 and the folder 0700 (DCP opens its files with the
    umask's mode, 0644 under the usual 022)."""
    os.chmod(folder, 0o700)
    for entry in folder.iterdir():
        if entry.is_file() and not entry.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # another rank's temporary, renamed
                os.chmod(entry, 0o600)


def disk_error(
    where: Path, exc: OSError, doing: str, checkpoint: Path | None = None
) -> TrainingError:
    """One line for a write the operating system refused: which file, why, what to do.
    ``checkpoint``: the checkpoint file whose copies are intact, when not ``where``."""
    why, kept = exc.strerror or type(exc).__name__, checkpoint or where
    return TrainingError(
        f"could not {doing} {str(where)!r}: {why} (errno {exc.errno}); the checkpoints already "
        f"there are intact ({_kept(kept) if kept.suffix else 'none touched'}); free space or "
        "fix the permissions, then resume with --resume, or pass another --out"
    )


def _atomic_save(payload: Mapping[str, Any], target: Path, previous: Path | None) -> Path:
    """``payload`` written durably at ``target``, the file there first moved to ``previous``
    (unless ``None``); a write the OS refuses is one line (:func:`disk_error`)."""
    try:
        replace_file(
            target, lambda f: torch.save(dict(payload), f), previous=previous, durable=True
        )
    except OSError as exc:
        raise disk_error(target, exc, "write") from None
    except RuntimeError as exc:  # torch.save wraps the file's OSError in a RuntimeError
        if isinstance(exc.__context__, OSError):
            raise disk_error(target, exc.__context__, "write") from None
        raise
    return target


def rank_rng_path(path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its own per-rank states beside checkpoint ``path``.

    >>> rank_rng_path("runs/demo/ckpt.pt", 2).name
    'ckpt.rng2.pt'
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.rng{rank}{p.suffix}")


def save_rank_file(
    target: Path, step: int, states: Mapping[str, Any], previous: Path | None
) -> Path:
    """One rank's per-rank parts for ``step`` by name (``rng`` among them), written as
    :func:`_atomic_save` does, with no collective (a fault on one rank cannot hang the others)."""
    make_private_dir(target.parent)
    payload: dict[str, Any] = {"format": f"{_FORMAT}-rng", "step": int(step), **states}
    payload["sha256"] = content_digest(payload)
    return _atomic_save(payload, target, previous=previous)


def read_rank_file(
    path: str | Path, rank: int, step: int, *, rng: bool
) -> tuple[dict[str, Any] | None, str]:
    """Rank ``rank``'s file of checkpoint ``path`` at ``step``, or ``None`` and why not.

    The rank's file of the other checkpoint (``ckpt.prev.rng{rank}.pt`` beside ``ckpt.pt``,
    and the reverse) is taken when it holds ``step``: after a crash between two ranks'
    writes it is the exact state. A garbled file is an error, never skipped silently.
    ``rng``: the file must hold generators (a rank's file of a run with an ``rng`` part).
    """
    source = rank_rng_path(path, rank)
    found: int | None = None
    unreadable: CheckpointError | None = None
    for candidate in (source, rank_rng_path(_other_copy(Path(path)), rank)):
        if not candidate.exists():
            continue
        try:
            payload = _read_rank(candidate, rng=rng)
        except CheckpointError as exc:
            unreadable = unreadable or exc
            continue
        if int(payload["step"]) == int(step):
            return payload, ""
        if candidate == source:
            found = int(payload["step"])
    if unreadable is not None:  # never reseed over a garbled file silently
        raise unreadable
    why = "is missing" if found is None else f"holds step {found}"
    return None, f"file {str(source)!r} for the checkpoint at step {step} {why}"


def _read(path: Path, limit: int | None = None, *, position_only: bool = False) -> dict[str, Any]:
    """A whole checkpoint file, its tensors at most ``limit`` bytes; ``position_only``: its
    step, ``extra`` and generator states without reading a tensor's data (tensors come back
    on the meta device, the digest unchecked: the full load checks it)."""
    fix = fix_for(path)
    if not os.path.lexists(path):  # a FIFO, a folder, a link: refused by what it is, below
        raise CorruptCheckpoint(f"no checkpoint at {str(path)!r}; check the path or drop --resume")
    cap = None if limit is None else limit + _ARCHIVE_SLACK
    payload = _load_tagged(
        path, "checkpoint", _FORMAT, fix, limit, cap, meta=position_only, rng=True
    )
    if not isinstance(payload.get("model"), dict):
        raise CorruptCheckpoint(
            f"{str(path)!r} is not an evendp checkpoint (no model state); {fix}"
        )
    if payload.get("version") != _VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {payload.get('version')!r}, this "
            f"evendp reads version {_VERSION}; use the evendp that wrote it or start fresh"
        )
    return payload


def _read_rank(path: Path, *, rng: bool) -> dict[str, Any]:
    """A rank's file (its per-rank parts), whole; ``rng``: its generators among them."""
    fix = (
        "delete it to resume with the checkpoint writer's generator states on this rank "
        "(random draws there then differ from an uninterrupted run's)"
    )
    return _load_tagged(path, "rank RNG file", f"{_FORMAT}-rng", fix, cap=_SMALL_FILE, rng=rng)


def read_state_file(folder: Path) -> dict[str, Any]:
    what = "sharded checkpoint state file"
    return _load_tagged(folder / _STATE_FILE, what, _FORMAT, fix_for(folder), cap=_SMALL_FILE)


def _load_tagged(
    path: Path,
    what: str,
    marker: str,
    fix: str,
    limit: int | None = None,
    cap: int | None = None,
    *,
    meta: bool = False,
    rng: bool = False,
) -> dict[str, Any]:
    """Every evendp file's ``torch.load`` (weights only): a regular file of at most ``cap``
    bytes whose tensors unpack to at most ``limit``, a dict whose ``format`` is ``marker``, its
    fields sane (``rng``: generators among them), its digest checked (``meta``: no tensor data
    read, no digest). Unreadable for the OS: a :class:`CheckpointError` (the previous file
    would be refused alike); anything else wrong: a :class:`CorruptCheckpoint` (a resume falls
    back). Both messages end with ``fix``."""
    try:
        with open_regular(path, cap, mine=True) as source:
            check_archive(source, limit)  # before torch.load: no zip bomb, no legacy format
            location = "meta" if meta else "cpu"
            payload = torch.load(source, map_location=location, weights_only=True)
    except NotReadable as exc:
        raise CorruptCheckpoint(f"{what} {str(path)!r} is refused: {exc}; {fix}") from None
    except Refused as exc:
        if "not a torch.save zip" in str(exc):
            raise CorruptCheckpoint(
                f"{what} {str(path)!r} is unreadable (not a torch.save zip archive); it may be "
                f"truncated or not an evendp {what}; {fix}"
            ) from None
        raise CorruptCheckpoint(f"{what} {str(path)!r} is refused: {exc}; {fix}") from None
    except PermissionError as exc:  # unreadable for the OS, not corrupt
        raise CheckpointError(
            f"cannot read the {what} {str(path)!r}: {exc.strerror or exc} (errno "
            f"{exc.errno}); fix its permissions, or pass another --out"
        ) from None
    except Exception as exc:  # torch raises several types for a missing, truncated or foreign file
        raise CorruptCheckpoint(
            f"{what} {str(path)!r} is unreadable ({type(exc).__name__}: "
            f"{_first_sentence(str(exc))}); it may be truncated or not an evendp {what}; {fix}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != marker:
        raise CorruptCheckpoint(
            f"{str(path)!r} is not an evendp {what} (no {marker!r} marker); {fix}"
        )
    try:
        _check_fields(payload)
        if rng and "rng" not in payload:  # every file that restores generators wrote them
            raise Refused("rng: missing")
    except Refused as exc:
        raise CorruptCheckpoint(f"{what} {str(path)!r} is refused: field {exc}; {fix}") from None
    saved = payload.get("sha256")
    if not meta and saved is None:  # an older evendp's file: accepted, and said once
        UNVERIFIED.add(str(path))
    elif not meta and content_digest(payload) != saved:
        raise CorruptCheckpoint(
            f"{what} {str(path)!r} is corrupt: its contents do not match the sha256 "
            f"saved with them (garbled tensor data); {fix}"
        )
    return payload


_MAX_COUNT = 10**12  # steps, epochs, batches: past this a count is not a run's


def _count(field: str, value: Any, minimum: int = 0) -> None:
    if not (is_int(value) and minimum <= value <= _MAX_COUNT):
        raise Refused(f"{field}: must be an int in [{minimum}, {_MAX_COUNT}], got {shown(value)}")


def _int_list(field: str, value: Any, minimum: int, none: bool = False) -> None:
    if not isinstance(value, list) or len(value) > 1_000_000:
        raise Refused(f"{field}: must be a list of ints, got {shown(value)}")
    for i, item in enumerate(value):
        if not (none and item is None):
            _count(f"{field}.{i}", item, minimum)


def _check_fields(payload: Mapping[str, Any]) -> None:
    """The fields every evendp file shares, checked for kind and range before anything uses
    them (a digest proves a file whole, not sane: whoever wrote it recomputed it)."""
    _count("step", payload.get("step"))
    if "world_size" in payload:
        _count("world_size", payload["world_size"], 1)
    extra = payload.get("extra", {})
    if not isinstance(extra, dict):
        raise Refused(f"extra: must be a dict, got {shown(extra)}")
    for key in ("epoch", "batch_in_epoch", "resplits", "skipped"):
        if key in extra:
            _count(f"extra.{key}", extra[key])
    if extra.get("global_batch") is not None:
        _count("extra.global_batch", extra["global_batch"], 1)
    if "samples" in extra:
        _int_list("extra.samples", extra["samples"], 0)
    if "micro_batch_sizes" in extra:
        _int_list("extra.micro_batch_sizes", extra["micro_batch_sizes"], 1, none=True)
    losses = extra.get("losses", [])
    if not isinstance(losses, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in losses
    ):
        raise Refused(f"extra.losses: must be a list of numbers, got {shown(losses)}")
    if "rng" in payload:
        _check_rng(payload["rng"])


def _check_rng(rng: Any) -> None:
    """The generator states, of the kinds :class:`RngState` hands to torch and ``random``."""
    if not isinstance(rng, dict):
        raise Refused(f"rng: must be a dict, got {shown(rng)}")
    ours = torch.get_rng_state()
    state = rng.get("torch")
    kind = (state.dtype, state.shape) if isinstance(state, torch.Tensor) else None
    if kind != (ours.dtype, ours.shape):
        raise Refused(f"rng.torch: must be a uint8 tensor of shape {tuple(ours.shape)}")
    python = rng.get("python")  # random's state as saved: lists after a round trip
    if isinstance(python, list | tuple) and len(python) == 3 and isinstance(python[1], list):
        python = (python[0], tuple(python[1]), python[2])
    check_kind("rng.python", random.getstate(), python)
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list) or not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
    ):
        raise Refused("rng.cuda: must be a list of uint8 tensors")
    if "numpy" in rng:
        numpy = rng["numpy"]
        ok = isinstance(numpy, list) and len(numpy) == 5 and isinstance(numpy[1], list)
        if not ok or len(numpy[1]) != 624:
            raise Refused("rng.numpy: must be numpy's [kind, 624 keys, pos, has_gauss, gauss]")


#: Checkpoints read without a digest to verify (written before evendp kept one), by path.
UNVERIFIED: set[str] = set()


def _first_sentence(text: str) -> str:
    """The first sentence of an error message, whole (never cut mid-sentence), no ANSI codes.

    >>> _first_sentence("Weights only load failed. In PyTorch 2.6, we changed (a)...")
    'Weights only load failed.'
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
    if not text:
        return "no detail"
    first = text.splitlines()[0]
    end = first.find(". ")
    return first if end < 0 else first[: end + 1]


def _refuse_mismatch(
    what: str, path: Path, own: Mapping[str, Any], saved: Mapping[str, Any]
) -> None:
    """A checkpoint whose model does not fit this one, refused: ``own`` and ``saved`` map each
    state's name to its shape (``None``: not a tensor)."""
    wrong = [
        f"{k}: checkpoint {saved[k]} vs model {shape}"
        for k, shape in own.items()
        if k in saved and None not in (shape, saved[k]) and saved[k] != shape
    ]
    details = (
        f"missing keys {sorted(own.keys() - saved.keys())[:5]}",
        f"unexpected keys {sorted(saved.keys() - own.keys())[:5]}",
        f"shape mismatches {wrong[:5]}",
    )
    shown_details = "; ".join(d for d in details if not d.endswith(" []"))
    if shown_details:
        raise CheckpointError(
            f"{what} {str(path)!r} does not match the model ({shown_details}); resume with "
            "the same model configuration that wrote it, or use a new output directory"
        )


def _shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _validate_optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, state: Mapping[str, Any] | None
) -> None:
    """The saved optimizer state against ``optimizer``: its groups of the sizes and kinds ours
    are (``lr`` a finite number, ``betas`` two), each parameter's state tensors of its
    parameter's shape (or scalars, like Adam's step); :class:`Refused` names a bad field."""
    if state is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no optimizer state but an optimizer was given; "
            "load it without optimizer= or resume from a full training checkpoint"
        )
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        why = "field optimizer.param_groups is not a list of parameter groups"
        raise _refused("checkpoint", path, why)
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in groups]
    if ours != theirs:
        raise CheckpointError(
            f"checkpoint {str(path)!r} optimizer has parameter groups of sizes {theirs}, "
            f"the optimizer here has {ours}; build the optimizer the same way as the run "
            "that wrote it"
        )
    shapes: dict[Any, torch.Size] = {}
    for i, (mine, saved) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        settings = {k: v for k, v in mine.items() if k != "params"}
        check_kind(f"optimizer.param_groups.{i}", settings, saved)
        for key, param in zip(saved["params"], mine["params"], strict=True):
            shapes[key] = param.shape
    state = state.get("state")
    if not isinstance(state, dict):
        raise Refused(f"optimizer.state: must be a dict, got {shown(state)}")
    for key, entries in state.items():
        if key not in shapes or not isinstance(entries, dict):
            raise Refused(f"optimizer.state.{shown(key)}: not a parameter of the optimizer")
        for name, value in entries.items():
            where = f"optimizer.state.{key}.{name}"
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 and value.shape != shapes[key]:
                    raise Refused(
                        f"{where}: must have the parameter's shape {tuple(shapes[key])}, got "
                        f"{tuple(value.shape)}"
                    )
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise Refused(f"{where}: holds NaN or inf")
            elif not isinstance(value, int | float | bool | None):
                raise Refused(f"{where}: must be a tensor or a number, got {shown(value)}")


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Validate, then restore a checkpoint written by :func:`save_checkpoint`.

    Returns ``{"step": int, "extra": dict}``. Everything is checked before anything is
    loaded: a corrupt file or one whose keys or shapes do not match raises
    :class:`CheckpointError` naming the file and the fix, and leaves the model, the optimizer and
    the file untouched. (See :func:`save_checkpoint` for an example.)
    """
    parts = {"model": model, "optimizer": optimizer, "scaler": scaler, "scheduler": scheduler}
    present = _present_parts(path, parts)
    if validate_bool("restore_rng", restore_rng):
        present["rng"] = RngState()
    return read_whole(path, present)


def read_whole(
    path: str | Path,
    parts: Mapping[str, Any],
    *,
    verify: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """:func:`load_checkpoint` into the parts named by :data:`FIELDS` (others are not looked
    at): every one is checked against its saved state before any loads (the generators were
    checked as the file was read)."""
    p, model = Path(path), parts.get("model")
    # Its tensors unpack to at most: the model's state, an optimizer's few copies of it (AdamW
    # keeps two), generator states and the loss history, with room.
    states = {} if model is None else model.state_dict()
    limit = 8 * sum(t.numel() * t.element_size() for t in states.values()) + (64 << 20)
    payload = _read(p, limit=limit)
    if verify is not None:
        verify(p, dict(payload.get("extra") or {}))
    fields = {name: parts[name] for name in FIELDS if name in parts}
    for name, part in fields.items():
        saved = payload.get(name)
        try:
            if name == "model":
                _refuse_mismatch(
                    "checkpoint", p, _shapes(part.state_dict()), _shapes(payload["model"])
                )
            elif name == "optimizer":
                _validate_optimizer_state(p, part, saved)
            elif saved is not None and name != "rng":  # a scaler's or scheduler's, of our kind
                check_kind(name, part.state_dict(), saved)
        except Refused as exc:
            raise _refused("checkpoint", p, f"field {exc}") from None
    for name, part in fields.items():
        if payload.get(name) is None:  # a scaler or scheduler the writer had none of
            continue
        if name == "optimizer":
            load_optimizer_state(part, payload[name])
        else:
            part.load_state_dict(payload[name])
    return {"step": int(payload["step"]), "extra": dict(payload.get("extra") or {})}


#: How an optimizer runs, not what it learned: this run's, whatever the checkpoint's writer
#: used (a fused AdamW resumed from ZeroRedundancyOptimizer's unfused one stays fused).
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: Any, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping this run's implementation flags in each
    parameter group (``load_state_dict`` takes the saved groups whole).

    >>> net = torch.nn.Linear(1, 1)
    >>> saved = torch.optim.AdamW(net.parameters(), foreach=False).state_dict()
    >>> mine = torch.optim.AdamW(net.parameters(), foreach=True)
    >>> load_optimizer_state(mine, saved); mine.param_groups[0]["foreach"]
    True
    """
    kept = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, kept, strict=True):
        group.update(flags)


# -- sharded (FSDP2) checkpoints through torch.distributed.checkpoint ----------------------------

_STATE_FILE = "state.pt"  # inside a DCP folder: step, extra, scaler/scheduler (rank 0's)


#: The parts a sharded checkpoint keeps in ``state.pt`` (``model`` and ``optimizer`` are
#: DCP's shards).
STATE_FIELDS = ("scaler", "scheduler")


def save_sharded_checkpoint(
    path: str | Path,
    parts: Mapping[str, Any],
    own: Mapping[str, Any],
    *,
    step: int,
    extra: Mapping[str, Any],
    keep_previous: bool,
) -> Path:
    """An FSDP2 model and optimizer saved sharded by ``torch.distributed.checkpoint`` (no rank
    gathers the full model), each rank's ``own`` states (``rng{rank}.pt``) and rank 0's
    ``state.pt``, into a temporary folder that rank 0 renames into place once all have written,
    the current one becoming :func:`previous_path`. A collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .._distributed._rank_errors import agreed

    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(parts["model"], parts["optimizer"])
    # Every rank checks its own shards; the ranks agree before anything is written.
    agreed(lambda: _refuse_non_finite(target, step, model_state, optim_state), True)

    def write() -> None:
        if rank == 0:  # a leftover of a save that crashed: never part of a checkpoint
            make_private_dir(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            make_private_dir(tmp)

    agreed(write, distributed=True)

    def shards() -> None:
        try:
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as exc:  # an OSError, or DCP's wrap of them
            errors = _dcp_errors(exc)
            cause = next((e for e in errors if isinstance(e, OSError)), None)
            if cause is None:
                cause = OSError(0, _first_sentence(str(errors[0])))
            raise disk_error(target, cause, "write") from None
        _private(tmp)  # this rank's shards (and, on rank 0, .metadata) before the rename
        save_rank_file(tmp / f"rng{rank}.pt", step, own, previous=None)
        if rank == 0:
            states = {n: parts[n].state_dict() if n in parts else None for n in STATE_FIELDS}
            state = _signed(step, states, extra, world_size=dist.get_world_size())
            _atomic_save(state, tmp / _STATE_FILE, previous=None)

    try:
        agreed(shards, distributed=True)  # every rank's shards and RNG are on disk
    except EvendpError:
        if rank == 0:  # a failed save leaves no temporary folder behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def rotate() -> None:
        if rank == 0:
            try:
                previous = previous_path(target)
                if target.exists() and not keep_previous:  # corrupt: never over the good one
                    shutil.rmtree(target)
                if target.exists():
                    shutil.rmtree(previous, ignore_errors=True)
                    os.replace(target, previous)
                os.replace(tmp, target)
                fsync_dir(target.parent)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise disk_error(target, exc, "rename into") from None

    agreed(rotate, distributed=True)  # nobody reads or writes the next one before the rename
    return target


def load_sharded_checkpoint(
    path: str | Path,
    parts: Mapping[str, Any],
    *,
    rng: bool,
    verify: Callable[[Path, dict[str, Any]], None],
) -> dict[str, Any]:
    """:func:`save_sharded_checkpoint`'s folder restored into ``parts`` on any world size (DCP
    reshards), after ``verify(path, extra)``. A collective. Returns ``{"step", "extra",
    "world_size", "own"}``: ``own``, this rank's states by name (``rng``: generators among
    them), is ``None`` when the run was saved by fewer ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .._distributed._rank_errors import agreed

    folder = Path(path)
    meta = agreed(lambda: read_state_file(folder), distributed=True)
    agreed(lambda: verify(folder, dict(meta.get("extra") or {})), distributed=True)
    model, optimizer = parts["model"], parts["optimizer"]
    model_state, optim_state = get_state_dict(model, optimizer)
    agreed(lambda: _check_shard_shapes(folder, model_state), distributed=True)
    reader, planner = safe_dcp()

    def shards() -> None:
        try:  # DCP loads in place into these (sharded) tensors, resharding to this world size
            dcp.load(
                {"model": model_state, "optimizer": optim_state},
                storage_reader=reader(str(folder)),
                planner=planner(),
            )
        except (Exception, CheckpointException) as exc:  # a missing or truncated shard
            errors = _dcp_errors(exc)
            refused = next((e for e in errors if isinstance(e, Refused)), None)
            if refused is not None:
                raise _refused("sharded checkpoint", folder, refused) from None
            root = errors[-1]  # the innermost cause: what DCP's summary wraps
            raise CorruptCheckpoint(
                f"sharded checkpoint {str(folder)!r} is incomplete or corrupt "
                f"({type(root).__name__}: {_first_sentence(str(root))}); {fix_for(folder)}"
            ) from None

    agreed(shards, distributed=True)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    for name in STATE_FIELDS:
        if name in parts and meta.get(name) is not None:
            parts[name].load_state_dict(meta[name])
    own = folder / f"rng{dist.get_rank()}.pt"
    mine = agreed(lambda: _read_rank(own, rng=rng) if own.exists() else None, distributed=True)
    return {
        "step": int(meta["step"]),
        "extra": dict(meta.get("extra") or {}),
        "world_size": int(meta.get("world_size", 0)),
        "own": mine,
    }


def _dcp_errors(exc: BaseException) -> list[BaseException]:
    """Each rank's error inside DCP's ``CheckpointException`` (else ``exc``), each followed by
    its causes: the first ``OSError`` or :class:`Refused` among them says what went wrong."""
    failures = getattr(exc, "failures", {}).values()
    todo: list[Any] = [p[0] if isinstance(p, tuple) else p for p in failures] or [exc]
    found: list[BaseException] = []
    while todo:
        inner = todo.pop(0)
        if inner is not None and all(inner is not e for e in found):
            found.append(inner)
            todo[:0] = [inner.__cause__, inner.__context__]
    return found


def _check_shard_shapes(folder: Path, model_state: Mapping[str, Any]) -> None:
    """The saved tensors' global shapes against the model's: a changed model is bad input."""
    try:  # DCP's own reader unpickles whatever .metadata holds: this one admits only DCP's
        saved = read_dcp_metadata(folder / ".metadata").state_dict_metadata
    except Refused as exc:
        raise _refused("sharded checkpoint", folder, exc) from None
    except OSError as exc:  # no .metadata
        raise CorruptCheckpoint(
            f"sharded checkpoint {str(folder)!r} has no readable .metadata "
            f"({type(exc).__name__}); {fix_for(folder)}"
        ) from None
    metas = {n: saved[f"model.{n}"] for n in model_state if f"model.{n}" in saved}
    theirs = {n: tuple(m.size) if hasattr(m, "size") else None for n, m in metas.items()}
    _refuse_mismatch("sharded checkpoint", folder, _shapes(model_state), theirs)
