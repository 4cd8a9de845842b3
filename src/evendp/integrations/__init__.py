"""Adapters for the training stacks people already use (optional extras).

* :mod:`evendp.integrations.transformers`: ``UnevenTrainer``, a Hugging Face ``Trainer``
  whose ranks each take their own batch size (``pip install evendp[hf]``).
* :mod:`evendp.integrations.accelerate`: ``uneven_dataloader``, an Accelerate-prepared
  dataloader giving rank ``r`` batches of ``batch_sizes[r]`` samples (``evendp[hf]``).
* :mod:`evendp.integrations.lightning`: ``UnevenGradient``, a Lightning callback that makes
  the accumulated, DDP-averaged gradient the global-batch mean (``evendp[lightning]``).
* :mod:`evendp.integrations.deepspeed`: DeepSpeed ZeRO 1-3 on each of those paths and in a
  ``deepspeed.initialize`` loop (:class:`evendp.EngineMean`) (``evendp[deepspeed]``).

Importing this package imports none of those libraries; each submodule imports its own.
"""

__all__: list[str] = []
