"""evendp: data-parallel training that uses every device's memory and speed to the full,
with the gradient a single huge device would compute on the whole batch.

The public API is what ``__all__`` lists; everything else lives in private modules.
"""

import importlib as _importlib
import sys as _sys
from typing import TYPE_CHECKING, Any

# `evendp --version` / `--help` answer here and exit, before anything below imports torch.
from .cli._fast import answer_without_torch as _answer_without_torch

if "_ON_DEMAND" not in globals():  # else a reload by __getattr__ below
    # In the evendp command the face (and torch) loads on first use: launching ranks,
    # argument errors and --help need neither. Every other importer gets it at once.
    _ON_DEMAND = _answer_without_torch()

if TYPE_CHECKING or not _ON_DEMAND:
    from ._core._cost import padded_cost, split_by_cost
    from ._core._counting import count_tokens, label_shift
    from ._core._errors import (
        CheckpointError,
        EvendpError,
        InputError,
        LiveMemoryError,
        NvmlUnavailableError,
        PlanError,
        TrainingError,
    )
    from ._core._exact import is_stand_in, share_loss
    from ._core._split import split_sizes
    from ._distributed._batch_plan import batch_sizes_from_env, parse_batch_sizes
    from ._distributed._collate import EmptySafeCollate
    from ._distributed._engine_mean import EngineMean, config_micro_batch
    from ._distributed._group import (
        ddp_loss,
        finish_distributed,
        global_count,
        global_mean,
        init_distributed,
        settle_group,
    )
    from ._distributed._sampler import UnevenBatchSampler
    from ._distributed._step_layout import StepLayout, layout_step
    from ._distributed._step_mean import StepMean
    from ._parallel._criterion import ParallelCriterion, Scattered, gather
    from ._parallel._dp import BalancedDataParallel
    from ._parallel._predict import Predictions, predict
    from ._planning._balance import planned_rank_sizes
    from ._planning._devices import DeviceInfo, list_devices, select_devices
    from ._planning._memory import DeviceMemory, live_memory, parse_memory
    from ._planning._planner import plan
    from ._planning._result import DevicePlan, Plan
    from ._planning._speed import SpeedBalancer, balance_sizes
    from ._training._checkpoint import load_checkpoint, save_checkpoint
    from ._training._loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger
    from ._training._oom import OomResplit
    from ._training._recorder import Callback
    from ._training._rehearse import rehearse
    from ._training._report import TrainReport
    from ._training._trainer import TrainConfig, Trainer

__all__ = [
    # single process
    "BalancedDataParallel",
    "ParallelCriterion",
    "Scattered",
    "gather",
    "split_sizes",
    "count_tokens",
    "label_shift",
    # cost (variable-length samples)
    "padded_cost",
    "split_by_cost",
    # inference
    "Predictions",
    "predict",
    # many processes
    "EngineMean",
    "config_micro_batch",
    "EmptySafeCollate",
    "UnevenBatchSampler",
    "batch_sizes_from_env",
    "ddp_loss",
    "finish_distributed",
    "global_count",
    "global_mean",
    "init_distributed",
    "settle_group",
    "parse_batch_sizes",
    "StepMean",
    "StepLayout",
    "layout_step",
    "is_stand_in",
    "share_loss",
    # planning
    "DeviceMemory",
    "DevicePlan",
    "Plan",
    "live_memory",
    "parse_memory",
    "plan",
    "planned_rank_sizes",
    # devices and speed
    "DeviceInfo",
    "SpeedBalancer",
    "balance_sizes",
    "list_devices",
    "select_devices",
    # training
    "OomResplit",
    "TrainConfig",
    "TrainReport",
    "Trainer",
    "load_checkpoint",
    "save_checkpoint",
    "rehearse",
    # callbacks and loggers
    "CSVLogger",
    "Callback",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    # errors
    "CheckpointError",
    "EvendpError",
    "InputError",
    "LiveMemoryError",
    "NvmlUnavailableError",
    "PlanError",
    "TrainingError",
]

__version__ = "0.1.0"


def _claim_public_names() -> None:
    """Report every public object as ``evendp.X``: tracebacks, reprs and doctests show the
    name users import (``evendp.EvendpError``), not the private module that defines it."""
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or callable(obj):
            obj.__module__ = __name__


def __getattr__(name: str) -> Any:
    """In the evendp command, the first public name asked for (by a user's ``--model``
    factory, say) loads the whole face: this file runs again, importing it."""
    if name not in __all__ or not _ON_DEMAND:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()["_ON_DEMAND"] = False
    _importlib.reload(_sys.modules[__name__])
    return globals()[name]


if not _ON_DEMAND:
    _claim_public_names()
