"""The contract of a strategy: every decision that differs between ways of running a step,
from wrapping the model to the gradients' reduction; the update is the stepper's it builds."""

from __future__ import annotations

import abc
import contextlib
import signal
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..._core._errors import EvendpError
from ..._distributed._sampler import UnevenBatchSampler
from ..._distributed._step_count import StepWeight
from .._checkpointer import CheckpointFormat, WholeFile
from .._evaluate import EvalFn
from .._oom import OomResplit
from .._optimizer_step import OptimizerStep, default_optimizer, run_schedule
from .._stepper import Stepper

__all__ = ["StopSource", "Strategy"]

Batch = Any
Costs = Sequence[float] | Callable[[Any], float] | None
#: This process's pending stop request: a signal number, or ``None``.
StopSource = Callable[[], "int | None"]


def _no_stop() -> int | None:
    return None


class Strategy(abc.ABC):
    """How one training step runs: the Trainer calls these, in this order, whatever the mode.

    Setup: :meth:`wrap` the loss module, build the :meth:`sampler` (and :meth:`device_costs`
    for a cost plan inside this process), the :meth:`guard` for OOM re-splits,
    :meth:`check_optimizer` and :meth:`build_stepper` (the
    :class:`~evendp._training._stepper.Stepper` the Trainer calls). Each step (the Trainer's
    loop)::

        batch = strategy.place(batch); shares = strategy.shares(n)
        weight = strategy.count_weight(count)          # or known: samples, counts=
        strategy.start_step(); stepper.zero_grad()
        for k, spans in enumerate(plan):               # guard.plan + micro_step_count padding
            with strategy.sync(last=k == len(plan) - 1):
                summed = strategy.forward(rows, sizes)
            strategy.backward(stepper, summed * weight)
        strategy.reduce_gradients(failed, total)       # what backward did not reduce
        failed, total = strategy.agree_step(failed, total)   # step or skip everywhere
        strategy.apply_gradients()                     # the reduced gradients into .grad
        skipped = stepper.step(step)                   # unscale, clip, gate, step
        ... strategy.agree_stop(step)                  # between steps

    Losses and samples are summed over processes by :meth:`reduce_losses` and
    :meth:`reduce_samples` when read. Also evaluation (:meth:`evaluate`), the checkpoint's
    on-disk format (:attr:`checkpoint_format`, in which the Trainer's checkpointer writes the
    run's parts), the report's device names and peak memory.

    Subclasses: :class:`~evendp._training._strategies.BalancedDP` (one process) and the
    one-rank-per-device strategies of
    :class:`~evendp._training._strategies._ranks.RankStrategy`; the registry
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

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device: torch.device = next(model.parameters()).device
        self.rank, self.world = 0, 1
        #: The module a step runs (the loss module, wrapped): set by :meth:`wrap`.
        self.wrapped: nn.Module = model
        self.device_names: list[str] = []
        self._stop_source: StopSource = _no_stop

    # -- setup -------------------------------------------------------------------------------

    @abc.abstractmethod
    def wrap(self, loss_module: nn.Module) -> None:
        """Prepare ``loss_module`` (the model with its loss inside forward) for this strategy.

        ``loss_module(*batch)`` returns the loss of its rows *summed* over their counted items.
        """

    @property
    def devices(self) -> list[torch.device]:
        """The devices this process runs on."""
        return [self.device]

    @abc.abstractmethod
    def sampler(
        self,
        data: Any,
        config: Any,
        *,
        costs: Costs,
        max_costs: Sequence[float] | None,
        max_tokens: float | None,
        model: Callable[[], nn.Module],
        example: Callable[[], Any],
    ) -> tuple[UnevenBatchSampler, Any]:
        """The sampler of this process's samples of each step (split by cost where it is),
        and the balancer the loop calls at step boundaries (``config.balance``).

        ``model()`` and ``example()`` (the loss module and one batch) are for planning
        ``batch_sizes="auto"``; ``config`` is the :class:`~evendp.TrainConfig`.
        """

    def device_costs(
        self, costs: Costs, max_costs: Sequence[float] | None
    ) -> tuple[Costs, Sequence[float] | None]:
        """The costs (and caps) that order a step's rows over this process's devices
        (``None``: none, the sampler already split the step by cost)."""
        return None, None

    def guard(self, oom_resplit: bool) -> OomResplit:
        """The OOM re-split of a step's shares (``oom_resplit=False``: an OOM propagates)."""
        return OomResplit(catch=oom_resplit, devices=len(self.shares(0)))

    def check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Refuse an optimizer this strategy cannot use (one built before sharding)."""
        return None

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
        schedule (:class:`~evendp._training._optimizer_step.OptimizerStep`). ``where`` names
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

    @abc.abstractmethod
    def run_lock(self, out_dir: Any) -> contextlib.AbstractContextManager[Any]:
        """The run's hold on ``out_dir`` for the life of ``fit`` (one writer per run folder):
        one process always takes it; ranks join their launcher's
        (:mod:`evendp._distributed._run_lock`)."""

    def watch_stop(self, source: StopSource) -> None:
        """Where :meth:`agree_stop` (and a consensus riding on a step) reads this process's
        stop request: the Trainer's signal flag."""
        self._stop_source = source

    # -- one step ----------------------------------------------------------------------------

    @abc.abstractmethod
    def place(self, batch: Batch) -> Batch:
        """The batch where this strategy's forward reads it."""

    @abc.abstractmethod
    def shares(self, n: int) -> list[int]:
        """This process's per-device shares of a step of ``n`` local samples."""

    @abc.abstractmethod
    def ran(self, rows: list[int]) -> list[int]:
        """Per device of the report, the samples a micro-step of ``rows`` ran."""

    @abc.abstractmethod
    def count_weight(self, local: torch.Tensor) -> StepWeight:
        """``world / the step's counted items over every process``, from this process's
        ``count_fn`` count ``local`` (float64, 0-dim), before the first backward.

        (The samples, or per-sample counts, are known everywhere: the Trainer needs no
        strategy for those.)
        """

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-step's forward and backward (gradient sync on ``last``)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        """The micro-step's loss summed over its counted items (``rows[i]`` rows on device i)."""

    def micro_step_count(self, planned: int) -> int:
        """How many micro-steps this process runs when its shares need ``planned``."""
        return planned

    def start_step(self) -> None:
        """Before a step's first micro-step, on every process whatever its share."""
        return None

    def backward(self, stepper: Stepper, loss: torch.Tensor) -> None:
        """The stepper's backward of one micro-step's loss (weighted by the step's weight),
        with what this strategy runs around it."""
        stepper.backward(loss)

    def reduce_gradients(self, failed: bool, total: torch.Tensor | None) -> None:
        """After a step's micro-steps, on every process whatever happened (``failed``: an OOM
        left nothing to run here): the gradient reduction backward did not finish (DDP and
        FSDP2 reduce inside it; one process has nothing to reduce)."""
        return None

    def agree_step(
        self, failed: bool, total: torch.Tensor | None
    ) -> tuple[bool, torch.Tensor | None]:
        """After :meth:`reduce_gradients`: whether every process skips the step, and its total."""
        return failed, total

    def apply_gradients(self) -> None:
        """Once every process agreed to step: make ``.grad`` the step's reduced gradients."""
        return None

    # -- what the loop reads -----------------------------------------------------------------

    @abc.abstractmethod
    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        """The step losses from ``parts`` ((steps,) this process's parts): one collective."""

    @abc.abstractmethod
    def reduce_samples(self, samples: list[int]) -> list[int]:
        """Per device of the report, the samples trained, from this process's counts."""

    @abc.abstractmethod
    def agree_stop(self, step: int, *, starting: bool = False) -> int | None:
        """The stop signal every process stops with, the same on every process, or ``None``,
        with ``step`` steps done (``starting``: before this run's first step)."""

    @abc.abstractmethod
    def interrupted(self, error: KeyboardInterrupt) -> int:
        """A ``KeyboardInterrupt`` that no signal flag caught: the signal to stop with, or
        re-raise it where the other processes could not agree on it."""

    @abc.abstractmethod
    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        eval_fn: EvalFn,
        *,
        batch_sizes: list[int],
        collate: Callable[[list[int]], Batch],
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> dict[str, float]:
        """Every sample of ``data`` once over all devices and processes: ``{name: value}``."""

    @abc.abstractmethod
    def peak_memory(self) -> list[int | None]:
        """Per device of the report, its GPU's peak reserved bytes (``None``: not a GPU, or
        another rank's); replicas on one GPU each give that GPU's one figure."""


def build_sampler(
    data: Any,
    config: Any,
    *,
    requested: Any,
    rank: int,
    world: int,
    distributed: bool,
    costs: Costs,
    max_costs: Sequence[float] | None,
    max_tokens: float | None,
    model: Callable[[], nn.Module],
    example: Callable[[], Any],
) -> tuple[UnevenBatchSampler, Any]:
    """The sampler and balancer for ``world`` processes asking for ``requested`` sizes (the
    shared body of every strategy's :meth:`Strategy.sampler`)."""
    from ..._distributed._batch_plan import BatchPlan
    from ..._distributed._plan_agreement import agreed_plan
    from ..._planning._balance import rank_batch_plan, step_balancer

    def plan_it() -> Any:
        # Ranks: the sizes a launcher left (evendp launch), unless the config gives its own.
        launched = BatchPlan.from_env(world) if distributed else None
        return rank_batch_plan(
            requested, config.batch_size, world, model=model, example=example, launched=launched
        )

    # Ranks: one plan on every rank, or every rank stops (two nodes given other sizes).
    plan = agreed_plan(plan_it, world) if distributed and world > 1 else plan_it()
    sampler = UnevenBatchSampler(
        data, list(plan.sizes), rank=rank, world_size=world, seed=config.seed, costs=costs,
        max_costs=max_costs, max_tokens=max_tokens,
    )  # fmt: skip
    # balance="speed": at step boundaries samples move from slow ranks to fast ones.
    caps = None if plan.caps is None else list(plan.caps)
    balancer = step_balancer(
        sampler.batch_sizes, config.balance, distributed=distributed, caps=caps,
        apply=sampler.set_batch_sizes,  # a new split, a resumed one too, from the next step
    )  # fmt: skip
    _validate_batch_fits(data, sampler.batch_sizes, distributed)
    _warn_unused_batch_sizes(config, distributed)
    return sampler, balancer


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


def stop_votes(signum: int | None, device: torch.device) -> torch.Tensor:
    """``[this rank saw SIGINT, this rank saw SIGTERM]``: summed over ranks, never ambiguous."""
    return torch.tensor(
        [float(signum == signal.SIGINT), float(signum == signal.SIGTERM)], device=device
    )


def agreed_signal(votes: torch.Tensor) -> int | None:
    """The signal the summed ``votes`` agree on (SIGINT wins when both came)."""
    return signal_of(*(float(v) for v in votes.tolist()))


def signal_of(sigint: float, sigterm: float) -> int | None:
    """The signal of summed votes already read (SIGINT wins when both came).

    >>> signal_of(0.0, 2.0) == signal.SIGTERM, signal_of(0.0, 0.0)
    (True, None)
    """
    if sigint > 0:
        return int(signal.SIGINT)
    return int(signal.SIGTERM) if sigterm > 0 else None
