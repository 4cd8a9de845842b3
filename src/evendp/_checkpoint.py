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
import shutil
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._errors import EvendpError
from ._train_inputs import validate_checkpoint_args

__all__ = [
    "checkpoint_step",
    "latest_checkpoint",
    "load_checkpoint",
    "load_rank_rng",
    "load_sharded_checkpoint",
    "previous_path",
    "rank_rng_path",
    "save_checkpoint",
    "save_rank_rng",
    "save_sharded_checkpoint",
]

_FORMAT = "evendp-checkpoint"
_VERSION = 1


def previous_path(path: str | Path) -> Path:
    """Where the previous good checkpoint of ``path`` (a file or a DCP folder) is kept.

    >>> previous_path("runs/demo/ckpt.pt").name, previous_path("runs/demo/ckpt.dcp").name
    ('ckpt.prev.pt', 'ckpt.prev.dcp')
    """
    p = Path(path)
    return p.with_name(f"{p.stem}.prev{p.suffix}")


def latest_checkpoint(path: str | Path) -> Path | None:
    """``path`` if it exists, else its previous copy if that exists (a crash mid-save), else None.

    >>> latest_checkpoint("/nonexistent/ckpt.pt") is None
    True
    """
    p = Path(path)
    if p.exists():
        return p
    prev = previous_path(p)
    return prev if prev.exists() else None


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint (``ckpt.pt`` file or ``ckpt.dcp`` folder) was saved at.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> checkpoint_step(save_checkpoint(f"{d}/ckpt.pt", model=torch.nn.Linear(1, 1), step=4))
    4
    """
    p = Path(path)
    payload = _read_state_file(p) if p.is_dir() else _read(p)
    return int(payload["step"])


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
        _set_cuda_rng_states(list(state["cuda"]))
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _set_cuda_rng_states(saved: list[torch.Tensor]) -> None:
    """Restore one CUDA generator per visible device, for as many as were saved and are here.

    A run resumed on fewer GPUs than it saved from would fail in ``set_rng_state_all``
    ("invalid device ordinal"); on more, the extra devices keep their seeded generators.
    """
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
    validate_checkpoint_args(path, model, optimizer, scaler, scheduler, step=step, extra=extra)
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
    return _atomic_save(payload, target, previous=previous_path(target))


def _atomic_save(payload: Mapping[str, Any], target: Path, previous: Path | None) -> Path:
    """Write ``payload`` to ``target`` through a temporary file and a rename.

    The file already at ``target`` is first moved to ``previous`` (unless ``None``).
    """
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(payload), f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        if previous is not None and target.exists():
            os.replace(target, previous)
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
    """Save this process's RNG states for ``step`` beside checkpoint ``path``, keeping the last.

    Under DDP only rank 0 writes the checkpoint, but every rank draws its own dropout masks:
    each keeps its generators in a small file of its own, tagged with the step, written with
    no collective so that a fault on one rank cannot hang the others. The file it replaces
    becomes the RNG file of :func:`previous_path` (``ckpt.prev.rng{rank}.pt``), rotated with
    the checkpoint, so a resume from the previous checkpoint finds this rank's state too.
    """
    target = rank_rng_path(path, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": f"{_FORMAT}-rng", "step": int(step), "rng": _rng_state()}
    return _atomic_save(payload, target, previous=rank_rng_path(previous_path(path), rank))


def load_rank_rng(path: str | Path, rank: int, step: int, reseed: int | None = None) -> bool:
    """Restore this rank's RNG states saved with checkpoint ``path`` at ``step``.

    Returns True when restored. When the rank's file is absent or holds another step (a crash
    between two ranks' writes, or a rank that did not exist when the run was saved), it warns
    and, with ``reseed``, seeds torch and ``random`` with it (the generators then differ from
    an uninterrupted run's, but never copy another rank's); it returns False.

    >>> import tempfile, warnings
    >>> ckpt = f"{tempfile.mkdtemp()}/ckpt.pt"
    >>> _ = save_rank_rng(ckpt, rank=1, step=5)
    >>> a = torch.rand(1); _ = load_rank_rng(ckpt, rank=1, step=5); torch.equal(a, torch.rand(1))
    True
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     load_rank_rng(ckpt, rank=1, step=6, reseed=7)  # another step: not this state
    False
    >>> "reseeded" in str(caught[0].message)
    True
    """
    source = rank_rng_path(path, rank)
    found: int | None = None
    if source.exists():
        payload = _read_rng(source)
        found = int(payload["step"])
        if found == int(step):
            _set_rng_state(payload["rng"])
            return True
    why = "is missing" if found is None else f"holds step {found}"
    what = "kept the state seeded at start" if reseed is None else f"reseeded with {reseed}"
    warnings.warn(
        f"rank {rank}: its RNG file {str(source)!r} for the checkpoint at step {step} {why}; "
        f"{what}: dropout and other random draws on this rank will differ from an "
        "uninterrupted run's",
        stacklevel=2,
    )
    if reseed is not None:
        torch.manual_seed(reseed)
        random.seed(reseed)
    return False


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
    validate_checkpoint_args(path, model, optimizer, scaler, scheduler, restore_rng=restore_rng)
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


# -- sharded (FSDP2) checkpoints through torch.distributed.checkpoint ----------------------------

_STATE_FILE = "state.pt"  # inside a DCP folder: step, extra, scaler/scheduler (rank 0's)


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng{rank}.pt"


def save_sharded_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save an FSDP2 model and optimizer with ``torch.distributed.checkpoint``, sharded.

    A collective: every rank calls it. The ranks write their shards, their own RNG states
    (``rng{rank}.pt``) and rank 0 the run's position (``state.pt``) into a temporary folder
    beside ``path``; once all have written, rank 0 moves the current folder to
    :func:`previous_path` and renames the new one into place, so a complete checkpoint exists
    at every instant and the RNG files rotate with it. No rank gathers the full model.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:  # a leftover of a save that crashed: never part of a checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    rng = {"format": f"{_FORMAT}-rng", "step": int(step), "rng": _rng_state()}
    _atomic_save(rng, _rng_file(tmp, rank), previous=None)
    if rank == 0:
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "step": int(step),
            "world_size": dist.get_world_size(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": dict(extra or {}),
        }
        _atomic_save(state, tmp / _STATE_FILE, previous=None)
    dist.barrier()  # every rank's shards and RNG are on disk
    if rank == 0:
        previous = previous_path(target)
        shutil.rmtree(previous, ignore_errors=True)
        if target.exists():
            os.replace(target, previous)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    dist.barrier()  # nobody reads or writes the next checkpoint before the rename
    return target


def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any | None = None,
    reseed: int | None = None,
) -> dict[str, Any]:
    """Restore a folder written by :func:`save_sharded_checkpoint`, on any world size.

    A collective. DCP reshards the saved model and optimizer onto this run's ranks; this
    rank's RNG states are restored from its own file, or, when the run was saved with fewer
    ranks, reseeded with ``reseed`` and a warning. Returns ``{"step", "extra",
    "world_size"}``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(path)
    meta = _read_state_file(folder)
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads in place into these (sharded) tensors, resharding to this world size.
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    if scaler is not None and meta.get("scaler") is not None:
        scaler.load_state_dict(meta["scaler"])
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rank = dist.get_rank()
    rng_file = _rng_file(folder, rank)
    if rng_file.exists():
        _set_rng_state(_read_rng(rng_file)["rng"])
    else:
        warnings.warn(
            f"rank {rank}: the checkpoint {str(folder)!r} was saved by "
            f"{meta.get('world_size')} rank(s) and holds no RNG state for this rank; "
            f"{'kept the state seeded at start' if reseed is None else f'reseeded with {reseed}'}",
            stacklevel=2,
        )
        if reseed is not None:
            torch.manual_seed(reseed)
            random.seed(reseed)
    return {
        "step": int(meta["step"]),
        "extra": dict(meta.get("extra") or {}),
        "world_size": int(meta.get("world_size", 0)),
    }


def _read_state_file(folder: Path) -> dict[str, Any]:
    source = folder / _STATE_FILE
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, truncated or foreign
        raise EvendpError(
            f"{str(folder)!r} is not a readable evendp sharded checkpoint ({type(exc).__name__} "
            f"reading {_STATE_FILE}); resume from {str(previous_path(folder))!r} if it exists, "
            "or delete the folder to start fresh"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise EvendpError(
            f"{str(source)!r} is not an evendp checkpoint state file; delete {str(folder)!r} "
            "to start fresh"
        )
    return payload
