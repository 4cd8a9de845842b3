"""DeepSpeed ZeRO (stages 1-3) with per-rank batch sizes: ``UnevenTrainer(deepspeed=...)`` as
it is; Accelerate's plugin with ``UnevenAccelerator`` and ``uneven_dataloader``, which fills
an ``"auto"`` micro-batch size (Accelerate reads it from a ``batch_size`` an uneven loader
lacks); a ``deepspeed.initialize`` loop with :class:`evendp.EngineMean`. Imports no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import evendp

__all__ = ["fill_auto_micro_batch"]


def fill_auto_micro_batch(accelerator: Any, batch_sizes: Sequence[int]) -> None:
    """Under Accelerate's DeepSpeed, an ``"auto"`` micro-batch size becomes
    :func:`evendp.config_micro_batch`; otherwise nothing changes.

    >>> from accelerate import Accelerator
    >>> fill_auto_micro_batch(Accelerator(cpu=True), [1, 3])  # not DeepSpeed: no change
    """
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if plugin is None or not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return
    micro = evendp.config_micro_batch(batch_sizes)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
