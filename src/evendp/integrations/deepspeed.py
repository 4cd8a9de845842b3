"""DeepSpeed ZeRO (stages 1, 2 and 3) with per-rank batch sizes, on the three paths users take.

* Hugging Face ``Trainer`` with ``deepspeed=`` (``--deepspeed ds_config.json``, ``"auto"``
  values welcome): :class:`evendp.integrations.transformers.UnevenTrainer` as it is. Its loss
  is already the global mean's share times the world size (``ddp_loss``) and the Trainer
  passes ``scale_wrt_gas=False`` to ``engine.backward``, so DeepSpeed's averaging over the
  ranks leaves exactly the global-batch gradient; ``"auto"`` fills the micro-batch size from
  ``per_device_train_batch_size`` (a figure DeepSpeed only logs).
* Accelerate with a ``DeepSpeedPlugin``:
  :class:`evendp.integrations.accelerate.UnevenAccelerator` and ``uneven_dataloader``; under
  DeepSpeed its ``backward`` weights the batch by its share of the whole step and passes
  ``scale_wrt_gas=False``, and ``uneven_dataloader`` fills an ``"auto"``
  ``train_micro_batch_size_per_gpu`` (Accelerate reads it from the loader's ``batch_size``,
  which an uneven loader does not have) with :func:`config_micro_batch`.
* A hand-written ``deepspeed.initialize`` loop: :class:`evendp.EngineMean`.

The scaling rule is written once, in ``evendp._core._exact.averaged_scale``. With ZeRO-3,
``transformers`` builds a model from a config or a checkpoint inside ``deepspeed.zero.Init``
once ``TrainingArguments(deepspeed=...)`` exists: build the model after the process group is
up (``TrainingArguments`` starts it under ``torchrun``/``evendp launch``), never before.
Importing this module imports no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._distributed._engine_mean import config_micro_batch

__all__ = ["config_micro_batch", "fill_auto_micro_batch"]


def fill_auto_micro_batch(accelerator: Any, batch_sizes: Sequence[int]) -> None:
    """Under Accelerate's DeepSpeed, an ``"auto"`` micro-batch size becomes
    :func:`config_micro_batch`; otherwise nothing changes.

    >>> from accelerate import Accelerator
    >>> fill_auto_micro_batch(Accelerator(cpu=True), [1, 3])  # not DeepSpeed: no change
    """
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if plugin is None or not plugin.is_auto("train_micro_batch_size_per_gpu"):
        return
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = config_micro_batch(batch_sizes)
