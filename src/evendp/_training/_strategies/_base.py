"""The contract of a strategy: the capabilities a training step calls, from wrapping the model
to the gradients' reduction; the update is the stepper's it builds."""

from __future__ import annotations

import abc
import contextlib
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..._core._errors import EvendpError
from ..._distributed._run_lock import trainer_lock
from ..._distributed._sampler import UnevenBatchSampler
from .._checkpointer import CheckpointFormat, WholeFile
from .._evaluate import EvalRun
from .._oom import OomResplit
from .._step import OptimizerStep, Stepper, StepWeight, default_optimizer, run_schedule

__all__ = ["Sampling", "SamplerInputs", "StepEnd", "StopSource", "Strategy", "place_model"]

Batch = Any
Costs = Sequence[float] | Callable[[Any], float] | None


class StopSource(Protocol):
    """Where this process's pending stop request is read: ``signum``, a signal or ``None``
    (the Trainer's :class:`~evendp._distributed._interrupt.StopFlag`)."""

    signum: int | None


class _NoStop:
    signum: int | None = None


class Sampling(NamedTuple):
    """What :meth:`Strategy.sampler` builds: the sampler of this process's samples of each
    step, the balancer the loop calls at step boundaries, and the costs (and caps) that order
    a step's rows over this process's devices (``None``: none, the sampler already split the
    step by cost)."""

    sampler: UnevenBatchSampler
    balancer: Any
    costs: Costs = None
    max_costs: Sequence[float] | None = None


@dataclass(frozen=True)
class SamplerInputs:
    """What :meth:`Strategy.sampler` reads: the dataset, the :class:`~evendp.TrainConfig`,
    the costs and their caps, the token budget, and ``model()`` and ``example()`` (the loss
    module and one batch, for planning ``batch_sizes="auto"``)."""

    data: Any
    config: Any
    costs: Costs
    max_costs: Sequence[float] | None
    max_tokens: float | None
    model: Callable[[], nn.Module]
    example: Callable[[], Any]


@dataclass(frozen=True)
class StepEnd:
    """What every process agreed at a step's end (:meth:`Strategy.finish_step`).

    ``total``: the step's loss total, this process's part (``None``: the step is skipped on
    every process, an OOM left nothing to run somewhere); ``votes``: the ranks' summed
    ``(SIGINT, SIGTERM)`` stop votes when they rode with the step (``None``: not read).
    """

    total: torch.Tensor | None
    votes: tuple[float, float] | None = None


class Strategy(abc.ABC):
    """The capabilities :meth:`~evendp.Trainer.train_step` calls, whatever the mode:
    :meth:`place` (rows to devices), :meth:`count_weight` (a ``count_fn`` count summed over
    processes), :meth:`micro_step` (around each micro-step: gradient sync on the last),
    :meth:`forward`, and :meth:`finish_step` (reduced and agreed: step or skip, one call that
    returns a value); the loop calls :meth:`agree_stop` between steps.

    Setup: :meth:`wrap` the loss module (refusing an optimizer it cannot use), the
    :meth:`sampler` (with the cost plan inside this process), :meth:`build_stepper` (the
    :class:`~evendp._training._step.Stepper` the Trainer calls). Losses and samples are
    summed over processes by :meth:`reduce_losses` and :meth:`reduce_samples` when read.
    Also evaluation (:meth:`evaluate`) and the checkpoint's on-disk format
    (:attr:`checkpoint_format`).

    For each ``fit``: :meth:`running` (the run folder's lock, the stop requests' source);
    :meth:`guard`, the OOM re-split of a step's micro-steps.

    Subclasses: :class:`~evendp._training._strategies.BalancedDP` (one process) and the
    one-rank-per-device strategies of
    :class:`~evendp._training._strategies._ddp.RankStrategy`; the registry
    (``_registry.py``) names them.
    """

    #: The report's ``mode``.
    name: str
    #: How the run's state is laid out on disk (its name in ``out_dir`` too): one file.
    checkpoint_format: CheckpointFormat = WholeFile()
    #: The parts of a step besides the forward that run without waiting for another rank
    #: (``"backward"``, ``"optimizer"``): the speed balancer times them with the forward. A
    #: part with a collective inside (DDP's bucketed backward, FSDP2's clipping, DeepSpeed's
    #: engine) would time the slowest rank on every rank.
    local_parts: frozenset[str] = frozenset()
    #: Ranks of a launcher's process group: the run folder's lock is the launcher's.
    _launched = False
    #: Whether an OOM re-splits the step (``oom_resplit``) rather than propagating: not where
    #: collectives inside backward would pair wrongly after a retry.
    _survives_oom = True
    #: The fewest micro-steps a process runs, empty share or not (collectives inside forward
    #: or backward: every rank runs as many as the most any rank runs).
    _min_micro_steps = 0

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device: torch.device = next(model.parameters()).device
        #: The devices this process runs on.
        self.devices: list[torch.device] = [self.device]
        self.rank, self.world = 0, 1
        #: The module a step runs (the loss module, wrapped): set by :meth:`wrap`.
        self.wrapped: nn.Module = model
        self.device_names: list[str] = []
        #: Where :meth:`agree_stop` (and a consensus riding on a step) reads this process's
        #: stop request: the Trainer's signal flag, set by :meth:`running`.
        self._stop: StopSource = _NoStop()

    # -- setup -------------------------------------------------------------------------------

    @abc.abstractmethod
    def wrap(self, loss_module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Prepare ``loss_module`` (the model with its loss inside forward) for this strategy,
        first refusing an ``optimizer`` it cannot use (one built before sharding).

        ``loss_module(*batch)`` returns the loss of its rows *summed* over their counted items.
        """

    @abc.abstractmethod
    def sampler(self, inputs: SamplerInputs) -> Sampling:
        """The sampler of this process's samples of each step (split by cost where it is),
        the balancer the loop calls at step boundaries (``config.balance``) and the cost plan
        over this process's devices (:class:`Sampling`)."""

    def guard(self, oom_resplit: bool) -> OomResplit:
        """The OOM re-split of a step's micro-steps (``oom_resplit=False``, or a strategy
        whose collectives a retry would pair wrongly: an OOM propagates)."""
        return OomResplit(
            catch=oom_resplit and self._survives_oom,
            devices=len(self.shares(0)),
            min_micro_steps=self._min_micro_steps,
        )

    @contextlib.contextmanager
    def running(self, out_dir: Any, stop: StopSource) -> Any:
        """For the life of ``fit``: the run's hold on ``out_dir`` (one writer per run folder:
        one process takes it; ranks join their launcher's, :mod:`evendp._distributed._run_lock`),
        and where :meth:`agree_stop` reads this process's stop request (the signal flag)."""
        with trainer_lock(out_dir, distributed=self._launched):
            self._stop = stop
            try:
                yield
            finally:
                self._stop = _NoStop()

    def build_stepper(
        self,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        config: Any,
        *,
        where: str = "",
    ) -> Stepper:
        """The run's stepper, which the Trainer calls (after :meth:`wrap`: FSDP2's parameters
        are sharded by then): ``optimizer``, else AdamW with ``config.lr`` and
        ``config.weight_decay``; fp16 loss scaling, clipping, the non-finite gate and the
        schedule (:class:`~evendp._training._step.OptimizerStep`). ``where`` names
        the last good checkpoint for the gate's message."""
        built = optimizer or default_optimizer(
            self.model.parameters(), config.lr, config.weight_decay
        )
        schedule = run_schedule(built, scheduler, config.warmup_steps)
        return OptimizerStep(
            self.model, built, schedule, amp=config.amp, grad_clip=config.grad_clip,
            max_nonfinite_steps=config.max_nonfinite_steps, where=where,
            device_type=self.device.type,
        )  # fmt: skip

    # -- one step ----------------------------------------------------------------------------

    @abc.abstractmethod
    def place(self, batch: Batch) -> Batch:
        """The batch where this strategy's forward reads it."""

    @abc.abstractmethod
    def shares(self, n: int) -> list[int]:
        """This process's per-device shares of a step of ``n`` local samples."""

    @abc.abstractmethod
    def count_weight(self, local: torch.Tensor) -> StepWeight:
        """``world / the step's counted items over every process``, from this process's
        ``count_fn`` count ``local`` (float64, 0-dim), before the first backward.

        (The samples, or per-sample counts, are known everywhere: the Trainer needs no
        strategy for those.)
        """

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-step's forward and backward: gradient sync on ``last`` only, and
        what this strategy runs around them (buckets launched during backward)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        """The micro-step's loss summed over its counted items (``rows[i]`` rows on device i)."""

    def finish_step(self, failed: bool, total: torch.Tensor | None) -> StepEnd:
        """After a step's micro-steps, on every process whatever happened (``failed``: an OOM
        left nothing to run here): the gradient reduction backward did not finish (DDP and
        FSDP2 reduce inside it; one process has nothing to reduce), then whether every
        process steps. Unless the returned total is ``None`` (skipped everywhere), ``.grad``
        holds the step's reduced gradients."""
        return StepEnd(None if failed else total)

    # -- what the loop reads -----------------------------------------------------------------

    @abc.abstractmethod
    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        """The step losses from ``parts`` ((steps,) this process's parts): one collective."""

    @abc.abstractmethod
    def reduce_samples(self, samples: list[int]) -> list[int]:
        """Per device of the report, the samples trained, from this process's counts."""

    @abc.abstractmethod
    def agree_stop(
        self,
        step: int,
        votes: tuple[float, float] | None = None,
        *,
        starting: bool = False,
        interrupted: KeyboardInterrupt | None = None,
    ) -> int | None:
        """The stop signal every process stops with, the same on every process, or ``None``,
        with ``step`` steps done (``starting``: before this run's first step; ``votes``: the
        step's :attr:`StepEnd.votes`, read already). ``interrupted``: a
        ``KeyboardInterrupt`` that no signal flag caught: the signal to stop with, or
        re-raised where the other processes could not agree on it."""

    @abc.abstractmethod
    def evaluate(self, run: EvalRun) -> dict[str, float]:
        """Every sample of ``run.data`` once over all devices and processes: ``{name: value}``."""


def build_sampler(
    inputs: SamplerInputs, *, requested: Any, rank: int, world: int, distributed: bool
) -> Sampling:
    """The sampler and balancer for ``world`` processes asking for ``requested`` sizes (the
    shared body of every strategy's :meth:`Strategy.sampler`)."""
    data, config = inputs.data, inputs.config
    from ..._distributed._batch_plan import BatchPlan
    from ..._distributed._plan_agreement import agreed_plan
    from ..._planning._balance import rank_batch_plan, step_balancer

    def plan_it() -> Any:
        # Ranks: the sizes a launcher left (evendp launch), unless the config gives its own.
        launched = BatchPlan.from_env(world) if distributed else None
        return rank_batch_plan(
            requested, config.batch_size, world, model=inputs.model, example=inputs.example,
            launched=launched,
        )  # fmt: skip

    # Ranks: one plan on every rank, or every rank stops (two nodes given other sizes).
    plan = agreed_plan(plan_it, world) if distributed and world > 1 else plan_it()
    sampler = UnevenBatchSampler(
        data, list(plan.sizes), rank=rank, world_size=world, seed=config.seed,
        costs=inputs.costs, max_costs=inputs.max_costs, max_tokens=inputs.max_tokens,
    )  # fmt: skip
    # balance="speed": at step boundaries samples move from slow ranks to fast ones.
    caps = None if plan.caps is None else list(plan.caps)
    balancer = step_balancer(
        sampler.batch_sizes, config.balance, distributed=distributed, caps=caps,
        apply=sampler.set_batch_sizes,  # a new split, a resumed one too, from the next step
    )  # fmt: skip
    _validate_batch_fits(data, sampler.batch_sizes, distributed)
    _warn_unused_batch_sizes(config, distributed)
    return Sampling(sampler, balancer)


def _validate_batch_fits(data: Any, batch_sizes: Sequence[int], distributed: bool) -> None:
    """Refuse a step larger than the dataset: it would silently train smaller steps (every
    step would be the whole dataset, not the batch asked for)."""
    step = sum(batch_sizes)
    if step > len(data):
        name = "sum(batch_sizes)" if distributed else "batch_size"
        raise EvendpError(
            f"{name}={step} is larger than the dataset ({len(data)} samples): every step would "
            f"train on {len(data)}; pass {name} <= {len(data)}"
        )


def _warn_unused_batch_sizes(config: Any, distributed: bool) -> None:
    """One process splits the global batch (``batch_size``, which ``sum(batch_sizes)`` is) by
    device weights; ``batch_sizes``' split and ``balance`` are per rank (torchrun): a warning
    says so when they are set in one process."""
    if config.batch_sizes not in (None, "auto") and not distributed:  # "auto": planned
        warnings.warn(
            f"batch_sizes={config.batch_sizes} is ignored in one process: it sets each rank's "
            f"share under torchrun; here the global batch, batch_size={config.batch_size}, is "
            "split across device_ids by weights",
            UserWarning,
            stacklevel=3,
        )
    if config.balance != "none" and not distributed:
        warnings.warn(
            f"balance={config.balance!r} is ignored in one process: it moves samples between "
            "ranks under torchrun; here the split across device_ids is set by weights",
            UserWarning,
            stacklevel=3,
        )


def place_model(model: nn.Module, device: torch.device, where: str, *, say: bool = True) -> None:
    """Move ``model`` in place to ``device`` (``where`` names it for the line said on stderr
    when ``say``) unless every parameter and buffer already sits there.

    Between the CPU and a GPU the parameters stay the same objects (``nn.Module.to`` moves
    their data in place), so an optimizer built on them before keeps working.

    >>> net = nn.Linear(2, 2)
    >>> place_model(net, torch.device("meta"), "device_ids[0]", say=False)
    >>> net.weight.device
    device(type='meta')
    >>> place_model(net, torch.device("cpu"), "device_ids[0]")
    Traceback (most recent call last):
    ...
    evendp.InputError: the model's tensors are on the meta device ...
    """
    tensors = [*model.parameters(), *model.buffers()]
    away = sorted({str(t.device) for t in tensors if not _on(t.device, device)})
    if not away:
        return
    if "meta" in away:
        raise EvendpError(
            f"the model's tensors are on the meta device (shapes, no values), so there is "
            f"nothing to move to {device} ({where}); give it its weights first, e.g. "
            f"model.to_empty(device={str(device)!r}) then model.load_state_dict(...), or "
            "build it on a real device"
        )
    model.to(device)
    if say:
        print(
            f"evendp: the model was on {', '.join(away)}; moved it to {device} ({where})",
            file=sys.stderr,
            flush=True,
        )


def _on(device: torch.device, target: torch.device) -> bool:
    """Whether a tensor on ``device`` sits on ``target`` (``cuda`` is the current device)."""
    if device.type != target.type:
        return False
    if device.type != "cuda" or target.index is None:
        return True
    return device.index == target.index
