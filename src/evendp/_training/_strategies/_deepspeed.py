"""DeepSpeed ZeRO (stages 0 to 3) under evendp's Trainer: the engine owns backward and the step.

The Trainer drives the micro-steps itself (uneven per-rank shares, an accumulation boundary on
the last one), so DeepSpeed is told ``gradient_accumulation_steps=1`` and each micro-step's
backward runs with ``scale_wrt_gas=False``: nothing divides by accumulation steps. The loss
arrives weighted by ``world / the step's global count`` (the Trainer's ``StepWeight``), which is
``evendp._core._exact.averaged_scale(count, ranks=world, divided_by=1)``: DeepSpeed's average
over the ranks (ZeRO-1/2's reduce, ZeRO-3's reduce-scatter) then leaves exactly the gradient of
the mean over the step's counted items on every rank, and ``gradient_clipping`` clips that one.

What evendp owns in the DeepSpeed config, filled in from the run: ``train_batch_size``,
``train_micro_batch_size_per_gpu`` (the mean per-rank share, rounded up: DeepSpeed uses it only
for its throughput log and sample counter, never for the gradient) and
``gradient_accumulation_steps`` (1); ``gradient_clipping`` from ``TrainConfig.grad_clip`` and
``bf16``/``fp16`` from ``TrainConfig.amp`` unless the user's config sets them (a contradiction
is refused). Without ``strategy_config``: ZeRO stage 2.

Checkpoints are DeepSpeed's own files in ``OUT/ckpt.ds/step<N>/`` (every rank writes its
partitions) beside evendp's ``state.pt`` (the run's position, rank 0) and ``state.rng<R>.pt``
(each rank's generators), written and read by :class:`~evendp._training._recorder.TrainState`;
the step's folder and the previous one are kept. DeepSpeed's loader calls
``torch.load(weights_only=False)``: a resume here first checks every file of the step's folder
(a plain ``torch.save`` zip, :func:`~evendp._training._safe_read.check_archive`) and loads it
with ``weights_only=True`` admitting only DeepSpeed's own data classes (its loss scaler, the
ZeRO stage enum, a fragment address), then loads with the engine's reader replaced by that same
safe read; universal checkpoints (another loader) are refused in the config.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._core._errors import CheckpointError, EvendpError, TrainingError
from ..._core._files import NotReadable, open_regular
from ..._core._validate import json_data, shown
from ..._distributed._engine_mean import config_micro_batch
from ..._distributed._rank_errors import agreed
from .._checkpoint import (
    CorruptCheckpoint,
    disk_error,
    first_good,
    make_private_dir,
    previous_path,
)
from .._checkpoint_names import DEEPSPEED_FILES
from .._checkpointer import CheckpointFormat, Verify, WholeFile, step_of
from .._safe_read import Refused, check_archive
from .._step import NonFiniteGate, default_optimizer, run_schedule
from ._base import SamplerInputs, Sampling
from ._ddp import RankStrategy

__all__ = [
    "DeepSpeed",
    "DeepSpeedFiles",
    "EngineStep",
    "build",
    "check_strategy_config",
    "deepspeed_config",
]

#: Settings evendp fills in from the run (the user may leave them out or say "auto").
_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DEFAULTS: dict[str, Any] = {
    "zero_optimization": {"stage": 2},
    # evendp's default AdamW (and any torch optimizer the user passes) is not on DeepSpeed's
    # list of tested ZeRO optimizers; the exactness tests are evendp's.
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1_000_000_000,  # the Trainer has its own progress bar and report
}
_MAX_CONFIG_BYTES = 1 << 20
_STATE = "state.pt"  # evendp's part of the checkpoint folder (TrainState's file)
_TAG = re.compile(r"step(\d+)")


def _refuse(what: str) -> EvendpError:
    return EvendpError(f"strategy='deepspeed': {what}")


def _given_config(given: Any) -> dict[str, Any]:
    """``TrainConfig.strategy_config`` as a dict: a dict, or a JSON file read as data."""
    if given is None:
        return {}
    if isinstance(given, dict):
        return json.loads(json.dumps(given))  # a deep copy, and only JSON's kinds of values
    path = Path(given)
    try:
        with open_regular(path, _MAX_CONFIG_BYTES) as f:
            loaded = json_data(f.read().decode("utf-8"))
    except NotReadable as exc:
        raise _refuse(
            f"strategy_config {shown(str(path))} is refused: {exc} (1 MiB at most); pass the "
            "path of a DeepSpeed JSON config"
        ) from None
    except OSError as exc:
        raise _refuse(
            f"cannot read strategy_config {shown(str(path))}: {exc.strerror or exc}; pass the "
            "path of a DeepSpeed JSON config"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:  # bad syntax, or nested too deep
        raise _refuse(
            f"strategy_config {shown(str(path))} is not JSON ({exc}); pass a DeepSpeed JSON "
            'config, e.g. {"zero_optimization": {"stage": 2}}'
        ) from None
    if not isinstance(loaded, dict):
        raise _refuse(
            f"strategy_config {shown(str(path))} holds a {type(loaded).__name__}, not a JSON "
            'object; e.g. {"zero_optimization": {"stage": 2}}'
        )
    return loaded


def _check_precision(ds: dict[str, Any], amp: str) -> None:
    """``bf16``/``fp16`` agree with ``TrainConfig.amp``: filled in when absent or "auto"."""
    for kind in ("bf16", "fp16"):
        section = ds.get(kind, {})
        if not isinstance(section, dict):
            raise _refuse(f"{kind} must be an object like {{'enabled': true}}, got {section!r}")
        enabled = section.get("enabled", "auto")
        wanted = amp == kind
        if enabled == "auto":
            if wanted:
                ds[kind] = {**section, "enabled": True}
            continue
        if bool(enabled) != wanted:
            said = "enables" if enabled else "disables"
            raise _refuse(
                f"strategy_config {said} {kind}, but amp={amp!r}; give amp={kind!r} "
                f"(or amp='none' without {kind}), or drop {kind} from the DeepSpeed config"
            )


def _check_given(ds: dict[str, Any]) -> None:
    """What the user's config may not set: evendp's batch settings, a universal checkpoint."""
    for key in _OWNED:
        if key in ds and ds[key] != "auto":
            raise _refuse(
                f"strategy_config sets {key}={shown(ds[key])}, which evendp sets from "
                'batch_sizes and accum (it drives the micro-steps itself); drop it or say "auto"'
            )
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        raise _refuse(
            f"zero_optimization.stage must be 0, 1, 2 or 3, got {shown(stage)}; e.g. "
            '{"zero_optimization": {"stage": 2}}'
        )
    checkpoint = ds.get("checkpoint", {})
    if isinstance(checkpoint, dict) and checkpoint.get("load_universal"):
        raise _refuse(
            "checkpoint.load_universal loads DeepSpeed's universal checkpoints, which it reads "
            "with torch.load(weights_only=False); evendp resumes its own ckpt.ds only: drop it"
        )


def check_strategy_config(given: Any) -> None:
    """The registry's check of ``--strategy-config`` in the launcher, before any rank starts:
    the file reads as a JSON object and sets nothing evendp owns."""
    _check_given(_given_config(given))


def deepspeed_config(config: Any, batch_sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a run: the user's ``config.strategy_config`` (ZeRO-2 without
    one) with what evendp owns filled in; ``batch_sizes`` (per rank) fix the micro-batch size
    DeepSpeed logs (``None``: only checked).

    >>> from evendp import TrainConfig
    >>> ds = deepspeed_config(TrainConfig(grad_clip=0.5), [1, 3])
    >>> ds["zero_optimization"], ds["train_batch_size"], ds["gradient_clipping"]
    ({'stage': 2}, 4, 0.5)
    """
    given = _given_config(config.strategy_config)
    _check_given(given)
    ds = {**_DEFAULTS, **given}
    _check_precision(ds, config.amp)
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = 0.0 if config.grad_clip is None else float(config.grad_clip)
    if batch_sizes is not None:
        world = max(1, len(batch_sizes))
        # DeepSpeed checks train_batch_size == micro * accumulation * world; the figures feed
        # only its throughput log and sample counter.
        micro = config_micro_batch(batch_sizes)
        ds.update(
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=1,
            train_batch_size=micro * world,
        )
    return ds


# -- checkpoints: DeepSpeed's files, read as data ---------------------------------------------


def _data_classes() -> list[Any]:
    """The classes DeepSpeed 0.19's checkpoint files hold besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location: Any = None) -> Any:
    """A DeepSpeed checkpoint file as data: a regular file (opened without blocking), a plain
    ``torch.save`` zip, loaded with ``weights_only=True`` and only DeepSpeed's own data classes
    admitted."""
    where = Path(path)
    try:
        with open_regular(where, mine=True) as source:
            check_archive(source)
            with torch.serialization.safe_globals(_data_classes()):
                return torch.load(source, map_location=map_location, weights_only=True)
    except (Refused, NotReadable) as exc:
        raise CorruptCheckpoint(
            f"DeepSpeed checkpoint file {str(where)!r} is refused: {exc}"
        ) from None
    except PermissionError:
        raise
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        said = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "no detail"
        raise CorruptCheckpoint(
            f"DeepSpeed checkpoint file {str(where)!r} is not plain data or is unreadable "
            f"({type(exc).__name__}: {said})"
        ) from None


@contextlib.contextmanager
def _reading_safely(engine: Any) -> Iterator[None]:
    """The engine's checkpoint reader is :func:`safe_load` while this lasts."""
    reader = engine.checkpoint_engine
    reader.load = safe_load  # an instance attribute: DeepSpeed's own class is untouched
    try:
        yield
    finally:
        del reader.load


class DeepSpeed(RankStrategy):
    """One process per device, the model inside a DeepSpeed engine (ZeRO stage from the
    config): ``engine.backward`` and ``engine.step`` replace evendp's optimizer step (the
    run's stepper is :class:`EngineStep`).

    ZeRO-2 and 3 reduce (and ZeRO-3 gathers) inside every micro-step's forward or backward, so
    an OOM is fatal and every rank runs as many micro-steps as the most any rank runs (an
    empty one runs a stand-in sample of weight 0); ZeRO-3's evaluation runs every rank's
    forwards too. The non-finite gate: DeepSpeed skips a step whose gradient norm is NaN/inf
    (fp16 always; fp32 and bf16 when ``gradient_clipping`` is on, as the norm is computed
    then) and counts it (``engine.skipped_steps``); ``max_nonfinite_steps`` such skips in a
    row stop the run (read where DeepSpeed read them).
    """

    name = "deepspeed"

    def __init__(self, model: nn.Module, config: Any) -> None:
        super().__init__(model)
        self._ds = deepspeed_config(config)  # refused here, before any engine is built
        # ZeRO-2/3 communicate in every micro-step's backward (ZeRO-3 in forward too).
        self._min_micro_steps = int(config.accum)
        self._forward_collectives = self._ds["zero_optimization"].get("stage", 0) == 3
        self._batch_sizes: list[int] = []
        self._format = DeepSpeedFiles(self)
        self.engine: Any = None

    # -- setup -------------------------------------------------------------------------------

    def sampler(self, inputs: SamplerInputs) -> Sampling:
        built = super().sampler(inputs)
        self._batch_sizes = list(built[0].batch_sizes)  # DeepSpeed's logged micro-batch
        return built

    def build_stepper(
        self,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        config: Any,
        *,
        where: str = "",
    ) -> EngineStep:
        """``deepspeed.initialize`` on the loss module: ``optimizer``, else the config's
        ``"optimizer"`` section, else AdamW with ``config.lr`` and ``config.weight_decay``;
        the engine, stepped by :class:`EngineStep`."""
        import deepspeed

        ds = deepspeed_config(config, self._batch_sizes or [1] * self.world)
        if optimizer is not None and "optimizer" in ds:
            raise _refuse(
                'both an optimizer and the DeepSpeed config\'s "optimizer" section were given; '
                "pass one"
            )
        if optimizer is None and "optimizer" not in ds:
            optimizer = default_optimizer(self.model.parameters(), config.lr, config.weight_decay)
        if config.warmup_steps and "scheduler" in ds:
            raise _refuse(
                f'warmup_steps={config.warmup_steps} and the DeepSpeed config\'s "scheduler" '
                "section both set the learning-rate schedule; pass one"
            )
        if scheduler is None and config.warmup_steps:  # built on the engine's own optimizer
            scheduler = functools.partial(
                run_schedule, scheduler=None, warmup_steps=config.warmup_steps
            )
        try:
            engine, *_ = deepspeed.initialize(
                model=self.wrapped, optimizer=optimizer, lr_scheduler=scheduler, config=ds
            )
        except (ValueError, AssertionError, TypeError, KeyError) as exc:  # its config checks
            said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
            raise _refuse(
                f"DeepSpeed refused the config ({type(exc).__name__}: {said}); fix strategy_config"
            ) from None
        if type(engine.checkpoint_engine).__name__ != "TorchCheckpointEngine":
            raise _refuse(
                f"the config picks DeepSpeed's {type(engine.checkpoint_engine).__name__}; evendp "
                "reads checkpoints back as data through the torch engine only: drop the "
                "checkpoint engine settings"
            )
        self.engine = self.wrapped = engine
        return EngineStep(engine, NonFiniteGate(config.max_nonfinite_steps, where))

    # -- one step ----------------------------------------------------------------------------

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        # The Trainer marks the boundary: ZeRO reduces (and steps) on the last micro-step.
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    @property
    def checkpoint_format(self) -> CheckpointFormat:  # type: ignore[override]
        """DeepSpeed's files of each step beside evendp's ``state.pt``
        (:class:`DeepSpeedFiles`)."""
        return self._format


class EngineStep:
    """DeepSpeed's engine as the run's :class:`~evendp._training._step.Stepper`: its
    backward (no division by accumulation steps), its step (ZeRO's reduce, clipping, the
    update, the schedule) and its count of the steps it skipped on a non-finite norm, which
    the non-finite gate counts in a row (``max_nonfinite_steps``; read where DeepSpeed read
    them)."""

    #: fp16's loss scale is DeepSpeed's, inside its optimizer.
    scaler = None

    def __init__(self, engine: Any, gate: NonFiniteGate) -> None:
        self.engine, self.gate = engine, gate

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        # ``loss`` carries world / count (averaged_scale with divided_by=1): DeepSpeed's mean
        # over the ranks finishes it, and no division by accumulation steps may follow.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, step: int) -> bool:
        return optimizer_step(self.engine, self.gate if self.gate.limit > 0 else None, step)

    def settle(self) -> None:
        self.gate.check()

    @property
    def optimizer(self) -> Any:
        """The optimizer DeepSpeed steps (ZeRO's wrapper: ``param_groups`` hold the lr)."""
        return self.engine.optimizer

    @property
    def scheduler(self) -> Any | None:
        return self.engine.lr_scheduler

    @property
    def skipped(self) -> int:
        return int(self.engine.skipped_steps)


def optimizer_step(engine: Any, gate: NonFiniteGate | None, step: int) -> bool:
    """``engine.step()`` for step ``step``: whether DeepSpeed skipped it on a non-finite norm
    (it read the norm already), counted by ``gate`` (``None``: no gate). The host reads inside
    are DeepSpeed's own, which the host-read test names by this function."""
    before = engine.skipped_steps
    engine.step()
    skipped = engine.skipped_steps != before
    if gate is not None:
        gate.found(torch.tensor(math.inf if skipped else 0.0), step)
    return skipped


class DeepSpeedFiles(CheckpointFormat):
    """``OUT/ckpt.ds``: DeepSpeed's files of a step in ``step<N>/`` (every rank its
    partitions; the last two steps kept) beside evendp's ``state.pt`` (the run's position and
    plain-data parts, rank 0; its previous copy ``state.prev.pt``) and ``state.rng<R>.pt``. The
    weights, optimizer and schedule live in DeepSpeed's files only. A collective."""

    name = DEEPSPEED_FILES

    def __init__(self, strategy: DeepSpeed) -> None:
        self._strategy = strategy
        self._kept: list[int] = []  # the steps whose DeepSpeed folders are kept (last two)
        # The resume fell back past state.pt: the next save replaces it without rotating it
        # over the good state.prev.pt.
        self._fell_back = False

    def save(
        self,
        path: Path,
        parts: Mapping[str, Any],
        *,
        rank: int,
        extra: dict[str, Any],
        keep_previous: bool,
    ) -> Path | None:
        """DeepSpeed's files of this step (every rank its partitions; 0700/0600 like every
        checkpoint of evendp's), then evendp's state."""
        engine, step = self._strategy.engine, step_of(parts)
        tag = f"step{step}"
        make_private_dir(path)
        failed = _WriteFailures()
        with _private_files(), failed.kept(engine):
            engine.save_checkpoint(str(path), tag=tag, client_state={}, save_latest=False)
        try:  # every rank, after the save's last barrier
            agreed(lambda: failed.raise_first(path / _STATE), distributed=True)
        except TrainingError:
            if rank == 0:  # the torn step folder; state.pt still names the previous one
                shutil.rmtree(path / tag, ignore_errors=True)
            raise
        WholeFile().save(
            path / _STATE, _position(parts), rank=rank, extra=extra,
            keep_previous=keep_previous and not self._fell_back,
        )  # fmt: skip
        self._fell_back = False
        self._kept = [*self._kept[-1:], step]
        agreed(lambda: self._drop_stale(path, rank), distributed=True)
        return path

    def load(
        self, path: Path, parts: Mapping[str, Any], *, rank: int, verify: Verify
    ) -> dict[str, Any]:
        """evendp's state (``state.pt``) and DeepSpeed's files of its step, each checked as data
        first; when either is corrupt or hostile, the previous position (``state.prev.pt``) and
        its step's files."""
        latest = path / _STATE
        candidates = [p for p in (latest, previous_path(latest)) if os.path.lexists(p)]
        if not candidates:
            raise CorruptCheckpoint(f"checkpoint {str(path)!r} has no {_STATE}")

        def position(found: Path) -> dict[str, Any]:
            info = WholeFile().load(found, _position(parts), rank=rank, verify=verify)
            agreed(functools.partial(_verify, path / f"step{info['step']}"), distributed=True)
            return info

        _, info, skipped = first_good(candidates, position)
        self._load_engine(path / f"step{info['step']}")
        self._kept, self._fell_back = [info["step"]], bool(skipped)
        if skipped:
            info["notes"] = [f"{s}; fell back to the previous position" for s in skipped]
        return info

    def _load_engine(self, folder: Path) -> None:
        """DeepSpeed's own load of a checked step folder, its reader the safe one."""
        engine = self._strategy.engine
        with _reading_safely(engine):
            try:
                loaded, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name)
            except (RuntimeError, KeyError, ValueError) as exc:  # DeepSpeed's own mismatches
                said = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else repr(exc)
                raise CheckpointError(
                    f"DeepSpeed checkpoint {str(folder)!r} does not fit this run ({said}); "
                    "resume with the same model, ranks and strategy_config, or start fresh "
                    "with another --out"
                ) from None
        if loaded is None:
            raise CorruptCheckpoint(f"DeepSpeed checkpoint {str(folder)!r} is missing its files")

    def _drop_stale(self, path: Path, rank: int) -> None:
        """Rank 0 removes the step folders no kept ``state.pt`` names (after every rank wrote)."""
        if rank != 0:
            return
        for folder in path.iterdir():
            match = _TAG.fullmatch(folder.name)
            if match and folder.is_dir() and int(match[1]) not in self._kept:
                shutil.rmtree(folder, ignore_errors=True)


class _WriteFailures:
    """DeepSpeed's file writes during a save, their failures (a full disk) kept instead of
    raised: an error raised on one rank mid-save would leave the others in the save's later
    collectives (a ZeRO-3 gather, its closing barrier), so every rank runs the save to its
    end and the ranks then agree on the first failure (:meth:`raise_first`)."""

    def __init__(self) -> None:
        self.first: tuple[Path, OSError] | None = None

    @contextlib.contextmanager
    def kept(self, engine: Any) -> Iterator[None]:
        writer, copy = engine.checkpoint_engine.save, engine._copy_recovery_script

        def save(state_dict: Any, path: str) -> None:  # DeepSpeed passes both by name
            self._guarded(Path(path), lambda: writer(state_dict, path))

        def copy_scripts(folder: str) -> None:
            self._guarded(Path(folder), lambda: copy(folder))

        engine.checkpoint_engine.save = save  # instance attributes: DeepSpeed's classes stay
        engine._copy_recovery_script = copy_scripts
        try:
            yield
        finally:
            del engine.checkpoint_engine.save, engine._copy_recovery_script

    def _guarded(self, where: Path, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as exc:  # the state is built: what fails here is the file's write
            if self.first is None:
                self.first = (where, exc if isinstance(exc, OSError) else _write_error(where, exc))

    def raise_first(self, position: Path) -> None:
        """The first failure as one line (``position``: the ``state.pt`` still intact)."""
        if self.first is not None:
            where, exc = self.first
            raise disk_error(where, exc, "write", checkpoint=position)


def _write_error(where: Path, exc: Exception) -> OSError:
    """The OSError behind a failed ``torch.save`` to a path, which raises a ``RuntimeError``
    ("unexpected pos 576 vs 534") with no errno: a full file system, said as such, or torch's
    first line."""
    with contextlib.suppress(OSError):
        if os.statvfs(where.parent if where.suffix else where).f_bavail == 0:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    said = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return OSError(errno.EIO, f"torch.save failed: {said}")


@contextlib.contextmanager
def _private_files() -> Iterator[None]:
    """Files and folders created meanwhile are their owner's alone (DeepSpeed creates its
    files with the umask's mode, 0644 under the usual 022). The umask is the process's: no
    other thread of a rank creates files during a save."""
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


#: The parts DeepSpeed's own files keep (evendp's ``state.pt`` holds the others).
_ENGINE_PARTS = ("model", "optimizer", "scaler", "scheduler")


def _position(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The parts evendp's files keep: the run's position, each rank's generators..."""
    return {name: part for name, part in parts.items() if name not in _ENGINE_PARTS}


def _verify(folder: Path) -> None:
    """Every file of a step's DeepSpeed folder loads as data (before DeepSpeed reads one)."""
    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    if not files:
        raise CorruptCheckpoint(
            f"DeepSpeed checkpoint {str(folder)!r} is missing; start fresh with another --out"
        )
    for file in files:
        safe_load(file, map_location="cpu")


def build(model: nn.Module, config: Any, device_ids: Any, weights: Any) -> DeepSpeed:
    """The registry's ``"deepspeed"``: the config checked now, the engine built with the
    optimizer (:meth:`DeepSpeed.build_stepper`)."""
    strategy = DeepSpeed(model, config)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise EvendpError(
            "strategy='deepspeed' needs the deepspeed package, which is not installed; pip "
            "install evendp[deepspeed]"
        ) from None
    return strategy
