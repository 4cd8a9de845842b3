"""How one training step runs: one strategy object per way, so the Trainer's loop has no modes.

A strategy (:class:`Strategy`, the abstract contract) owns everything that differs between
running a step in one process on several devices and running it across ranks: wrapping,
this process's shares and their placement, gradient sync on the last micro-batch, what runs
around a micro-step (``micro_step``), the gradients' reduction (``finish_step``: reduce, agree
to step or skip, use; one call that returns what was agreed), the stop agreement, the loss
and sample-count reductions, evaluation, how the sampler splits by cost, and the checkpoint
format. It builds the run's stepper (:meth:`Strategy.build_stepper`, a
:class:`~evendp._training._step.Stepper`: backward and the update, with the scaler,
clipping, the non-finite gate and the schedule of
:class:`~evendp._training._step.OptimizerStep`, or DeepSpeed's engine), which the
Trainer calls itself.

=============================  ===========================================================
:class:`BalancedDP`            one process, :class:`BalancedDataParallel` over its devices
:class:`DDP`                   ``oom_resplit=False``: torch's DistributedDataParallel, with
                               its overlap of all-reduce and backward (``no_sync`` until the
                               last micro-batch); an OOM on one rank is fatal, as in torch
:class:`OomSafeDDP`            the default under torchrun: local backward, then the
                               gradients all-reduced in place in buckets with the OOM flag
                               and the loss riding in the last one, so an OOM on any rank
                               never hangs another
:class:`FSDP2`                 ``fully_shard``; reduce-scatter on the last micro-batch only
=============================  ===========================================================

:func:`pick_strategy` is the one place that chooses, from the registry
(:data:`STRATEGIES` in ``_registry.py``), the one list of names that ``TrainConfig``, the
command line and the docs read. The classes live in their modules (``_ddp.DDP``, ...).
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
