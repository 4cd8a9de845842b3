"""A finished Hugging Face run leaves nothing that can deadlock the process group's end.

Why: the Trainer's DDP wrapper holds the group, so whoever ends the run only unregisters it;
it is freed later, from Python with the GIL held, and gloo's destructor joins a worker that
waits for that GIL: the rank hangs. So at the end of every successful ``train()``, on every
rank, :func:`release_wrappers` drops the wrappers and settles the live group; an exit hook
ends a group nobody ended, skipping the barrier after an uncaught exception.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import evendp

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
        evendp.settle_group(collect=survived)


def _at_exit() -> None:
    if getattr(sys, "last_value", None) is None:  # an uncaught exception: no barrier
        evendp.finish_distributed()  # quiet when nobody started a group, or one was ended


def release_at_exit(trainer: Any) -> None:
    """:func:`release_wrappers` now; at exit, end the group if nobody ended it (once)."""
    release_wrappers(trainer)
    if not _REGISTERED:
        atexit.register(_at_exit)
    _REGISTERED.add(trainer)
