"""A finished Hugging Face run leaves nothing that can deadlock the process group's end.

Why: the ``DistributedDataParallel`` wrapper the Trainer keeps (``model_wrapped``, and the
accelerator's ``_models``) holds the default group. Whoever ends the run (``trainer.end()``,
which TRL's scripts call, ``accelerator.end_training()``, the user's
``destroy_process_group()``, or nobody) then only unregisters the group: it is freed later,
when the wrapper goes, from Python with the GIL held. Gloo's destructor joins its worker
threads there, and a worker still dropping a collective's tensors waits for that GIL: the rank
hangs after a run that trained all its steps (or, during interpreter finalization, aborts with
"terminate called without an active exception"). A race, rare on an idle machine and frequent
on a loaded one; one patch per framework's ending would only move it.

The root: no wrapper may outlive the run while holding the group. So at the end of every
successful ``train()``, on every rank (they all reach it together), :func:`release_wrappers`
drops the trainer's DDP wrappers and settles the group while it is alive (reference cycles
collected, a barrier, a pause with the GIL released so the workers drop what they hold, and the
group unbound from DeepSpeed's method defaults, which capture it when Accelerate's
``unwrap_model`` first imports DeepSpeed, installed even if unused, inside the Trainer). From
then on the group is held by its registry alone, and any ending frees it where ending it is
safe. An exit hook ends a group that nobody ended, as :func:`evendp.finish_distributed` does,
before finalization starts; it never touches a group someone else destroyed. A process
exiting on an uncaught exception skips the hook's barrier (its peers may never reach it).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import evendp

from .._distributed._group import settle_group

__all__ = ["release_at_exit", "release_wrappers"]

_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def release_wrappers(trainer: Any) -> None:
    """Drop ``trainer``'s DDP wrappers of its model and settle the live group (every rank).

    The Trainer wraps the model again when it next trains. Safe to call twice and without
    a group (then only the wrappers go).
    """
    dropped: list[weakref.ref[DistributedDataParallel]] = []
    if isinstance(trainer.model_wrapped, DistributedDataParallel):
        dropped.append(weakref.ref(trainer.model_wrapped))
        trainer.model_wrapped = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:  # its prepared models: the same wrapper
        kept = [m for m in accelerator._models if not isinstance(m, DistributedDataParallel)]
        dropped += [weakref.ref(m) for m in accelerator._models if m not in kept]
        accelerator._models = kept
    if dist.is_available() and dist.is_initialized():
        # A full collection costs ~0.3-0.6 s with transformers loaded (issue 37: most of
        # UnevenTrainer.train()'s extra time): run it only when a dropped wrapper outlived
        # its last reference here, i.e. sits in a cycle. (The Trainer's own start collects
        # what earlier runs left.)
        survived = any(ref() is not None for ref in dropped)
        settle_group(collect=survived)


def _at_exit() -> None:
    failing = getattr(sys, "last_value", None) is not None  # an uncaught exception: no barrier
    if not failing and dist.is_available() and dist.is_initialized():
        evendp.finish_distributed()


def release_at_exit(trainer: Any) -> None:
    """:func:`release_wrappers` now; at exit, end the group if nobody ended it (once)."""
    release_wrappers(trainer)
    if not _REGISTERED:
        atexit.register(_at_exit)
    _REGISTERED.add(trainer)
