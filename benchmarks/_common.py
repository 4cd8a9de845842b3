"""What several benchmarks share: a clock of optimizer steps and a tiny token dataset.

Imported by the scripts run as ``python benchmarks/NAME.py`` (their folder is on ``sys.path``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch

__all__ = ["StepClock", "Tokens"]


class StepClock:
    """Wall time at the end of every optimizer step: the evendp Trainer's ``scheduler=`` (it
    steps it once per optimizer step), or an HF callback (:meth:`hf_callback`)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def step(self) -> None:
        self.times.append(time.perf_counter())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def median_step(self, last: int) -> float:
        """The median seconds of one of the ``last`` steps."""
        return statistics.median(b - a for a, b in itertools.pairwise(self.times[-last - 1 :]))

    def hf_callback(self) -> Any:
        import transformers

        clock = self

        class _Clock(transformers.TrainerCallback):
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.step()

        return _Clock()


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` rows of ``seq`` random token ids below ``vocab``, each its own label (seeded)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(1, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
