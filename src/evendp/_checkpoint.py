"""Checkpoints that survive crashes: atomic writes, the previous good one kept, strict loads.

A save writes a temporary file in the target's folder, fsyncs it, moves the current checkpoint
to ``<name>.prev<suffix>`` and renames the temporary file into place (``os.replace`` is atomic
on POSIX and Windows), so at every instant a complete checkpoint exists on disk. A load reads
and checks everything (format, keys, shapes) before it touches the model or optimizer, so a
corrupt or mismatched file is a clear :class:`EvendpError` and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._errors import EvendpError

__all__ = [
    "latest_checkpoint",
    "load_checkpoint",
    "load_rank_rng",
    "previous_path",
    "rank_rng_path",
    "save_checkpoint",
    "save_rank_rng",
]

_FORMAT = "evendp-checkpoint"
_VERSION = 1


def previous_path(path: str | Path) -> Path:
    """Where the previous good checkpoint of ``path`` is kept.

    >>> previous_path("runs/demo/ckpt.pt").name
    'ckpt.prev.pt'
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.prev{p.suffix}")


def latest_checkpoint(path: str | Path) -> Path | None:
    """``path`` if it exists, else its previous copy if that exists (a crash mid-save), else None.

    >>> latest_checkpoint("/nonexistent/ckpt.pt") is None
    True
    """
    p = Path(path)
    if p.is_file():
        return p
    prev = previous_path(p)
    return prev if prev.is_file() else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")  # only when the program uses numpy; never import it here
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain lists so the file loads with weights_only=True (no numpy arrays pickled).
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, internal, gauss = state["python"]
    random.setstate((kind, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


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
    """Write a checkpoint atomically; the one it replaces becomes :func:`previous_path`.

    Saves the model, optimizer, scaler and scheduler states, the RNG states (torch, CUDA when
    used, Python ``random``, numpy when imported), ``step`` and ``extra`` (e.g. the sampler
    position). Returns ``path``. If writing fails, the files already there are untouched.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> model = torch.nn.Linear(2, 1)
    >>> save_checkpoint(f"{d}/ckpt.pt", model=model, step=3).name
    'ckpt.pt'
    >>> load_checkpoint(f"{d}/ckpt.pt", model=model)["step"]
    3
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": _rng_state(),
        "extra": dict(extra or {}),
    }
    return _atomic_save(payload, target, keep_previous=True)


def _atomic_save(payload: Mapping[str, Any], target: Path, keep_previous: bool) -> Path:
    """Write ``payload`` to ``target`` through a temporary file and a rename."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(payload), f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        if keep_previous and target.exists():
            os.replace(target, previous_path(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)
    return target


def rank_rng_path(path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its own RNG state beside checkpoint ``path``.

    >>> rank_rng_path("runs/demo/ckpt.pt", 2).name
    'ckpt.rng2.pt'
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.rng{rank}{p.suffix}")


def save_rank_rng(path: str | Path, rank: int, step: int) -> Path:
    """Save this process's RNG states for ``step`` (ranks other than the checkpoint writer).

    Under DDP only rank 0 writes the checkpoint, but every rank draws its own dropout masks:
    each keeps its generators in a small file of its own, tagged with the step, written with
    no collective so that a Ctrl-C on one rank cannot hang the others.
    """
    target = rank_rng_path(path, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": f"{_FORMAT}-rng", "step": int(step), "rng": _rng_state()}
    return _atomic_save(payload, target, keep_previous=False)


def load_rank_rng(path: str | Path, rank: int, step: int) -> bool:
    """Restore this rank's RNG states saved at ``step``; False when absent or from another step.

    >>> import tempfile
    >>> ckpt = f"{tempfile.mkdtemp()}/ckpt.pt"
    >>> _ = save_rank_rng(ckpt, rank=1, step=5)
    >>> a = torch.rand(1); _ = load_rank_rng(ckpt, rank=1, step=5); torch.equal(a, torch.rand(1))
    True
    >>> load_rank_rng(ckpt, rank=1, step=6)  # a different step: not this checkpoint's state
    False
    """
    source = rank_rng_path(path, rank)
    if not source.exists():
        return False
    payload = _read_rng(source)
    if int(payload["step"]) != int(step):
        return False
    _set_rng_state(payload["rng"])
    return True


def _fsync_dir(folder: Path) -> None:
    # The renames are durable only once the directory entry is flushed (POSIX only).
    if os.name != "posix":  # pragma: no cover
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Any]:
    fix = (
        f"resume from the previous good checkpoint {str(previous_path(path))!r} if it exists, "
        "or delete the file to start fresh"
    )
    if not path.is_file():
        raise EvendpError(f"no checkpoint at {str(path)!r}; check the path or drop --resume")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise EvendpError(
            f"checkpoint {str(path)!r} is unreadable ({type(exc).__name__}: "
            f"{_first_sentence(str(exc))}); it may be truncated or not an evendp checkpoint; "
            f"{fix}"
        ) from exc
    if (
        not isinstance(payload, dict)
        or payload.get("format") != _FORMAT
        or not isinstance(payload.get("model"), dict)
    ):
        raise EvendpError(
            f"{str(path)!r} is not an evendp checkpoint (no {_FORMAT!r} marker or model state); "
            f"{fix}"
        )
    if payload.get("version") != _VERSION:
        raise EvendpError(
            f"checkpoint {str(path)!r} has format version {payload.get('version')!r}, this "
            f"evendp reads version {_VERSION}; use the evendp that wrote it or start fresh"
        )
    return payload


def _read_rng(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        payload = exc
    if not isinstance(payload, dict) or payload.get("format") != f"{_FORMAT}-rng":
        raise EvendpError(
            f"{str(path)!r} is not a readable evendp rank RNG file; delete it to resume with "
            "the checkpoint writer's generator states on this rank"
        )
    return payload


def _first_sentence(text: str) -> str:
    """The first sentence of an error message, whole (never cut mid-sentence), no ANSI codes.

    >>> _first_sentence("Weights only load failed. In PyTorch 2.6, we changed (a)...")
    'Weights only load failed.'
    >>> _first_sentence("")
    'no detail'
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
    if not text:
        return "no detail"
    first = text.splitlines()[0]
    end = first.find(". ")
    return first if end < 0 else first[: end + 1]


def _validate_model_state(path: Path, model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    own = model.state_dict()
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and isinstance(v, torch.Tensor) and isinstance(state[k], torch.Tensor)
        if state[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        details = "; ".join(
            part
            for part in (
                f"missing keys {missing[:5]}" if missing else "",
                f"unexpected keys {unexpected[:5]}" if unexpected else "",
                f"shape mismatches {wrong[:5]}" if wrong else "",
            )
            if part
        )
        raise EvendpError(
            f"checkpoint {str(path)!r} does not match the model ({details}); resume with the "
            "same model configuration that wrote it, or use a new output directory"
        )


def _validate_optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, state: Mapping[str, Any] | None
) -> None:
    if state is None:
        raise EvendpError(
            f"checkpoint {str(path)!r} has no optimizer state but an optimizer was given; "
            "load it without optimizer= or resume from a full training checkpoint"
        )
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in state.get("param_groups", [])]
    if ours != theirs:
        raise EvendpError(
            f"checkpoint {str(path)!r} optimizer has parameter groups of sizes {theirs}, "
            f"the optimizer here has {ours}; build the optimizer the same way as the run "
            "that wrote it"
        )


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
    :class:`EvendpError` naming the file and the fix, and leaves the model, the optimizer and
    the file untouched. (See :func:`save_checkpoint` for an example.)
    """
    p = Path(path)
    payload = _read(p)
    _validate_model_state(p, model, payload["model"])
    if optimizer is not None:
        _validate_optimizer_state(p, optimizer, payload.get("optimizer"))
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scaler is not None and payload.get("scaler") is not None:
        scaler.load_state_dict(payload["scaler"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if restore_rng:
        _set_rng_state(payload["rng"])
    return {"step": int(payload["step"]), "extra": dict(payload.get("extra") or {})}
