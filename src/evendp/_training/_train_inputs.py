"""What a :class:`~evendp.Trainer` run accepts, checked when it is built, never deep in ``fit``.

``TrainConfig.__post_init__`` calls :func:`validate_config`; ``Trainer.__init__`` calls
:func:`validate_trainer_args` (before anything is wrapped); the strategies check the step
against the dataset once the per-rank sizes are known (``_strategies._base``), the checkpoint
functions their own arguments (``_checkpoint``). In the loop, :func:`checked_loss` and
:func:`validate_count` (from :mod:`evendp._core._validate`) check what user functions return.
Each refusal is an :class:`EvendpError` naming the argument, what it got and what it takes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._core._amp import AMP_MODES
from .._core._defaults import NotGiven
from .._core._errors import EvendpError
from .._core._validate import (
    validate_bool,
    validate_callable,
    validate_choice,
    validate_float,
    validate_instance,
    validate_int,
    validate_numbers,
    validate_path,
)
from .._distributed._batch_plan import validate_batch_sizes_option
from .._planning._balance import validate_balance

__all__ = [
    "checked_loss",
    "validate_config",
    "validate_trainer_args",
]

_FLAGS = ("activation_checkpointing", "oom_resplit", "resume", "progress")


def validate_config(config: Any) -> None:
    """Every field of a ``TrainConfig``: types, ranges, and the fields that need each other."""
    for name in ("steps", "batch_size", "accum"):
        validate_int(name, getattr(config, name), minimum=1, example=f"{name}=8")
    validate_int("warmup_steps", config.warmup_steps, minimum=0, example="warmup_steps=100")
    # "auto": planned per rank at start (evendp._planning._balance); a list: the plan's check
    validate_batch_sizes_option(config.batch_sizes)
    validate_float("lr", config.lr, minimum=0, example="lr=3e-4")
    validate_float("weight_decay", config.weight_decay, minimum=0, example="weight_decay=0.1")
    validate_float(
        "grad_clip", config.grad_clip, positive=True, allow_none=True,
        example="grad_clip=1.0 (None: no clipping)",
    )  # fmt: skip
    validate_choice("amp", config.amp, AMP_MODES)
    from ._strategies import strategy_names  # the registry: the one list of names

    validate_choice("strategy", config.strategy, strategy_names())
    for name in _FLAGS:
        validate_bool(name, getattr(config, name))
    validate_path("out_dir", config.out_dir, allow_none=True)
    _validate_strategy_config(config)
    validate_int(
        "checkpoint_every", config.checkpoint_every, minimum=0,
        example="checkpoint_every=100 (0: only at the end)",
    )  # fmt: skip
    validate_int("seed", config.seed, example="seed=0")
    validate_int("prefetch", config.prefetch, minimum=0, allow_none=True, example="prefetch=2")
    validate_int("eval_every", config.eval_every, minimum=0, example="eval_every=100")
    validate_int("log_every", config.log_every, minimum=1, example="log_every=10")
    validate_balance(config.balance)
    validate_int(
        "max_nonfinite_steps", config.max_nonfinite_steps, minimum=0,
        example="max_nonfinite_steps=3 (0: no check)",
    )  # fmt: skip
    validate_float(
        "comm_timeout", config.comm_timeout, positive=True, allow_none=True,
        example="comm_timeout=600 (seconds; None: the process group's own)",
    )  # fmt: skip
    # The default checkpoint_every saves where there is a folder; a given one needs it.
    given_every = config.checkpoint_every and not isinstance(config.checkpoint_every, NotGiven)
    if (config.resume or given_every) and config.out_dir is None:
        raise EvendpError("resume and checkpoint_every need out_dir, where checkpoints live")


def _validate_strategy_config(config: Any) -> None:
    from ._strategies import STRATEGIES

    if config.strategy_config is not None and not STRATEGIES[config.strategy].takes_config:
        raise EvendpError(
            f"strategy={config.strategy!r} reads no strategy_config; pass strategy_config=None"
            ", or a strategy that reads one: "
            + (", ".join(repr(n) for n, e in STRATEGIES.items() if e.takes_config) or "none yet")
        )
    if not isinstance(config.strategy_config, (Mapping, str, os.PathLike, type(None))):
        raise EvendpError(
            f"strategy_config must be a dict or a JSON file's path, got "
            f"{type(config.strategy_config).__name__}; e.g. strategy='deepspeed', "
            'strategy_config={"zero_optimization": {"stage": 2}}'
        )


def validate_trainer_args(
    model: Any,
    data: Any,
    config: Any,
    config_type: type,
    *,
    loss_fn: Any,
    count_fn: Any,
    optimizer: Any,
    scheduler: Any,
    eval_data: Any,
    eval_fn: Any,
    device_ids: Any,
    weights: Any,
    collate_fn: Any,
    costs: Any,
    max_costs: Any,
    counts: Any,
) -> None:
    """The arguments of ``Trainer(...)`` before any of them is used."""
    validate_instance("model", model, nn.Module, "an nn.Module (the network to train)")
    if next(iter(model.parameters()), None) is None:
        raise EvendpError(
            f"model ({type(model).__name__}) has no parameters to train; pass the network "
            "whose weights the optimizer should update"
        )
    if not isinstance(config, config_type):
        hint = "; e.g. TrainConfig(**that_dict)" if isinstance(config, dict) else ""
        raise EvendpError(f"config must be a TrainConfig, got {type(config).__name__}{hint}")
    _validate_dataset("data", data)
    if eval_data is not None:
        _validate_dataset("eval_data", eval_data)
    validate_callable("loss_fn", loss_fn, "a function (model, batch) -> mean loss")
    validate_callable("count_fn", count_fn, "a function batch -> counted items", allow_none=True)
    validate_callable("eval_fn", eval_fn, "a function (model, batch) -> metrics", allow_none=True)
    validate_instance(
        "optimizer", optimizer, torch.optim.Optimizer,
        "a torch.optim.Optimizer built on the model's parameters (None: AdamW)", allow_none=True,
    )  # fmt: skip
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise EvendpError(
            f"scheduler must have a step() method (a torch.optim.lr_scheduler), got {scheduler!r}"
        )
    warmup = getattr(config, "warmup_steps", 0)  # a TrainConfig by now (mypy: an object)
    if scheduler is not None and warmup:
        raise EvendpError(
            f"warmup_steps={warmup} builds the run's learning-rate schedule, but "
            "scheduler= was given too; put the warmup in your scheduler (e.g. "
            "torch.optim.lr_scheduler.LinearLR) or pass warmup_steps=0"
        )
    if device_ids is not None and (
        isinstance(device_ids, str | bytes) or not isinstance(device_ids, Sequence)
    ):
        raise EvendpError(
            f"device_ids must be a list of devices, got {device_ids!r}; e.g. "
            "device_ids=['cuda:0', 'cuda:1'] or ['cpu', 'cpu']"
        )
    if weights != "auto":  # "auto": planned for the devices' memory, as batch_sizes="auto"
        validate_numbers(
            "weights", weights, allow_none=True, example="weights=[2, 1] or weights='auto'"
        )
    if collate_fn is not None and not callable(collate_fn):
        raise EvendpError(
            f"collate_fn must be a function samples -> batch, got {collate_fn!r}; e.g. "
            "collate_fn=CodeParagraphs.collate of a padded dataset"
        )
    if max_costs is not None and costs is None:
        raise EvendpError("max_costs caps each device's cost, but costs=None; pass costs=")
    if counts is not None and count_fn is None:
        raise EvendpError("counts gives each sample's count_fn count, but count_fn=None")


def _validate_dataset(name: str, data: Any) -> None:
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")) or isinstance(
        data, str | bytes | torch.Tensor
    ):
        raise EvendpError(
            f"{name} must be a map-style dataset (len(data) and data[i]), got {type(data).__name__}"
        )


def checked_loss(loss: Any) -> torch.Tensor:
    """``loss_fn``'s answer when it is one number as a tensor (the batch's mean loss)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
        raise EvendpError(
            f"loss_fn must return the batch's mean loss as a 0-dim tensor, got {got}; reduce "
            "it, e.g. cross_entropy(..., reduction='mean') or loss.mean()"
        )
    return loss
