"""One process over several devices: :class:`BalancedDataParallel` splits each micro-step."""

from __future__ import annotations

import signal
import warnings
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from ..._core._calls import as_args
from ..._core._exact import step_count, sum_on
from ..._parallel._dp import BalancedDataParallel, validate_devices
from ..._planning._balance import device_sizes_for_memory, say_auto_sizes
from .._evaluate import EvalRun, evaluate_devices
from .._step import StepWeight
from ._base import Batch, SamplerInputs, Sampling, Strategy, build_sampler, place_model

__all__ = ["BalancedDP", "build"]


class BalancedDP(Strategy):
    """One process: :class:`BalancedDataParallel` splits each micro-step over ``device_ids``.

    The batch stays on the host (pinned when a device is a GPU) and each device's rows are
    copied straight to it by the scatter: nothing is staged on ``device_ids[0]`` first. Every
    replica returns its rows' loss summed over their counted items; the step's loss is their
    sum (the wrapper does not gather, so nothing is averaged and multiplied back). There is
    nothing to agree with another process: the consensus, the stop agreement and the
    reductions are the process's own values.
    """

    name = "dp"
    # One process: every part is its own.
    local_parts = frozenset({"backward", "optimizer"})
    #: The wrapper, built by :meth:`wrap` (the Trainer calls it before anything else).
    dp: BalancedDataParallel

    def __init__(
        self,
        model: nn.Module,
        device_ids: list[str | int | torch.device] | None,
        weights: list[float] | Literal["auto"] | None,
    ) -> None:
        # The model goes to the first device (BalancedDataParallel itself would refuse it).
        place_model(model, validate_devices(device_ids)[0], "device_ids[0]")
        super().__init__(model)
        self._device_ids = device_ids
        self._weights = weights  # "auto": planned with the sampler, from the first batch
        self.device_names = ["rank0"]

    def wrap(self, loss_module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        fixed = None if self._weights == "auto" else self._weights  # "auto": see sampler()
        self.dp = BalancedDataParallel(
            loss_module, self._device_ids, weights=fixed, gather_output=False
        )
        self.wrapped = self.dp
        self.devices = list(self.dp.device_ids)
        self.device_names = [
            f"{d}:{i}" if d.index is None else str(d) for i, d in enumerate(self.dp.device_ids)
        ]

    def sampler(self, inputs: SamplerInputs) -> Sampling:
        config = inputs.config
        if self._weights == "auto" or (config.batch_sizes == "auto" and self._weights is None):
            option = "weights" if self._weights == "auto" else "batch_sizes"
            self._plan_weights(inputs.model(), inputs.example(), config.batch_size, option)
        elif config.batch_sizes == "auto":
            warnings.warn(
                f"batch_sizes='auto' is ignored: weights={self._weights} were given, which "
                "split the batch over device_ids; drop one of them",
                UserWarning,
                stacklevel=3,
            )
        # One process draws the whole step (its devices' cost plan is the costs given, which
        # order each step's rows over the devices); a token budget needs the costs here too.
        budget = inputs if inputs.max_tokens is not None else replace(inputs, costs=None)
        built = build_sampler(
            replace(budget, max_costs=None), requested=[config.batch_size], rank=0, world=1,
            distributed=False,
        )  # fmt: skip
        return built._replace(costs=inputs.costs, max_costs=inputs.max_costs)

    def _plan_weights(
        self, loss_module: nn.Module, batch: Any, global_batch: int, option: str
    ) -> None:
        """``"auto"`` in one process: the planner's split over the devices' memory (the one
        meaning ``batch_sizes="auto"`` has under torchrun, per device here), said once."""
        sizes, source = device_sizes_for_memory(
            loss_module, as_args(batch), self.dp.device_ids, global_batch
        )
        self.dp.weights = [float(n) for n in sizes]
        say_auto_sizes(sizes, None, rank=0, option=option, per="device", source=source)

    def place(self, batch: Batch) -> Batch:
        return batch  # the scatter copies each device's rows straight from the host

    def shares(self, n: int) -> list[int]:
        return self.dp.split(n)

    def count_weight(self, local: torch.Tensor) -> StepWeight:
        total = step_count(local, device=self.dp.output_device)  # one process: no collective
        return StepWeight.ready(self.world, torch.as_tensor(total))

    def forward(self, part: Batch, rows: list[int]) -> torch.Tensor:
        with self.dp.fixed_sizes(rows):
            out = self.dp(*as_args(part))
        return sum_on(out.outputs, out.output_device)

    def reduce_losses(self, parts: torch.Tensor) -> torch.Tensor:
        return parts  # one process: the total is the step's

    def reduce_samples(self, samples: list[int]) -> list[int]:
        return list(samples)

    def agree_stop(
        self,
        step: int,
        votes: tuple[float, float] | None = None,
        *,
        starting: bool = False,
        interrupted: KeyboardInterrupt | None = None,
    ) -> int | None:
        if interrupted is not None:
            # The step it cut is not counted; the checkpoint is the last whole step's.
            return int(signal.SIGINT)
        return self._stop.signum  # one process: nothing to agree on

    def evaluate(self, run: EvalRun) -> dict[str, float]:
        return evaluate_devices(run, device_ids=self.dp.device_ids, weights=self.dp.weights)


def build(
    model: nn.Module,
    config: Any,
    device_ids: list[str | int | torch.device] | None,
    weights: list[float] | Literal["auto"] | None,
) -> BalancedDP:
    """The registry's ``"dp"``: one process over ``device_ids``."""
    return BalancedDP(model, device_ids, weights)
