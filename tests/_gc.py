"""The garbage collector in long-lived test processes (pytest's workers, the pool's ranks).

They hold the objects of torch, transformers, DeepSpeed and hypothesis: hundreds of thousands
of long-lived objects that every full collection walks again, the automatic ones and the
Trainer's ``gc.collect()`` after each simulated OOM (a quarter of a worker's time, measured
with ``gc.callbacks``). Frozen once they are known to live on (``gc.freeze``), collections
walk only what came after; refcounting still frees frozen objects, only frozen cycles stay.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_survivors"]


def freeze_survivors() -> None:
    """Collect what is garbage now, then leave everything alive out of later collections.

    >>> freeze_survivors(); gc.get_freeze_count() > 0
    True
    """
    gc.collect()
    gc.freeze()
