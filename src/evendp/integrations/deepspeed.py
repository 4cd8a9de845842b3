"""DeepSpeed ZeRO (stages 1-3) with per-rank batch sizes, on the three paths users take.

``UnevenTrainer(deepspeed=...)`` works as it is; Accelerate's ``DeepSpeedPlugin`` takes
``UnevenAccelerator`` and ``uneven_dataloader``, which fills an ``"auto"``
``train_micro_batch_size_per_gpu`` (Accelerate reads it from a ``batch_size`` an uneven
loader lacks); a hand-written ``deepspeed.initialize`` loop takes :class:`evendp.EngineMean`.
With ZeRO-3, build the model after the process group is up (see docs/integrations.md).
Importing this module imports no DeepSpeed.
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
