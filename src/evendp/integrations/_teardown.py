"""The process group of a finished Hugging Face run, freed while the interpreter is still whole.

Why: ``TrainingArguments`` (through Accelerate) starts the default process group and nothing
ever ends it; the ``DistributedDataParallel`` wrapper the Trainer keeps (``model_wrapped``,
and the accelerator's ``_models``) holds it in its ``process_group`` attribute, so even
``destroy_process_group()`` cannot free it. It is then freed during interpreter finalization,
when the Python objects go. Gloo's worker threads drop the last collective's tensors there,
which needs the GIL; a thread that asks for the GIL while Python finalizes is ended with
``pthread_exit``, whose unwinding through C++ aborts the process ("terminate called without an
active exception", exit -6) after a run that trained all its steps. A race, so rare on an idle
machine and frequent on a loaded one.

So after a successful ``train()`` an exit hook (``atexit`` runs before finalization) drops the
trainer's wrappers and ends the group as :func:`evendp.finish_distributed` does (every rank
done, gloo's workers idle, then the destroy), and collects it: the group is gone before
finalization starts. A process that is exiting on an uncaught exception skips the barrier (its
peers may never reach it); the run failed anyway.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Any

import torch.distributed as dist

from .._distributed._group import finish_distributed

__all__ = ["release_at_exit", "release_process_group"]

_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def release_process_group(trainer: Any) -> None:
    """Drop ``trainer``'s wrappers of the model, end the default group and free it now.

    Safe to call twice and without a group (then only the wrappers go).
    """
    trainer.model_wrapped = trainer.model  # the DDP wrapper holds the group
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.free_memory()  # its prepared models (the same wrapper), optimizers, loaders
    if dist.is_available() and dist.is_initialized():
        finish_distributed()
    gc.collect()  # wrapper cycles (DDP hooks) go now, with the group they hold


def _at_exit(ref: weakref.ref[Any]) -> None:
    trainer = ref()
    failing = getattr(sys, "last_value", None) is not None  # an uncaught exception: no barrier
    if trainer is None or failing:
        return
    release_process_group(trainer)


def release_at_exit(trainer: Any) -> None:
    """Free the process group ``trainer`` holds before interpreter finalization (once each)."""
    if trainer in _REGISTERED:
        return
    _REGISTERED.add(trainer)
    atexit.register(_at_exit, weakref.ref(trainer))
