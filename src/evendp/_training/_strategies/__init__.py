"""How one training step runs: one strategy object per way, so the Trainer's loop has no modes.

A strategy (:class:`~._base.Strategy`, the abstract contract) owns everything that differs
between running a step in one process on several devices (``_balanced_dp.BalancedDP``) and
running it across ranks (``_ddp``: ``DDP``, ``OomSafeDDP``; ``_fsdp2``, ``_zero1``,
``_deepspeed``): the capabilities :func:`~evendp._training._step.train_step` calls, the stepper it
builds, evaluation, the sampler's split and the checkpoint format. :func:`pick_strategy`
chooses from the registry (:data:`STRATEGIES` in ``_registry.py``), the one list of names
that ``TrainConfig``, the command line and the docs read.
"""

from __future__ import annotations

# Only the registry here: each strategy's module (and torch) loads when a run picks it, so
# the command line's launcher reads the names without importing torch.
from ._registry import (
    STRATEGIES,
    StrategyEntry,
    pick_strategy,
    rank_strategy_names,
    strategy_names,
)

__all__ = ["STRATEGIES", "StrategyEntry", "pick_strategy", "rank_strategy_names", "strategy_names"]
