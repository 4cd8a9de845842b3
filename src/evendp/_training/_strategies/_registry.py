"""The one list of ways to run a step: names -> strategies, read by TrainConfig, the CLI, the docs.

Each entry names a module and a builder, imported only when a run picks it, so listing the
names (``TrainConfig``'s check, ``evendp train --mode``'s choices) imports no optional package.
A new strategy is one file in this folder plus one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._checkpoint_names import DCP_SHARDS, DEEPSPEED_FILES, WHOLE_FILE

if TYPE_CHECKING:  # the names are read without torch (evendp train's launcher)
    import torch
    from torch import nn

    from ._base import Strategy

    DeviceIds = list[str | int | torch.device] | None

__all__ = [
    "STRATEGIES",
    "StrategyEntry",
    "pick_strategy",
    "rank_strategy_names",
    "strategy_names",
]


@dataclass(frozen=True)
class StrategyEntry:
    """One way to run a step: ``build(model, config, device_ids, weights)`` in ``module``."""

    name: str
    module: str  # relative to this package
    builder: str  # a function (model, config, device_ids, weights) -> Strategy
    summary: str  # one line for --help and the docs
    ranks: bool = True  # one process per device under torchrun
    checkpoint_name: str = WHOLE_FILE  # in out_dir: the format's name (_checkpoint_names)
    takes_config: bool = False  # reads TrainConfig.strategy_config
    config_check: str | None = None  # a function (strategy_config) -> None that refuses one
    plans_memory: bool = False  # evendp train --memory: the planner models its memory
    # Every rank writes part of the checkpoint (else rank 0 writes it whole, and the ranks of
    # other machines receive it at a resume): several machines need one shared --out.
    checkpoint_spread: bool = False

    def build(
        self,
        model: nn.Module,
        config: Any,
        device_ids: DeviceIds,
        weights: list[float] | Literal["auto"] | None,
    ) -> Strategy:
        module = importlib.import_module(self.module, __package__)
        built: Strategy = getattr(module, self.builder)(model, config, device_ids, weights)
        return built

    def check_config(self, given: Any) -> None:
        """Refuse a ``strategy_config`` this strategy would refuse, before any process starts
        (an :class:`~evendp.EvendpError`); nothing to check without a ``config_check``."""
        if self.config_check is not None:
            module = importlib.import_module(self.module, __package__)
            getattr(module, self.config_check)(given)


STRATEGIES: dict[str, StrategyEntry] = {
    entry.name: entry
    for entry in (
        StrategyEntry(
            "dp",
            "._balanced_dp",
            "build",
            "one process, BalancedDataParallel over its devices",
            ranks=False,
            plans_memory=True,
        ),
        StrategyEntry(
            "ddp",
            "._ddp",
            "build",
            "one process per device; oom_resplit=True (the default): "
            "OOM-safe local backward, then a bucketed all-reduce; False: torch's DDP",
            plans_memory=True,
        ),
        StrategyEntry(
            "fsdp2",
            "._fsdp2",
            "build",
            "one process per device, fully_shard per repeated "
            f"block; sharded checkpoints in OUT/{DCP_SHARDS}",
            checkpoint_name=DCP_SHARDS,
            checkpoint_spread=True,
        ),
        StrategyEntry(
            "zero1",
            "._zero1",
            "build",
            "one process per device, OOM-safe DDP with AdamW's state sharded over the ranks "
            "(torch's ZeroRedundancyOptimizer: ZeRO stage 1)",
        ),
        StrategyEntry(
            "deepspeed",
            "._deepspeed",
            "build",
            "one process per device, a DeepSpeed ZeRO engine (stage from "
            f"--strategy-config, default 2); checkpoints in OUT/{DEEPSPEED_FILES}",
            checkpoint_name=DEEPSPEED_FILES,
            checkpoint_spread=True,
            takes_config=True,
            config_check="check_strategy_config",
        ),
    )
}


def strategy_names() -> tuple[str, ...]:
    """Every strategy's name: ``TrainConfig.strategy``'s and ``evendp train --mode``'s choices.

    >>> strategy_names()[:3]
    ('dp', 'ddp', 'fsdp2')
    """
    return tuple(STRATEGIES)


def rank_strategy_names() -> tuple[str, ...]:
    """The strategies for ranks under torchrun (one process per device).

    >>> rank_strategy_names()[:2]
    ('ddp', 'fsdp2')
    """
    return tuple(name for name, entry in STRATEGIES.items() if entry.ranks)


def pick_strategy(
    model: nn.Module,
    config: Any,
    device_ids: DeviceIds,
    weights: list[float] | Literal["auto"] | None,
) -> Strategy:
    """The way of running a step for this process: no process group means one process
    (``"dp"``, whichever strategy is named), else ``config.strategy``, one for ranks."""
    import torch.distributed as dist

    from ..._core._errors import EvendpError

    ranks = dist.is_available() and dist.is_initialized()
    if ranks and not STRATEGIES[config.strategy].ranks:
        raise EvendpError(
            f"strategy={config.strategy!r} runs one process over device_ids, but this process "
            f"is rank {dist.get_rank()} of {dist.get_world_size()} (a process group is up); "
            f"pass a strategy for ranks ({', '.join(map(repr, rank_strategy_names()))})"
        )
    return STRATEGIES[config.strategy if ranks else "dp"].build(model, config, device_ids, weights)
